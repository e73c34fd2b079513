"""The public surface is ``__all__``, exactly (like httpx's tests/faces/test_exported_members.py).

Every name in ``__all__`` exists, and every public attribute of the package (no leading
``_``, not a submodule, not a ``from __future__`` feature) is listed in ``__all__``: a name
made public by accident (an import left in ``__init__``) or listed but gone fails here.
"""

from __future__ import annotations
import __future__

import importlib
import types

import pytest

PACKAGES = ["asyncload", "asyncload.testing"]


def _public_attributes(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(
            value, types.ModuleType
        )  # submodules are reached by import, not by __all__
        and not isinstance(value, __future__._Feature)  # ``from __future__ import annotations``
    }


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_are_exported(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert len(exported) == len(set(exported)), f"{name}.__all__ lists a name twice"
    missing = [member for member in exported if not hasattr(module, member)]
    assert missing == [], f"{name}.__all__ lists names {name} does not have"


@pytest.mark.parametrize("name", PACKAGES)
def test_all_public_attributes_are_in_all(name: str) -> None:
    module = importlib.import_module(name)
    unlisted = sorted(_public_attributes(module) - set(module.__all__))
    assert unlisted == [], f"public attributes of {name} missing from its __all__"


def test_version_is_exported() -> None:
    import asyncload

    assert "__version__" in asyncload.__all__
    assert isinstance(asyncload.__version__, str) and asyncload.__version__
