"""The package's version (``asyncload.__version__``), here so that the faces can name it
without importing the public namespace."""

__version__ = "0.1.0"
