"""``python -m asyncload``: the same as the ``asyncload`` command (see :mod:`asyncload.cli`)."""

import sys

from asyncload.cli import main

if __name__ == "__main__":
    sys.exit(main())
