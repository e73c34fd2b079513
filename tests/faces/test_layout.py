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
    "common": 0,  # asyncload.common (errors, options, stats, latency, paths, loop), _version
    "decoding": 1,
    "storage": 1,
    "formats": 2,
    "engine": 3,
    "distributed": 4,
    "faces": 5,  # asyncload.faces, asyncload.cli, __init__, __main__
    "integrations": 6,
    "testing": 6,
}
#: The package root holds only its doors.
DOORS = {"__init__", "__main__", "_version"}
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
    if parts[1] in ("common", "_version"):
        return "common"
    return parts[1] if parts[1] in LAYERS else "faces"  # faces, cli, __main__


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` outside ``if TYPE_CHECKING:`` blocks (imports only a type checker
    makes)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """asyncload modules that ``module`` imports anywhere (top level or inside functions)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _runtime_nodes(tree):
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
            subs = [f"{mod}.{a.name}" for a in node.names]
            # "from a package import its module" runs the package's __init__, whose interface
            # is lazy (PEP 562): an edge to the module only
            names = subs if all(s in known for s in subs) else [mod, *subs]
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


def test_package_root_holds_only_its_doors() -> None:
    """The root holds ``__init__``, ``__main__`` and ``_version``; the shared core lives in
    ``asyncload.common``, the faces in ``asyncload.faces`` (and ``asyncload.cli``)."""
    assert sorted(p.stem for p in PKG.glob("*.py")) == sorted(DOORS)


def test_no_two_modules_share_a_name() -> None:
    """One name, one module: a name read in a traceback or an import says which file it is."""
    seen: dict[str, list[str]] = {}
    for module in _modules():
        if PKG.joinpath(*module.split(".")[1:], "__init__.py").exists():
            continue  # a package
        seen.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


#: Modules entered past the front door on purpose: the vLLM mapped loader shares the page
#: lease machinery of storage.mapped, whose module state (signal numbers found at run time)
#: a name imported once would copy stale.
SHARED_STATE = [("asyncload.integrations._vllm_mapped", ["mapped"])]
#: Modules imported whole through their wing's package, used qualified on purpose:
#: formats.plain holds asyncload's twins of DCP's plan types (``plain.ReadItem`` beside DCP's
#: ``ReadItem``), which a bare name would confuse.
QUALIFIED = {"formats": ["plain"]}


def test_wings_are_entered_by_their_front_door() -> None:
    """Outside a wing (engine, distributed, storage, formats, decoding), its names come from
    its package, whose ``__init__`` is its interface, never from one of its modules."""
    offenders = []
    for module, path in _modules().items():
        own = module.split(".")[1] if "." in module else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                parts = node.module.split(".")
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                parts, names = [], []
                for a in node.names:
                    if a.name.count(".") >= 2:
                        parts = a.name.split(".")
            else:
                continue
            if parts[:1] != ["asyncload"] or len(parts) < 2 or parts[1] not in WINGS:
                continue
            if parts[1] == own or (module, names) in SHARED_STATE:
                continue
            if len(parts) == 2 and names and set(names) <= set(QUALIFIED.get(parts[1], [])):
                continue
            wing_dir = PKG / parts[1]
            if len(parts) > 2 or any((wing_dir / f"{n}.py").exists() for n in names):
                offenders.append(f"{module}:{node.lineno} {'.'.join(parts)} {names}")
    assert sorted(offenders) == [], sorted(offenders)


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
            "asyncload._version",
            "asyncload.common",
            "asyncload.common.errors",
            "asyncload.common.latency",
            "asyncload.common.lazy",
            "asyncload.common.options",
            "asyncload.common.stats",
        ]
    )
    # the face needs no DCP either (a safetensors or torch.save load imports none: issue 45,
    # item 4, tests/faces/test_first_load_imports.py)
    assert second == "False"


#: The one module that makes semaphores: the engine's meter (issue 46, item 3).
SEMAPHORE_MAKERS = {"asyncload.engine.meter"}


def test_read_slots_come_from_the_meter() -> None:
    """No ``asyncio.Semaphore(`` (or ``BoundedSemaphore(``) is made in the package outside
    ``asyncload/engine/meter.py``: read slots are a ``Meter(n, unit="reads")``, so a change of
    read policy is made in one place."""
    made = []
    for module, path in _modules().items():
        if module in SEMAPHORE_MAKERS:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "asyncio.Semaphore(" in line or "asyncio.BoundedSemaphore(" in line:
                made.append(f"{module}:{n} {line.strip()}")
    assert made == [], made


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
