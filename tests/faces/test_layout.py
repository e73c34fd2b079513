"""The package's layout holds its promises (docs/pipeline.md, "Where things live"):

- no import cycle between asyncload's modules, counting imports inside functions;
- arrows point down: a wing imports only the wings below it (faces -> distributed ->
  engine -> formats -> decoding, storage -> the shared bottom modules);
- no module over 800 lines (the pickle VM's tuned loop may stay whole) and no class over 500;
- ``import asyncload`` changes no global warnings filter and imports only the bottom modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "asyncload"

#: Lower number = lower layer; a module may import its own layer or any lower one.
LAYERS = {
    "bottom": 0,  # asyncload._errors, _options, _stats, _latency, _paths, _loop, _version
    "decoding": 1,
    "storage": 1,
    "formats": 2,
    "engine": 3,
    "distributed": 4,
    "faces": 5,  # _api, _dcp, _read, _stream, cli, _convert, _progress, __init__
    "integrations": 6,
    "testing": 6,
}
BOTTOM = {"_errors", "_options", "_stats", "_latency", "_paths", "_loop", "_version"}
MAX_LINES = 800
MAX_CLASS_LINES = 500
WHOLE = {"asyncload.decoding.vm", "asyncload.decoding.vm.PickleVM"}  # the tuned loop stays whole


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "faces"
    if parts[1] in LAYERS and parts[1] not in ("bottom", "faces"):
        return parts[1]
    return "bottom" if parts[1] in BOTTOM else "faces"


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """asyncload modules that ``module`` imports anywhere (top level or inside functions)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {m: _imports(m, p, known) for m, p in mods.items()}
    # importing a package runs its __init__: an import of asyncload.x.y also imports asyncload.x
    return graph


def test_no_import_cycle_counting_imports_inside_functions() -> None:
    graph = _graph()
    # Tarjan's strongly connected components; the root package re-exports the faces and is
    # imported by nothing inside the package except through its own name (checked below).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w == "asyncload":
                continue  # the public namespace; "faces import nothing from it" is its own test
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], cycles


def test_library_modules_do_not_import_the_public_namespace() -> None:
    graph = _graph()
    offenders = sorted(
        m
        for m, deps in graph.items()
        if "asyncload" in deps
        and _layer(m) not in ("integrations", "testing")
        and m != "asyncload"
    )
    assert offenders == [], offenders


def test_arrows_point_down() -> None:
    graph = _graph()
    upward = []
    for m, deps in graph.items():
        for d in deps:
            if d == "asyncload":
                continue
            if LAYERS[_layer(d)] > LAYERS[_layer(m)]:
                upward.append(f"{m} -> {d}")
    assert sorted(upward) == [], sorted(upward)


def test_module_and_class_sizes() -> None:
    too_long = []
    for module, path in _modules().items():
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_LINES and module not in WHOLE:
            too_long.append(f"{module}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES and f"{module}.{node.name}" not in WHOLE:
                    too_long.append(f"{module}.{node.name}: class of {size} lines")
    assert too_long == [], too_long


@pytest.mark.parametrize("name", ["asyncload"])
def test_import_changes_no_global_warnings_filter(name: str) -> None:
    code = (
        "import warnings, torch; before = list(warnings.filters); "
        f"import {name}; after = list(warnings.filters); "
        "print([f for f in after if f not in before])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


TESTS = PKG.parent / "tests"
WINGS = {"engine", "storage", "distributed", "decoding", "formats"}


def test_tests_mirror_the_wings_and_use_their_interfaces() -> None:
    """Tests live in a folder per wing (tests/engine, storage, distributed, decoding,
    formats) or in tests/faces, and import the public API, ``asyncload.testing``, the bottom
    modules, any wing's stated interface (its package: ``asyncload.storage``) and the modules
    of their own wing, never another wing's private module."""
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], "every test file belongs to a wing's folder or to tests/faces"
    crossing = []
    for path in sorted(TESTS.glob("*/test_*.py")):
        wing = path.parent.name
        if wing == "titan":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                crosses = len(parts) > 2 and parts[1] in WINGS and parts[1] != wing
                if parts[0] == "asyncload" and crosses:
                    crossing.append(f"tests/{wing}/{path.name}:{node.lineno} {name}")
    assert crossing == [], crossing


def test_import_is_cheap() -> None:
    """``import asyncload`` after ``import torch`` imports only the small bottom modules (not
    torch.distributed.checkpoint, the engine or a storage client): counted, not timed. The
    faces are imported on first use, and ``asyncload.load`` then works."""
    code = (
        "import sys, torch; before = set(sys.modules); import asyncload; "
        "print(sorted(set(sys.modules) - before)); "
        "asyncload.load; print('torch.distributed.checkpoint' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    first, second = out.stdout.splitlines()
    assert first == str(
        [
            "asyncload",
            "asyncload._errors",
            "asyncload._latency",
            "asyncload._options",
            "asyncload._stats",
            "asyncload._version",
        ]
    )
    # the face needs no DCP either (a safetensors or torch.save load imports none: issue 45,
    # item 4, tests/faces/test_first_load_imports.py)
    assert second == "False"


if __name__ == "__main__":  # python tests/faces/test_layout.py: list every violation
    for test in (
        test_no_import_cycle_counting_imports_inside_functions,
        test_library_modules_do_not_import_the_public_namespace,
        test_arrows_point_down,
        test_module_and_class_sizes,
    ):
        try:
            test()
        except AssertionError as exc:
            print(f"{test.__name__}:")
            left = exc.args[0] if exc.args else ""
            print(f"  {left}"[:4000])
