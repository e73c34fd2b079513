"""A benchmark's folded-in parts: ``python benchmarks/HOST.py --part NAME [ARGS...]`` runs the
part ``NAME`` (a ``_*.py`` module beside the host, listed in benchmarks/README.md) with
``ARGS``, as if it were its own script, then exits; without ``--part`` the host runs as usual.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def run_part(host: str, parts: dict[str, str]) -> None:
    """Run the part that ``sys.argv`` names (``--part NAME`` first, or ``--part=NAME``) and
    exit; return when it names none. ``parts`` maps each name to its module's file name."""
    argv = sys.argv[1:]
    if argv[:1] == ["--part"] and len(argv) >= 2:
        name, rest = argv[1], argv[2:]
    elif argv and argv[0].startswith("--part="):
        name, rest = argv[0].split("=", 1)[1], argv[1:]
    else:
        if "-h" in argv or "--help" in argv:
            names = ", ".join(sorted(parts))
            print(
                f"{Path(host).name} --part NAME [ARGS...] runs a part: {names} (benchmarks/README.md)"
            )
        return
    if name not in parts:
        sys.exit(f"{Path(host).name}: no part {name!r}; parts: {', '.join(sorted(parts))}")
    path = str(Path(host).resolve().parent / parts[name])
    sys.argv = [path, *rest]
    runpy.run_path(path, run_name="__main__")
    sys.exit(0)
