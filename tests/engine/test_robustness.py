"""Robustness: Ctrl-C at any point of a sync load (local and over HTTP), cancellation of
aload, fork safety, memory under concurrency 64 with a small budget, and loading from a
directory that a save is writing into.

The Ctrl-C, fork and memory checks run in child processes (``_ctrlc_child.py``,
``_fork_child.py``, ``_memory_child.py``, ``_writer_child.py``): a signal or a fork inside
pytest's own process would be the test's problem, not the library's.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt import asyncload_threads, live_threads, make_checkpoint, open_fds_under
from torch.distributed.checkpoint import FileSystemWriter

import asyncload
from asyncload import CheckpointFormatError, CheckpointNotFoundError, LoadOptions
from asyncload.engine.meter import Meter
from asyncload.testing.interrupts import dcp_load, interrupted, tasks_on_library_loops

TESTS = Path(__file__).parents[1]  # the child scripts live beside conftest.py
MiB = 1 << 20


def _child(script: str, *args: Any, timeout: float = 150) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, str(TESTS / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=TESTS,
        check=False,
    )
    assert res.returncode == 0, (
        f"{script} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def _budgets_in_use() -> list[int]:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meters = [b for b in gc.get_objects() if isinstance(b, Meter)]
        return [b.used for b in meters if b.name == "read budget" and b.used]


@pytest.fixture(scope="module")
def ckpt_128m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 tensors of 8 MiB; tensor i is filled with i (what _ctrlc_child.py checks)."""
    return make_checkpoint(
        tmp_path_factory.mktemp("c128") / "ckpt",
        {f"t{i}": torch.full((1024, 2048), float(i)) for i in range(16)},
    )


# --- Ctrl-C and cancellation --------------------------------------------------------


#: From "before the metadata is read" to "after the load finished", on this machine's speed.
_DELAYS = [0.0, 0.003, 0.02, 0.08, 0.25, 1.5]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["local", "http"])
def test_ctrl_c_at_any_point_leaves_nothing_behind(ckpt_128m: Path, where: str) -> None:
    """SIGINT delivered to the main thread and ``_thread.interrupt_main`` (locally), a real
    SIGINT over HTTP through a proxy, at points spread over a sync ``asyncload.load``:
    KeyboardInterrupt comes back within 2 s; no asyncload-io thread, open file, connection,
    task on the library's loop, or budget in use remains; the next load in the same process
    is bit-exact."""
    if where == "local":
        out = _child("_ctrlc_child.py", ckpt_128m, "signal,interrupt_main", *_DELAYS, timeout=230)
    else:
        out = _child("_ctrlc_child.py", ckpt_128m, "http", 0.0, 0.05, 0.3, 4.0, timeout=230)
    runs = out["runs"]
    assert out["final_load_ok"]
    assert {r["mode"] for r in runs if r["outcome"] == "interrupted"} == (
        {"signal", "interrupt_main"} if where == "local" else {"http"}
    )
    assert runs[-1]["outcome"] == "completed"  # the last interrupt comes after the load
    for r in runs:
        where_ = f"{r['mode']}, interrupt after {r['delay']} s"
        if r["outcome"] == "interrupted":
            assert r["lag"] < 2.0, f"{where_}: control came back after {r['lag']:.2f} s"
        assert r["threads"] == [], where_
        assert r["fds"] == [], where_
        assert r["budget_used"] == [], where_
        assert r["tasks"] == 0, where_
        assert r.get("connections", []) == [], where_


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "face",
    [
        "load",
        # PipelinedReader's own calls hand the session a coroutine made before the call: a
        # Ctrl-C on entering it leaves that coroutine unawaited (Python says so); nothing open
        pytest.param(
            "dcp.load",
            marks=pytest.mark.filterwarnings(
                "ignore:coroutine .* was never awaited:RuntimeWarning"
            ),
        ),
    ],
)
def test_a_ctrl_c_at_every_line_of_the_sync_driver_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    """The thread that calls ``asyncload.load`` (or ``dcp.load`` with ``PipelinedReader``)
    drives the load (``engine/driver.py``): a Ctrl-C can land on it at any line. Raised
    before each line in turn that the driver runs (the steps, their loop,
    ``LoadSession.run`` and the wait on the loop thread), each time in a new load: the load
    raises KeyboardInterrupt (``dcp.load`` wraps it in its CheckpointException) or had
    finished (then bit-exact), and leaves no open file, no task on the library's loop, no
    budget in use, no I/O thread; the next load is bit-exact. CI once hit one such line
    (between queueing the task and the ``try`` that cancels it): the task ran on unwatched,
    and ``.metadata`` stayed open."""
    from asyncload.common import loop as _loop
    from asyncload.engine import driver
    from asyncload.engine.session import LoadSession

    want = {f"t{i}": torch.full((64, 64), float(i)) for i in range(4)}
    path = make_checkpoint(tmp_path / "ckpt", want)
    codes = {
        _loop.run_sync.__code__,
        driver.run_sync.__code__,
        driver._drive.__code__,
        driver.load_steps.__code__,
        driver.read_steps.__code__,
        LoadSession.run.__code__,
    }
    threads_before = live_threads("asyncload-io")
    tasks_before = tasks_on_library_loops()
    meters: weakref.WeakSet[Meter] = weakref.WeakSet()  # the loads' budgets (a scan of every
    init = Meter.__init__  # object, as _budgets_in_use does, takes 0.3 s here)

    def recorded(self: Meter, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        meters.add(self)

    monkeypatch.setattr(Meter, "__init__", recorded)

    def load(n: int) -> tuple[int, str | None, dict[str, torch.Tensor]]:
        dest = {k: torch.zeros(64, 64) for k in want}

        def run() -> None:
            if face == "load":
                asyncload.load(dest, path)
            else:
                dcp_load(dest, path)

        return (*interrupted(run, codes.__contains__, n), dest)

    lines, where, dest = load(0)
    assert where is None and all(torch.equal(dest[k], want[k]) for k in want)
    assert lines > 100  # the trace sees the driver (183 lines in this version)
    stopped = 0
    for n in range(1, lines + 1):
        _, where, dest = load(n)
        if where is None:  # fewer lines this time (a wait's loop ran fewer rounds)
            assert all(torch.equal(dest[k], want[k]) for k in want), n
        else:
            stopped += 1
        assert open_fds_under(path) == [], where
        assert tasks_on_library_loops() == tasks_before, where
        assert [m.used for m in meters if m.used] == [], where
        deadline = time.monotonic() + 3
        while asyncload_threads(ignore=threads_before) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asyncload_threads(ignore=threads_before) == [], where
    assert stopped >= lines - 5
    assert len(meters) > 0 and _budgets_in_use() == []
    _, where, dest = load(0)
    assert where is None and all(torch.equal(dest[k], want[k]) for k in want)


@pytest.mark.timeout(200)
# a Ctrl-C that lands as a read's coroutine is handed over (entering ``_FileStore.run``)
# leaves it unawaited: Python says so beside the KeyboardInterrupt; nothing is left open
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_a_ctrl_c_at_every_line_of_safe_open_leaves_nothing_behind(tmp_path: Path) -> None:
    """``asyncload.safe_open`` runs on the calling thread but for its reads: a Ctrl-C raised
    before each line in turn of ``asyncload/faces/safe_open.py`` and of the wait on the loop thread
    (opening, ``get_tensor``, ``get_slice``, closing at the ``with``'s end), each time in a
    new use: it raises KeyboardInterrupt (or the tensors came back bit-exact) and leaves no
    open file and no task on the library's loop. A file that the interrupt kept from its
    ``with`` (it landed in ``__enter__``) is closed once dropped, as Python's own files are."""
    from safetensors.torch import save_file

    from asyncload.common import loop as _loop

    want = {f"t{i}": torch.full((64, 64), float(i)) for i in range(4)}
    save_file(want, str(tmp_path / "m.safetensors"))
    tasks_before = tasks_on_library_loops()

    def traced(code: Any) -> bool:
        return code.co_filename.endswith("faces/safe_open.py") or code is _loop.run_sync.__code__

    def use(n: int) -> tuple[int, str | None, dict[str, torch.Tensor]]:
        got: dict[str, torch.Tensor] = {}

        def read() -> None:
            with asyncload.safe_open(tmp_path / "m.safetensors", framework="pt") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open's API
                    got[k] = f.get_tensor(k)
                got["slice"] = f.get_slice("t1")[2:5, 7:9]

        return (*interrupted(read, traced, n), got)

    use(0)  # the first use runs lines once per process (imports, caches)
    lines, where, got = use(0)
    assert where is None and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(got["slice"], want["t1"][2:5, 7:9])
    assert lines > 200  # the trace sees safe_open (about 480 lines in this version)
    stopped = 0
    for n in range(1, lines + 1):
        _, where, got = use(n)
        if where is None:
            assert all(torch.equal(got[k], want[k]) for k in want), n
        else:
            stopped += 1
        assert open_fds_under(tmp_path) == [], where
        assert tasks_on_library_loops() == tasks_before, where
    assert stopped >= lines - 5


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_aload_cancelled_at_many_points_keeps_the_budget_whole(ckpt_128m: Path) -> None:
    before = live_threads("asyncload-io")
    opts = LoadOptions(
        chunk_size=MiB, min_chunk_size=64 << 10, concurrency=8, memory_budget=4 * MiB
    )
    cancelled = 0
    for spins in (0, 1, 3, 10, 30, 100, 300, 1000):
        dest = {f"t{i}": torch.zeros(1024, 2048) for i in range(16)}
        task = asyncio.ensure_future(asyncload.aload(dest, ckpt_128m, options=opts))
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled += 1
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        assert open_fds_under(ckpt_128m) == []
        assert _budgets_in_use() == []
        deadline = time.monotonic() + 3
        while asyncload_threads(ignore=before) and time.monotonic() < deadline:  # noqa: ASYNC110 - threads, not tasks
            await asyncio.sleep(0.01)
        assert asyncload_threads(ignore=before) == []
    assert cancelled >= 4
    dest = {f"t{i}": torch.zeros(1024, 2048) for i in range(16)}
    await asyncload.aload(dest, ckpt_128m, options=opts)
    assert all(torch.equal(dest[f"t{i}"], torch.full((1024, 2048), float(i))) for i in range(16))


# --- fork ---------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_fork_safety(tmp_path: Path) -> None:
    """A process that used asyncload forks (os.fork while a background load runs, and a
    multiprocessing 'fork' pool like DataLoader workers); each child loads on a fresh loop
    thread and executor, bit-exact; the parent's own load is unharmed."""
    path = make_checkpoint(
        tmp_path / "ckpt", {f"t{i}": torch.full((256, 256), float(i)) for i in range(8)}
    )
    out = _child("_fork_child.py", path, timeout=190)
    assert out == {
        "parent_first": True,
        "os_fork_child_exit": 0,
        "parent_background": True,
        "fork_pool": [True, True, True, True],
        "parent_after": True,
    }


# --- memory -------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_peak_rss_above_destination_under_concurrency_64(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """256 MiB checkpoint, concurrency 64, memory_budget 8 MiB, 128 KiB chunks, into
    contiguous destinations (reads land in them) and into transposed views (every byte
    staged): the peak RSS above the (touched) destination stays within the budget plus a
    fixed overhead (a generous 64 MiB here; docs/integrity.md has the measured figures)."""
    path = _ckpt_256m(tmp_path_factory)
    budget = 8 * MiB
    out = _child(
        "_memory_child.py",
        path,
        32,
        2048,
        1024,
        64,
        budget,
        128 << 10,
        "contiguous,transposed",
        timeout=190,
    )
    assert [r["layout"] for r in out] == ["contiguous", "transposed"]
    for r in out:
        assert r["ok"], r
        assert r["peak_buffered_bytes"] <= budget, r
        if r["layout"] == "contiguous":
            # reads straight into the destinations: one run per file, which holds (and has in
            # flight) one 128 KiB read per I/O thread; they buffer nothing
            assert 2 * (128 << 10) <= r["peak_buffered_bytes"] <= 16 * (128 << 10), r
            assert 2 <= r["peak_concurrency"] <= 16, r
        else:
            assert r["peak_buffered_bytes"] >= budget // 2, (
                r
            )  # staged reads: the budget really filled up
            assert r["peak_concurrency"] >= 32, r
        assert r["above_destination"] <= budget + 64 * MiB, r


_CKPT_256: list[Path] = []


def _ckpt_256m(factory: pytest.TempPathFactory) -> Path:
    if not _CKPT_256:
        _CKPT_256.append(
            make_checkpoint(
                factory.mktemp("c256") / "ckpt",
                {f"t{i}": torch.full((2048, 1024), float(i)) for i in range(32)},
            )
        )
    return _CKPT_256[0]


# --- a save in progress -------------------------------------------------------------


def _save(path: Path, k: float, *, n: int, rows: int, cols: int, single: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save(
            {f"t{i}": torch.full((rows, cols), k) for i in range(n)},
            storage_writer=FileSystemWriter(path, single_file_per_rank=single, overwrite=True),
            no_dist=True,
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "single_file", [True, False], ids=["one-file-per-rank", "one-file-per-item"]
)
def test_load_while_a_save_overwrites_the_checkpoint(tmp_path: Path, single_file: bool) -> None:
    """torch's dcp.save rewrites the checkpoint in place (old .metadata kept until the
    end) while loads run: each load gives every tensor one save's values, or raises
    CheckpointFormatError / CheckpointNotFoundError. Never a torn tensor. With one file per
    rank (DCP's default) every successful load is one complete save; with one file per
    item, files already rewritten before the load started cannot be told from old ones
    (DCP keeps no save id in its data files), so tensors may come from different saves:
    documented in docs/integrity.md."""
    n, rows, cols = 8, 2048, 1024  # 64 MiB per save
    path = tmp_path / "ckpt"
    _save(path, 0.0, n=n, rows=rows, cols=cols, single=single_file)
    writer = subprocess.Popen(
        [
            sys.executable,
            str(TESTS / "_writer_child.py"),
            *map(str, (path, 3, n, rows, cols, int(single_file))),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        outcomes: dict[str, int] = {}
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            dest = {f"t{i}": torch.full((rows, cols), -1.0) for i in range(n)}
            try:
                asyncload.load(
                    dest, path, options=LoadOptions(chunk_size=4 * MiB, min_chunk_size=MiB)
                )
            except CheckpointFormatError as exc:
                kind = (
                    "changed"
                    if "changed while" in str(exc)
                    else "truncated"
                    if "truncated" in str(exc)
                    else f"format: {exc}"
                )
                outcomes[kind] = outcomes.get(kind, 0) + 1
                continue
            except CheckpointNotFoundError:
                outcomes["metadata missing"] = outcomes.get("metadata missing", 0) + 1
                continue
            firsts = [float(t.reshape(-1)[0]) for t in dest.values()]
            for key, t in dest.items():
                assert bool((t == t.reshape(-1)[0]).all()), f"{key} is torn: it holds two saves"
            assert min(firsts) >= 0, "a tensor was not loaded"
            kind = "one save" if len(set(firsts)) == 1 else "saves mixed across files"
            outcomes[kind] = outcomes.get(kind, 0) + 1
    finally:
        saves = writer.communicate(timeout=60)[0].strip()
    assert sum(outcomes.values()) >= 3, outcomes
    assert not any(k.startswith("format:") for k in outcomes), outcomes
    if single_file:
        assert "saves mixed across files" not in outcomes, outcomes
    print(f"{'single' if single_file else 'multi'}-file: {outcomes}, {saves} saves")


def test_load_before_the_first_save_finished(tmp_path: Path) -> None:
    """Data files written, .metadata not yet (or only its .tmp): a clear error."""
    path = make_checkpoint(tmp_path / "ckpt", {"w": torch.randn(64, 64)})
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").unlink()
    (path / ".metadata.tmp").write_bytes(data[: len(data) // 2])
    dest = {"w": torch.zeros(64, 64)}
    with pytest.raises(CheckpointNotFoundError, match="save did not finish"):
        asyncload.load(dest, path)
    assert torch.count_nonzero(dest["w"]) == 0
    assert open_fds_under(path) == []


def test_metadata_replaced_between_metadata_and_data(tmp_path: Path) -> None:
    """A save finishes (renames a new .metadata in, as DCP's writer does) after the load
    read the old one and before it finished: the load says so instead of returning a mix."""
    path = make_checkpoint(tmp_path / "ckpt", {"w": torch.full((256, 256), 1.0)})
    state = {"done": False}

    def progress(done: int, total: int) -> None:
        if not state["done"]:
            state["done"] = True
            shutil.copy(path / ".metadata", path / ".metadata.tmp")
            os.replace(path / ".metadata.tmp", path / ".metadata")  # same bytes, a new file

    with pytest.raises(CheckpointFormatError, match=r"\.metadata changed while it was being read"):
        asyncload.load(
            {"w": torch.zeros(256, 256)},
            path,
            options=LoadOptions(chunk_size=1 << 16, min_chunk_size=1 << 12),
            progress=progress,
        )
    assert state["done"]
