"""The public surface is ``__all__``, exactly (like httpx's tests/faces/test_exported_members.py).

Every name in ``__all__`` exists, and every public attribute of the package (no leading
``_``, not a submodule, not a ``from __future__`` feature) is listed in ``__all__``: a name
made public by accident (an import left in ``__init__``) or listed but gone fails here.
"""

from __future__ import annotations
import __future__

import importlib
import subprocess
import sys
import types

import pytest

PACKAGES = ["asyncload", "asyncload.testing", "asyncload.distributed"]


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


def test_the_public_face_stays_small() -> None:
    import asyncload

    assert len(asyncload.__all__) <= 26, sorted(asyncload.__all__)


#: Names that moved from ``asyncload`` to ``asyncload.distributed`` (only a load on several
#: ranks meets them); the old spelling still works, with a DeprecationWarning.
MOVED = ["BackgroundSends", "DistributedLoadError", "InFlightRequest", "RankProgress"]


@pytest.mark.parametrize("name", MOVED)
def test_moved_names_warn_at_the_callers_line_and_are_the_same_objects(name: str) -> None:
    import asyncload
    import asyncload.distributed

    assert name not in asyncload.__all__ and name in asyncload.distributed.__all__
    with pytest.warns(DeprecationWarning, match=rf"asyncload\.distributed\.{name}") as got:
        old = getattr(asyncload, name)
    assert old is getattr(asyncload.distributed, name)
    assert [w.filename for w in got] == [__file__]
    with pytest.warns(DeprecationWarning) as again:  # not cached: every use warns
        exec(f"from asyncload import {name} as old_again", {})
    assert {w.filename for w in again} == {"<string>"}
    assert name not in vars(asyncload)


def test_wait_for_background_sends_stays_at_the_top() -> None:
    import asyncload
    import asyncload.distributed

    assert "wait_for_background_sends" in asyncload.__all__
    assert asyncload.wait_for_background_sends is asyncload.distributed.wait_for_background_sends


def test_importing_the_distributed_names_package_is_cheap() -> None:
    """``import asyncload.distributed`` imports only the package and the bottom modules; its
    names' modules (sends, lateness, in_flight) come on first use."""
    code = (
        "import sys, torch; before = set(sys.modules); import asyncload.distributed; "
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('asyncload')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == str(
        [
            "asyncload",
            "asyncload._version",
            "asyncload.common",
            "asyncload.common.errors",
            "asyncload.common.latency",
            "asyncload.common.lazy",
            "asyncload.common.options",
            "asyncload.common.stats",
            "asyncload.distributed",
        ]
    )
