"""The restructured engine as a user meets it: importing asyncload has no side effects and a
load prints nothing; the blocking API refuses to run on its own loop thread instead of
hanging; ``aload`` runs natively on the caller's loop (no helper loop thread) and a cancel
leaves no I/O thread; one ``LoadOptions`` governs a load (``asyncload.load``), or the
reader's then the planner's (plain ``dcp.load``); ``LoadOptions`` pickles and replaces
with its derived fields intact."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import (
    THREADS_BEFORE,
    assert_bitwise_equal,
    asyncload_threads,
    live_threads,
    random_tensor,
    tensor_bytes,
    thread_baseline,  # noqa: F401 - autouse fixture
    zeros_like_tree,
)
from _remote import wait_closed

import asyncload
from asyncload import LoadOptions, PipelinedLoadPlanner, PipelinedReader
from asyncload.testing import delay, stall

pytestmark = pytest.mark.timeout(60)

KiB = 1 << 10
#: Small chunks: the 256 KiB tensor is a "large" record, read in several chunks whose
#: progress is reported from the event loop (small records are reported from I/O threads).
SMALL_CHUNKS = LoadOptions(chunk_size=64 * KiB, retries=0, hedge=False)
#: Only ranged reads of tensor data (not .metadata, not HEAD/info requests).
DATA = {"path": ".distcp", "range_only": True, "data_only": True}


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict[str, Any]:
    """What this module's ``ckpt`` holds: one large record, small ones and an object."""
    return {
        "big": random_tensor((64, 1024), torch.float32, seed=11),  # 256 KiB
        "small": random_tensor((33,), torch.int16, seed=12),
        "half": random_tensor((7, 9), torch.bfloat16, seed=13),
        "step": 123,
    }


def _dst(sd: dict[str, Any]) -> dict[str, Any]:
    return zeros_like_tree(sd, object_placeholder=None)


# --- a. no import-time side effects, nothing printed -----------------------------------------

_CHILD = textwrap.dedent(
    """
    import hashlib, json, logging, sys, threading, warnings
    # what asyncload imports from torch changes the warning filters itself: take them first
    import numpy, torch, torch.distributed.checkpoint, torch.distributed.checkpoint.default_planner
    filters = list(warnings.filters)
    root = logging.getLogger()
    handlers, log_filters, level = list(root.handlers), list(root.filters), root.level
    threads = sorted(t.name for t in threading.enumerate())
    import asyncload
    out = {
        "filters_same": warnings.filters == filters,
        "root_same": (root.handlers, root.filters, root.level) == (handlers, log_filters, level),
        "threads_before": threads,
        "threads_after": sorted(t.name for t in threading.enumerate()),
        "imported": sorted(m for m in ("s3fs", "gcsfs", "aiohttp", "uvloop", "fsspec") if m in sys.modules),
    }
    dst = {"big": torch.zeros(64, 1024), "small": torch.zeros(33, dtype=torch.int16),
           "half": torch.zeros(7, 9, dtype=torch.bfloat16), "step": None}
    stats = asyncload.load(dst, sys.argv[1])
    out["bytes_assembled"] = stats.bytes_assembled
    out["step"] = dst["step"]
    out["sha256"] = {k: hashlib.sha256(dst[k].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                     for k in ("big", "small", "half")}
    print(json.dumps(out))
    """
)


def test_import_has_no_side_effects_and_a_load_prints_nothing(ckpt):
    path, sd = ckpt
    env = {
        k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"
    }  # Python's default filters
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    # nothing on stderr: no warning (torch's "torch.distributed is disabled" one included:
    # asyncload.load does not go through dcp.load), no log line, no traceback
    assert proc.stderr == ""
    out = json.loads(proc.stdout)
    assert out["filters_same"] is True
    assert out["root_same"] is True
    assert out["threads_before"] == ["MainThread"] and out["threads_after"] == ["MainThread"]
    # the storage clients and uvloop are imported when a load needs them, not with asyncload
    assert out["imported"] == []
    assert out["bytes_assembled"] == 64 * 1024 * 4 + 33 * 2 + 7 * 9 * 2
    assert out["step"] == 123
    assert out["sha256"] == {
        k: hashlib.sha256(tensor_bytes(sd[k])).hexdigest() for k in ("big", "small", "half")
    }


_LOOP_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys, threading
    import torch
    if sys.argv[3] == "uvloop":
        import uvloop  # the program's own import
    import asyncload

    def loops():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("asyncload-loop"))

    def digest(dst):
        return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for k, v in dst.items() if isinstance(v, torch.Tensor)}

    def dst():
        return {"big": torch.zeros(64, 1024), "small": torch.zeros(33, dtype=torch.int16),
                "half": torch.zeros(7, 9, dtype=torch.bfloat16), "step": None}

    out = {}
    nested = []

    def progress(done, total):  # a load from the library's loop thread: refused
        name = threading.current_thread().name
        if name.startswith("asyncload-loop") and len(nested) < int(sys.argv[2]):
            try:
                asyncload.load(dst(), sys.argv[1])
            except asyncload.LoadReentryError as exc:
                nested.append((name, type(exc).__name__))
                raise

    for i in range(3):
        d = dst()
        try:
            asyncload.load(d, sys.argv[1], progress=progress,
                           options=asyncload.LoadOptions(chunk_size=64 * 1024, retries=0, hedge=False))
            out[f"load{i}"] = {"ok": True, "sha256": digest(d)}
        except asyncload.LoadReentryError:
            out[f"load{i}"] = {"ok": False}
        out[f"load{i}"].update(loops=loops(), uvloop="uvloop" in sys.modules)
    out["nested"] = nested
    print(json.dumps(out))
    """
)


def _loop_child(path: Any, nested: int, imports: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _LOOP_CHILD, str(path), str(nested), imports],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_local_loads_run_on_the_standard_loop_unless_uvloop_is_imported(ckpt):
    """A local load never imports uvloop (2-4 ms, more than it saves in one load; and a fork
    while another thread imports it would leave the child waiting on the import's lock):
    every load of a process that has not imported it runs on the standard loop, bit for bit.
    A load from a progress callback on the loop thread is refused there as on uvloop's."""
    pytest.importorskip("uvloop")  # a test dependency
    path, sd = ckpt
    want = {k: hashlib.sha256(tensor_bytes(sd[k])).hexdigest() for k in ("big", "small", "half")}
    out = _loop_child(path, 2, "none")
    # loads 0 and 1 call asyncload.load from their progress callback: refused, each failing its load
    assert out["load0"] == {"ok": False, "loops": ["asyncload-loop"], "uvloop": False}
    assert out["load1"] == {"ok": False, "loops": ["asyncload-loop"], "uvloop": False}
    assert out["nested"] == [["asyncload-loop", "LoadReentryError"]] * 2
    assert out["load2"] == {
        "ok": True,
        "sha256": want,
        "loops": ["asyncload-loop"],
        "uvloop": False,
    }


def test_local_loads_run_on_uvloop_once_the_program_imported_it(ckpt):
    pytest.importorskip("uvloop")
    path, sd = ckpt
    want = {k: hashlib.sha256(tensor_bytes(sd[k])).hexdigest() for k in ("big", "small", "half")}
    out = _loop_child(path, 1, "uvloop")
    assert out["load0"] == {"ok": False, "loops": ["asyncload-loop-uvloop"], "uvloop": True}
    assert out["nested"] == [["asyncload-loop-uvloop", "LoadReentryError"]]
    for i in (1, 2):
        assert out[f"load{i}"] == {
            "ok": True,
            "sha256": want,
            "loops": ["asyncload-loop-uvloop"],
            "uvloop": True,
        }


def test_a_module_still_being_imported_is_not_used():
    """A module another thread (or a thread a fork left behind) is still importing does not
    count as imported: using it would wait on its import's lock."""
    from asyncload.common.loop import _imported

    class Spec:
        _initializing = True

    fake = type(sys)("asyncload_test_half_imported")
    fake.__spec__ = Spec()  # type: ignore[assignment]
    sys.modules[fake.__name__] = fake
    try:
        assert _imported(fake.__name__) is False
        Spec._initializing = False
        assert _imported(fake.__name__) is True
    finally:
        del sys.modules[fake.__name__]
    assert _imported("asyncload_test_never_imported") is False


def test_a_session_keeps_its_loop_for_the_whole_load(ckpt):
    """Every step of one sync load runs on the loop its first step chose, even when the
    process's choice changes meanwhile (its storage's clients belong to that loop)."""
    from asyncload.common import loop as _loop

    path, _sd = ckpt
    reader = PipelinedReader(path)
    session = reader.session
    first = session._library_loop()
    assert session._library_loop() is first and first.is_running()
    seen: list[asyncio.AbstractEventLoop] = []

    async def where() -> None:
        seen.append(asyncio.get_running_loop())

    other = _loop.loop_thread(
        not any(lt.loop is first and lt.uvloop for lt in _loop._threads.values())
    )
    assert other is not first
    session.run(where())
    session.run(where())
    assert seen == [first, first]


# --- b. the re-entry guard ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_load_from_a_progress_callback_on_the_loop_thread_raises_reentry_error(ckpt):
    path, sd = ckpt
    attempts: list[BaseException] = []
    calls: list[str] = []

    def progress(done: int, total: int) -> None:
        name = threading.current_thread().name
        calls.append(name)
        if name.startswith("asyncload-loop"):
            try:
                asyncload.load(_dst(sd), path)
            except BaseException as exc:
                attempts.append(exc)
                raise

    dst = _dst(sd)
    with pytest.raises(asyncload.LoadReentryError) as ei:
        asyncload.load(dst, path, options=SMALL_CHUNKS, progress=progress)
    err = ei.value
    assert isinstance(err, asyncload.AsyncLoadError) and isinstance(err, RuntimeError)
    assert "progress callback" in str(err) and "aload" in str(err)
    # the nested load was tried on the loop thread, and that is what failed the outer one
    assert attempts and all(isinstance(e, asyncload.LoadReentryError) for e in attempts)
    assert type(err) is type(attempts[0]) and str(err) == str(attempts[0])
    assert any(n.startswith("asyncload-loop") for n in calls)
    # the library's loop is healthy: the same load again, bit for bit, from this thread
    dst = _dst(sd)
    stats = asyncload.load(dst, path, options=SMALL_CHUNKS)
    assert_bitwise_equal(dst, sd)
    assert stats.bytes_assembled == 64 * 1024 * 4 + 33 * 2 + 7 * 9 * 2
    assert asyncload_threads("asyncload-io", ignore=THREADS_BEFORE) == []


def test_waiting_on_a_background_load_from_the_loop_thread_raises_reentry_error(ckpt):
    """``start_load(...).result()`` from a callback on the library's loop thread would wait on
    the loop it blocks: a clear error at once, not a hang."""
    path, sd = ckpt
    attempts: list[BaseException] = []

    def progress(done: int, total: int) -> None:
        if threading.current_thread().name.startswith("asyncload-loop") and not attempts:
            handle = asyncload.start_load(_dst(sd), path)
            try:
                handle.result(timeout=30)
            except BaseException as exc:
                attempts.append(exc)
                handle.cancel()
                raise

    with pytest.raises(asyncload.LoadReentryError, match="LoadHandle.result"):
        asyncload.load(_dst(sd), path, options=SMALL_CHUNKS, progress=progress)
    assert len(attempts) == 1 and isinstance(attempts[0], asyncload.LoadReentryError)
    dst = _dst(sd)
    asyncload.load(dst, path, options=SMALL_CHUNKS)
    assert_bitwise_equal(dst, sd)


def test_blocking_api_from_a_coroutine_on_the_library_loop_raises():
    """The guard itself: ``run_sync`` on the loop it would wait on."""
    from asyncload.common.loop import loop_thread, run_sync

    loop = loop_thread(False)

    async def inner() -> int:
        return 1

    async def outer() -> int:
        return run_sync(inner(), loop)

    with pytest.raises(asyncload.LoadReentryError):
        run_sync(outer(), loop)
    assert run_sync(inner(), loop) == 1


# --- c. aload runs natively on the caller's loop -----------------------------------------------


@pytest.mark.asyncio
async def test_aload_runs_on_the_callers_loop_without_helper_threads(ckpt):
    path, sd = ckpt
    loop = asyncio.get_running_loop()
    before = set(threading.enumerate())
    during: list[set[threading.Thread]] = []
    on_loop: list[bool] = []

    def progress(done: int, total: int) -> None:
        during.append(set(threading.enumerate()))
        if threading.current_thread() is threading.main_thread():
            on_loop.append(asyncio.get_running_loop() is loop)

    dst = _dst(sd)
    stats = await asyncload.aload(dst, path, options=SMALL_CHUNKS, progress=progress)
    after = set(threading.enumerate())
    assert_bitwise_equal(dst, sd)
    assert stats.bytes_assembled == 64 * 1024 * 4 + 33 * 2 + 7 * 9 * 2
    assert during, "progress was never called"
    # the large record's chunks were reported from the reads' loop: this test's own
    assert on_loop and all(on_loop)
    for threads in [*during, after]:
        assert not [t.name for t in threads if t.name.startswith("asyncload-aload")]
        assert not [t.name for t in threads - before if t.name.startswith("asyncload-loop")]
    assert (
        asyncload_threads("asyncload-io", ignore=THREADS_BEFORE) == []
    )  # closed before aload returned


@pytest.mark.asyncio
async def test_cancelling_aload_mid_load_leaves_no_io_thread(
    ckpt, http_server, fault_proxy, bucket_name
):
    path, sd = ckpt
    http_server.upload_dir(path, bucket_name, "ckpt")
    proxy = fault_proxy(http_server)
    rule = proxy.add_rule(stall(None), times=None, **DATA)  # every data read hangs
    url = http_server.url(bucket_name, "ckpt", endpoint_url=proxy.endpoint_url)
    before = live_threads("asyncload-io")
    dst = _dst(sd)
    task = asyncio.create_task(
        asyncload.aload(dst, url, options=LoadOptions(timeout=None, hedge=False))
    )
    deadline = time.monotonic() + 20
    while rule.matched == 0 and not task.done() and time.monotonic() < deadline:  # noqa: ASYNC110 - a proxy counter
        await asyncio.sleep(0.01)
    assert rule.matched >= 1 and not task.done()  # the load is under way and stuck
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    deadline = time.monotonic() + 5
    while asyncload_threads("asyncload-io", ignore=before) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    assert asyncload_threads("asyncload-io", ignore=before) == []
    assert await asyncio.to_thread(wait_closed, proxy.port) == []
    assert not dst["big"].view(torch.uint8).any()  # nothing of the stalled data arrived


# --- d. options resolved once ------------------------------------------------------------------


def test_min_chunk_size_follows_chunk_size():
    assert LoadOptions().min_chunk_size == 1 << 20
    assert LoadOptions(chunk_size=256 * KiB).min_chunk_size == 256 * KiB
    assert dataclasses.replace(LoadOptions(), chunk_size=100_000).min_chunk_size == 100_000
    assert LoadOptions().replace(chunk_size=100_000).min_chunk_size == 100_000
    # derived again when chunk_size grows back
    assert LoadOptions(chunk_size=4096).replace(chunk_size=64 << 20).min_chunk_size == 1 << 20
    # an explicit value is kept
    explicit = LoadOptions(chunk_size=1 << 20, min_chunk_size=64 * KiB)
    assert explicit.replace(chunk_size=128 * KiB).min_chunk_size == 64 * KiB
    assert explicit.chunk_policy.min_chunk_size == 64 * KiB
    with pytest.raises(ValueError, match=r"LoadOptions\.min_chunk_size=.*chunk_size=4096"):
        LoadOptions(chunk_size=4096, min_chunk_size=8192)
    with pytest.raises(ValueError, match=r"LoadOptions\.min_chunk_size"):
        explicit.replace(chunk_size=32 * KiB)
    assert PipelinedLoadPlanner(chunk_size=4096).options.min_chunk_size == 4096
    assert PipelinedLoadPlanner(chunk_size=4096).has_options is True
    assert PipelinedLoadPlanner().has_options is False
    base = LoadOptions(timeout=7.0)
    p = PipelinedLoadPlanner(chunk_size=8192, options=base)
    assert (p.options.chunk_size, p.options.min_chunk_size, p.options.timeout) == (8192, 8192, 7.0)


def test_load_options_argument_governs_everything(ckpt):
    path, sd = ckpt
    o = LoadOptions(chunk_size=32 * KiB, hedge=False)
    tiny = PipelinedLoadPlanner(chunk_size=4096)

    def chunks(**kwargs: Any) -> int:
        dst = _dst(sd)
        stats = asyncload.load(dst, path, **kwargs)
        assert_bitwise_equal(dst, sd)
        return stats.chunks

    with_o = chunks(options=o)
    with_tiny = chunks(options=tiny.options)
    assert with_o != with_tiny  # the observable: 4 KiB chunks make more requests
    assert chunks(options=o, planner=PipelinedLoadPlanner(chunk_size=4096)) == with_o
    # without options, an explicitly configured planner's govern
    assert chunks(planner=PipelinedLoadPlanner(chunk_size=4096)) == with_tiny
    # a planner without options of its own does not change anything
    assert chunks(options=o, planner=PipelinedLoadPlanner()) == with_o


def test_plain_dcp_load_reader_then_planner_options(ckpt):
    path, sd = ckpt
    a = LoadOptions(chunk_size=32 * KiB, hedge=False)
    b = LoadOptions(chunk_size=4096, hedge=False)
    reader = PipelinedReader(path, options=a)
    dst = _dst(sd)
    dcp.load(dst, storage_reader=reader, planner=PipelinedLoadPlanner(options=b), no_dist=True)
    assert_bitwise_equal(dst, sd)
    assert reader.session.options is b
    assert reader.stats is not None
    # the data was read in b's chunks: as many requests as asyncload.load with b makes
    assert reader.stats.chunks == asyncload.load(_dst(sd), path, options=b).chunks
    # a planner without options of its own: the reader's govern throughout
    reader = PipelinedReader(path, options=a)
    dst = _dst(sd)
    dcp.load(dst, storage_reader=reader, planner=PipelinedLoadPlanner(), no_dist=True)
    assert_bitwise_equal(dst, sd)
    assert reader.session.options is a
    assert reader.stats is not None
    assert reader.stats.chunks == asyncload.load(_dst(sd), path, options=a).chunks


def test_plain_dcp_load_timeout_metadata_by_reader_data_by_planner(
    ckpt, http_server, fault_proxy, bucket_name
):
    path, sd = ckpt
    http_server.upload_dir(path, bucket_name, "ckpt")
    proxy = fault_proxy(http_server)
    # the .metadata GET answers after 1 s: well past b's timeout, well within a's (and a's
    # timeout, were it to govern the stalled data reads, would show in the message)
    meta = proxy.add_rule(delay(1.0), times=None, path=".metadata", data_only=True)
    data = proxy.add_rule(stall(None), times=None, **DATA)  # data reads never answer
    url = http_server.url(bucket_name, "ckpt", endpoint_url=proxy.endpoint_url)
    a = LoadOptions(timeout=5.0, retries=0, hedge=False)
    b = LoadOptions(timeout=0.25, retries=0, hedge=False)
    reader = PipelinedReader(url, options=a)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((asyncload.ChunkTimeoutError, CheckpointException)) as ei:
        dcp.load(
            _dst(sd), storage_reader=reader, planner=PipelinedLoadPlanner(options=b), no_dist=True
        )
    err = ei.value
    if isinstance(err, CheckpointException):  # dcp.load wraps the reader's errors
        err = err.failures[0][0]
    assert isinstance(err, asyncload.ChunkTimeoutError), repr(err)
    assert meta.fired >= 1 and data.fired >= 1
    assert ".distcp" in err.path and err.attempts == 1
    assert "within 0.25 s" in str(err)
    assert reader.session.options is b
    assert wait_closed(proxy.port) == []


# --- e. LoadOptions pickles and replaces -------------------------------------------------------


@pytest.mark.parametrize(
    "options,derived",
    [
        (LoadOptions(), True),
        (LoadOptions(chunk_size=256 * KiB), True),
        (
            LoadOptions(
                chunk_size=1 << 20, min_chunk_size=64 * KiB, timeout=None, concurrency="auto"
            ),
            False,
        ),
    ],
    ids=["defaults", "derived", "explicit"],
)
def test_load_options_pickle_and_replace_keep_derived_fields(options, derived):
    _ = options.retry_policy, options.hedge_policy, options.chunk_policy  # cached before pickling
    back = pickle.loads(pickle.dumps(options))
    assert back == options and repr(back) == repr(options)
    assert back.min_chunk_size == options.min_chunk_size
    assert (back.retry_policy, back.hedge_policy, back.chunk_policy) == (
        options.retry_policy,
        options.hedge_policy,
        options.chunk_policy,
    )
    assert pickle.loads(pickle.dumps(back)) == options
    for o in (options, back):
        if derived:  # still derived after the round trip: follows chunk_size both ways
            assert o.replace(chunk_size=32 * KiB).min_chunk_size == 32 * KiB
            assert dataclasses.replace(o, chunk_size=64 << 20).min_chunk_size == 1 << 20
        else:  # still explicit
            assert o.replace(chunk_size=128 * KiB).min_chunk_size == 64 * KiB
            with pytest.raises(ValueError, match=r"LoadOptions\.min_chunk_size"):
                o.replace(chunk_size=32 * KiB)
        # the policies follow the replaced fields, not the ones cached before
        r = o.replace(retries=9, timeout=3.0, hedge=False, chunk_size=128 * KiB)
        assert (r.retry_policy.attempts, r.retry_policy.timeout, r.hedge_policy.enabled) == (
            10,
            3.0,
            False,
        )
        assert r.chunk_policy.chunk_size == 128 * KiB
