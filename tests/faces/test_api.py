"""Every public entry point and every way to name a checkpoint gives the same tensors;
LoadStats is sane; the planner's knobs govern the load; the event-loop situations work;
cancellation leaves no task, thread or open file behind."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import (
    THREADS_BEFORE,
    assert_bitwise_equal,
    asyncload_threads,
    copy_dir_to_fsspec,
    make_checkpoint,
    open_fds_under,
    random_tensor,
    thread_baseline,  # noqa: F401 - autouse fixture
    total_tensor_bytes,
    zeros_like_tree,
)
from fsspec.implementations.memory import MemoryFileSystem

import asyncload

pytestmark = pytest.mark.timeout(60)


class SlowMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem (same store) with a scripted delay on every ranged read."""

    protocol = "asyncload-test-slowmem"

    def __init__(self, *args, delay: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay = delay

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith(cls.protocol + "://"):
            path = path[len(cls.protocol) + 3 :]
        return super()._strip_protocol(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        if self.delay:
            time.sleep(self.delay)
        return super().cat_file(path, start=start, end=end, **kwargs)


fsspec.register_implementation(SlowMemoryFileSystem.protocol, SlowMemoryFileSystem, clobber=True)


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict:
    """What this module's ``ckpt`` holds (the fixture of tests/conftest.py)."""
    return {
        "emb": random_tensor((512, 64), torch.bfloat16, seed=1),
        "layers": {
            str(i): {
                "w": random_tensor((64, 192), torch.float32, seed=10 + i),
                "norm": random_tensor((64,), torch.float32, seed=20 + i),
            }
            for i in range(3)
        },
        "head_t": random_tensor((96, 64), torch.float16, seed=30).t(),
        "step": torch.tensor(1234),
        "meta": {"epoch": 3, "name": "run"},
    }


@pytest.fixture
def memory_ckpt(ckpt):
    path, sd = ckpt
    root = f"/asyncload-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    copy_dir_to_fsspec(path, fs, root)
    yield root, sd
    fs.rm(root, recursive=True)


def fresh(sd):
    return zeros_like_tree(sd, object_placeholder=None)


def check_stats(
    stats: asyncload.LoadStats, sd, options: asyncload.LoadOptions | None = None
) -> None:
    options = options or asyncload.LoadOptions()
    assert isinstance(stats, asyncload.LoadStats)
    assert stats.bytes_assembled == total_tensor_bytes(sd)
    assert stats.bytes_read >= stats.bytes_assembled
    assert stats.chunks > 0
    assert 0 < stats.peak_buffered_bytes <= options.memory_budget
    assert stats.seconds > 0
    assert stats.files >= 1
    assert stats.retries == 0 and stats.timeouts == 0
    assert stats.unexpected_keys == []
    for name in (
        "bytes_read",
        "bytes_assembled",
        "chunks",
        "retries",
        "timeouts",
        "seconds",
        "peak_buffered_bytes",
    ):
        assert hasattr(stats, name)
    assert "Loaded" in str(stats)


# --- entry points ----------------------------------------------------------------------------


def test_load(ckpt):
    path, sd = ckpt
    dst = fresh(sd)
    stats = asyncload.load(dst, path)
    assert_bitwise_equal(sd, dst)
    check_stats(stats, sd)


@pytest.mark.asyncio
async def test_aload(ckpt):
    path, sd = ckpt
    dst = fresh(sd)
    stats = await asyncload.aload(dst, path)
    assert_bitwise_equal(sd, dst)
    check_stats(stats, sd)


def test_start_load(ckpt):
    path, sd = ckpt
    dst = fresh(sd)
    seen: list[tuple[int, int]] = []
    handle = asyncload.start_load(dst, path, progress=lambda d, t: seen.append((d, t)))
    assert isinstance(handle, asyncload.LoadHandle)
    stats = handle.result(timeout=30)
    assert handle.done()
    assert handle.cancel() is False
    assert handle.wait(5)
    assert_bitwise_equal(sd, dst)
    check_stats(stats, sd)
    total = total_tensor_bytes(sd)
    assert seen and seen[-1] == (total, total)
    assert handle.progress == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_dcp_load_with_reader_and_planner(ckpt):
    path, sd = ckpt
    dst = fresh(sd)
    reader = asyncload.PipelinedReader(path)
    planner = asyncload.PipelinedLoadPlanner(
        chunk_size=8 << 10, min_chunk_size=1 << 10, timeout=20
    )
    assert planner.options.chunk_size == 8 << 10 and planner.options.min_chunk_size == 1 << 10
    assert planner.options.timeout == 20
    dcp.load(dst, storage_reader=reader, planner=planner, no_dist=True)
    assert_bitwise_equal(sd, dst)
    check_stats(reader.stats, sd)
    reader.close()


def test_every_entry_point_gives_identical_tensors(ckpt):
    path, sd = ckpt
    results = []
    d = fresh(sd)
    asyncload.load(d, path)
    results.append(d)
    d = fresh(sd)
    asyncio.run(asyncload.aload(d, path))
    results.append(d)
    d = fresh(sd)
    asyncload.start_load(d, path).result(30)
    results.append(d)
    d = fresh(sd)
    dcp.load(
        d,
        storage_reader=asyncload.PipelinedReader(path),
        planner=asyncload.PipelinedLoadPlanner(chunk_size=4096, min_chunk_size=512, timeout=None),
        no_dist=True,
    )
    results.append(d)
    d = fresh(sd)
    dcp.load(d, checkpoint_id=path, no_dist=True)  # torch's own reader, for reference
    results.append(d)
    for r in results:
        assert_bitwise_equal(sd, r)


# --- the planner's knobs govern the load --------------------------------------------------------


def test_planner_chunk_size_governs_dcp_load(ckpt):
    path, sd = ckpt
    counts = {}
    for cs in (16 << 20, 4096):
        reader = asyncload.PipelinedReader(path)
        planner = asyncload.PipelinedLoadPlanner(chunk_size=cs, min_chunk_size=min(cs, 1024))
        dst = fresh(sd)
        dcp.load(dst, storage_reader=reader, planner=planner, no_dist=True)
        assert_bitwise_equal(sd, dst)
        counts[cs] = reader.stats.chunks
        if cs == 4096:
            # every tensor byte went through reads of at most 4 KiB
            assert reader.stats.chunks >= math.ceil(total_tensor_bytes(sd) / 4096)
        reader.close()
    assert counts[4096] > 4 * counts[16 << 20]


def test_planner_knobs_govern_asyncload_load(ckpt):
    path, sd = ckpt
    dst = fresh(sd)
    stats = asyncload.load(
        dst, path, planner=asyncload.PipelinedLoadPlanner(chunk_size=4096, min_chunk_size=256)
    )
    assert_bitwise_equal(sd, dst)
    assert stats.chunks >= math.ceil(total_tensor_bytes(sd) / 4096)


def test_planner_min_chunk_size_coalesces_small_records(ckpt):
    path, sd = ckpt
    n_records = 1 + 3 * 2 + 1 + 1 + 2  # emb, layers.*.{w,norm}, head_t, step, meta.{epoch,name}
    few = fresh(sd)
    s_few = asyncload.load(
        few, path, options=asyncload.LoadOptions(chunk_size=16 << 20, min_chunk_size=4 << 20)
    )
    many = fresh(sd)
    s_many = asyncload.load(
        many, path, options=asyncload.LoadOptions(chunk_size=4096, min_chunk_size=1)
    )
    assert_bitwise_equal(few, many)
    assert s_few.chunks < n_records <= s_many.chunks


def test_planner_timeout_governs_the_load(memory_ckpt):
    root, sd = memory_ckpt
    url = f"{SlowMemoryFileSystem.protocol}://{root}"
    dst = fresh(sd)
    planner = asyncload.PipelinedLoadPlanner(
        timeout=0.05, options=asyncload.LoadOptions(retries=0)
    )
    t0 = time.monotonic()
    with pytest.raises(asyncload.ChunkTimeoutError) as ei:
        asyncload.load(dst, url, planner=planner, storage_options={"delay": 0.4})
    assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert "within 0.05 s" in msg and "LoadOptions.timeout" in msg and root in msg
    assert isinstance(ei.value, TimeoutError)
    assert ei.value.attempts == 1
    # the same load with a generous timeout goes through
    planner = asyncload.PipelinedLoadPlanner(timeout=5, options=asyncload.LoadOptions(retries=0))
    asyncload.load(dst, url, planner=planner, storage_options={"delay": 0.001})
    assert_bitwise_equal(sd, dst)


# --- ways to name a checkpoint ---------------------------------------------------------------


@pytest.mark.parametrize("form", ["str", "path", "file_url"])
def test_local_checkpoint_forms(ckpt, form):
    path, sd = ckpt
    where = {"str": str(path), "path": path, "file_url": path.as_uri()}[form]
    dst = fresh(sd)
    stats = asyncload.load(dst, where)
    assert_bitwise_equal(sd, dst)
    check_stats(stats, sd)


def test_file_url_with_escaped_characters(tmp_path):
    sd = {"x": random_tensor((33,), torch.float32, seed=3)}
    path = make_checkpoint(tmp_path / "dir with space%", sd)
    dst = fresh(sd)
    asyncload.load(dst, path.as_uri())
    assert_bitwise_equal(sd, dst)


@pytest.mark.parametrize(
    "options",
    [
        asyncload.LoadOptions(),
        asyncload.LoadOptions(
            chunk_size=4096, min_chunk_size=512, memory_budget=64 << 10, concurrency=8
        ),
    ],
    ids=["default", "tiny"],
)
def test_fsspec_memory_checkpoint(memory_ckpt, options):
    root, sd = memory_ckpt
    dst = fresh(sd)
    stats = asyncload.load(dst, f"memory://{root}", options=options)
    assert_bitwise_equal(sd, dst)
    check_stats(stats, sd, options)


@pytest.mark.asyncio
async def test_fsspec_memory_checkpoint_aload_and_dcp(memory_ckpt):
    root, sd = memory_ckpt
    dst = fresh(sd)
    await asyncload.aload(dst, f"memory://{root}")
    assert_bitwise_equal(sd, dst)
    dst = fresh(sd)
    reader = asyncload.PipelinedReader(f"memory://{root}")
    await asyncio.to_thread(
        dcp.load,
        dst,
        storage_reader=reader,
        planner=asyncload.PipelinedLoadPlanner(chunk_size=4096),
        no_dist=True,
    )
    assert_bitwise_equal(sd, dst)
    reader.close()


# --- event loops -------------------------------------------------------------------------------


def test_aload_under_uvloop(ckpt):
    uvloop = pytest.importorskip("uvloop")  # a test dependency: installed wherever the tests run
    path, sd = ckpt
    dst = fresh(sd)

    dst_sync = fresh(sd)

    async def main():
        loop = asyncio.get_running_loop()
        assert type(loop).__module__.startswith("uvloop")
        stats = await asyncload.aload(
            dst, path, options=asyncload.LoadOptions(chunk_size=4096, min_chunk_size=512)
        )
        asyncload.load(dst_sync, path)  # the sync API from inside a running uvloop loop
        return stats

    stats = uvloop.run(main())
    assert_bitwise_equal(sd, dst)
    assert_bitwise_equal(sd, dst_sync)
    assert stats.chunks >= math.ceil(total_tensor_bytes(sd) / 4096)


def test_sync_load_without_uvloop(ckpt):
    path, sd = ckpt
    dst = fresh(sd)
    asyncload.load(dst, path, options=asyncload.LoadOptions(use_uvloop=False))
    assert_bitwise_equal(sd, dst)
    assert any(t.name == "asyncload-loop" for t in threading.enumerate())


@pytest.mark.asyncio
async def test_sync_load_called_from_a_running_loop(ckpt):
    path, sd = ckpt
    asyncio.get_running_loop()  # we are inside a running loop
    dst = fresh(sd)
    stats = asyncload.load(dst, path)  # the sync API, on purpose
    assert_bitwise_equal(sd, dst)
    check_stats(stats, sd)
    # and start_load().result() likewise
    dst = fresh(sd)
    asyncload.start_load(dst, path).result(30)
    assert_bitwise_equal(sd, dst)


@pytest.mark.asyncio
async def test_concurrent_aloads_on_one_loop(ckpt):
    path, sd = ckpt
    dsts = [fresh(sd) for _ in range(4)]
    opts = asyncload.LoadOptions(chunk_size=4096, min_chunk_size=512, concurrency=2)
    await asyncio.gather(*(asyncload.aload(d, path, options=opts) for d in dsts))
    for d in dsts:
        assert_bitwise_equal(sd, d)


# --- cancellation ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    sd = {"big": random_tensor((8 << 20,), torch.uint8, seed=7), "small": torch.arange(100)}
    path = make_checkpoint(tmp_path_factory.mktemp("cancel") / "ckpt", sd)
    return path, sd


CANCEL_OPTS = asyncload.LoadOptions(
    chunk_size=4096, min_chunk_size=1024, memory_budget=64 << 10, concurrency=1
)


def _assert_nothing_left(path) -> None:
    assert asyncload_threads("asyncload-io", ignore=THREADS_BEFORE) == []
    assert asyncload_threads("asyncload-aload", ignore=THREADS_BEFORE) == []
    assert asyncload_threads("asyncload-start-load", ignore=THREADS_BEFORE) == []
    assert open_fds_under(path) == []


def _partly_loaded(t: torch.Tensor, want: torch.Tensor) -> bool:
    same = (t == want).sum().item()
    return 0 < same < t.numel()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_aload_cancelled_mid_load_leaves_nothing_behind(big_ckpt):
    path, sd = big_ckpt
    dst = zeros_like_tree(sd)
    task: asyncio.Task | None = None
    total = total_tensor_bytes(sd)

    def progress(done: int, _total: int) -> None:  # runs on this loop's thread
        if done >= 64 << 10 and task is not None and not task.cancelling():
            task.cancel()

    task = asyncio.create_task(asyncload.aload(dst, path, options=CANCEL_OPTS, progress=progress))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert asyncio.all_tasks() == {asyncio.current_task()}
    _assert_nothing_left(path)
    assert _partly_loaded(dst["big"], sd["big"]), "the cancel came too late to test anything"
    # the same destination can be loaded again afterwards
    stats = await asyncload.aload(dst, path)
    assert_bitwise_equal(sd, dst)
    assert stats.bytes_assembled == total


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_aload_cancelled_during_slow_remote_reads(ckpt):
    path, sd = ckpt
    root = f"/asyncload-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    copy_dir_to_fsspec(path, fs, root)
    try:
        dst = fresh(sd)
        task = asyncio.create_task(
            asyncload.aload(
                dst,
                f"{SlowMemoryFileSystem.protocol}://{root}",
                storage_options={"delay": 0.05},
                options=asyncload.LoadOptions(chunk_size=4096, min_chunk_size=1024, concurrency=1),
            )
        )
        await asyncio.sleep(0.3)  # metadata and a few reads at 50 ms each
        assert not task.done()
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 5
        assert asyncio.all_tasks() == {asyncio.current_task()}
        _assert_nothing_left(path)
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.timeout(60)
def test_start_load_cancel(big_ckpt):
    path, sd = big_ckpt
    dst = zeros_like_tree(sd)
    started = threading.Event()
    cancelled = threading.Event()

    def progress(
        done: int, _total: int
    ) -> None:  # a library thread: hold the load until cancel() ran
        if done >= 64 << 10 and not started.is_set():
            started.set()
            cancelled.wait(10)

    handle = asyncload.start_load(dst, path, options=CANCEL_OPTS, progress=progress)
    assert started.wait(30)
    assert handle.cancel() is True
    cancelled.set()
    with pytest.raises(asyncload.LoadCancelledError) as ei:
        handle.result(timeout=30)
    assert isinstance(ei.value, asyncload.AsyncLoadError)
    assert handle.done()
    assert handle.wait(10)
    assert isinstance(handle.exception(), asyncload.LoadCancelledError)
    _assert_nothing_left(path)
    assert _partly_loaded(dst["big"], sd["big"]), "the cancel came too late to test anything"


@pytest.mark.timeout(60)
def test_start_load_result_timeout_then_completes(ckpt):
    path, sd = ckpt
    root = f"/asyncload-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    copy_dir_to_fsspec(path, fs, root)
    try:
        dst = fresh(sd)
        handle = asyncload.start_load(
            dst, f"{SlowMemoryFileSystem.protocol}://{root}", storage_options={"delay": 0.02}
        )
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.01)
        assert not handle.done()
        handle.result(timeout=30)
        assert_bitwise_equal(sd, dst)
    finally:
        fs.rm(root, recursive=True)


def test_no_threads_or_files_left_after_success_and_failure(ckpt, tmp_path):
    path, sd = ckpt
    dst = fresh(sd)
    asyncload.load(dst, path, options=CANCEL_OPTS)
    _assert_nothing_left(path)
    bad = fresh(sd)
    bad["extra"] = torch.zeros(3)
    with pytest.raises(asyncload.StateDictMismatchError):
        asyncload.load(bad, path)
    _assert_nothing_left(path)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spins", [0, 1, 2, 3, 5, 8, 13, 30, 100])
async def test_aload_cancelled_at_any_point(big_ckpt, spins):
    """Cancel after a given number of loop iterations: metadata, planning or reading."""
    path, sd = big_ckpt
    dst = zeros_like_tree(sd)
    task = asyncio.create_task(asyncload.aload(dst, path, options=CANCEL_OPTS))
    for _ in range(spins):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asyncio.all_tasks() == {asyncio.current_task()}
    _assert_nothing_left(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay", [0.0, 0.001, 0.02])
def test_start_load_cancelled_early(big_ckpt, delay):
    path, sd = big_ckpt
    dst = zeros_like_tree(sd)
    handle = asyncload.start_load(dst, path, options=CANCEL_OPTS)
    time.sleep(delay)
    assert handle.cancel() is True
    with pytest.raises(asyncload.LoadCancelledError):
        handle.result(timeout=30)
    assert handle.wait(10)
    _assert_nothing_left(path)


def test_dcp_load_with_reader_and_torchs_default_planner(ckpt):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    path, sd = ckpt
    dst = fresh(sd)
    reader = asyncload.PipelinedReader(path)
    dcp.load(dst, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    assert_bitwise_equal(sd, dst)
    dst = fresh(sd)
    dcp.load(
        dst, storage_reader=asyncload.PipelinedReader(path), no_dist=True
    )  # no planner at all
    assert_bitwise_equal(sd, dst)
    _assert_nothing_left(path)


def test_one_reader_for_two_dcp_loads_and_nothing_left_open(ckpt):
    path, sd = ckpt
    reader = asyncload.PipelinedReader(
        path, options=asyncload.LoadOptions(chunk_size=4096, min_chunk_size=512)
    )
    for _ in range(2):
        dst = fresh(sd)
        dcp.load(dst, storage_reader=reader, no_dist=True)
        assert_bitwise_equal(sd, dst)
        check_stats(reader.stats, sd)
        # dcp.load has no close hook: the reader closes its files and threads when read_data ends
        _assert_nothing_left(path)


def test_dcp_load_failure_in_planning_leaves_nothing_open(ckpt):
    from torch.distributed.checkpoint.api import CheckpointException

    path, sd = ckpt
    dst = fresh(sd)
    dst["emb"] = torch.zeros(3)
    with pytest.raises(CheckpointException):
        dcp.load(
            dst,
            storage_reader=asyncload.PipelinedReader(path),
            planner=asyncload.PipelinedLoadPlanner(),
            no_dist=True,
        )
    _assert_nothing_left(path)


@pytest.mark.timeout(60)
def test_aload_cancelled_under_uvloop(big_ckpt):
    uvloop = pytest.importorskip("uvloop")
    path, sd = big_ckpt
    dst = zeros_like_tree(sd)

    async def main():
        task = None

        def progress(done: int, _total: int) -> None:
            if done >= 64 << 10 and task is not None and not task.cancelling():
                task.cancel()

        task = asyncio.create_task(
            asyncload.aload(dst, path, options=CANCEL_OPTS, progress=progress)
        )
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.all_tasks() == {asyncio.current_task()}

    uvloop.run(main())
    _assert_nothing_left(path)
    assert _partly_loaded(dst["big"], sd["big"])


# --- the commonest slips: TypeError/ValueError naming the fix, before anything is opened -------


def _call(face, *args, **kwargs):
    """Call ``face`` (load, aload or start_load) and return what it returns or raises."""
    if face is asyncload.aload:
        return asyncio.run(face(*args, **kwargs))
    return face(*args, **kwargs)


FACES = [asyncload.load, asyncload.aload, asyncload.start_load]
FACE_IDS = ["load", "aload", "start_load"]


@pytest.mark.parametrize("face", FACES, ids=FACE_IDS)
def test_a_module_as_the_state_dict_says_pass_its_state_dict(ckpt, face):
    path, _ = ckpt
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError) as info:
        _call(face, model, path)
    assert str(info.value) == (
        f"asyncload.{face.__name__} got a Linear (a torch.nn.Module) as its state dict: pass "
        "`model.state_dict()`, which holds the module's tensors and loads into them in place"
    )
    assert asyncload_threads("asyncload-start-load", ignore=THREADS_BEFORE) == []


@pytest.mark.parametrize("face", FACES, ids=FACE_IDS)
def test_swapped_arguments_say_so(ckpt, face):
    path, sd = ckpt
    with pytest.raises(TypeError) as info:
        _call(face, str(path), fresh(sd))
    assert str(info.value) == (
        f"asyncload.{face.__name__} got the checkpoint {str(path)!r} as its first argument and a "
        "dict as its second: the two arguments are swapped; call "
        f"asyncload.{face.__name__}(state_dict, checkpoint, options=..., storage_options=...)"
    )
    with pytest.raises(TypeError, match="the two arguments are swapped"):
        _call(face, path, torch.nn.Linear(2, 2))  # a PathLike and a module: swapped too


@pytest.mark.parametrize("face", FACES, ids=FACE_IDS)
def test_load_options_as_storage_options_says_pass_it_as_options(ckpt, face):
    path, sd = ckpt
    with pytest.raises(TypeError) as info:
        _call(face, fresh(sd), path, storage_options=asyncload.LoadOptions(concurrency=2))
    assert str(info.value) == (
        f"asyncload.{face.__name__} got a LoadOptions as storage_options: pass it as `options=` "
        "(storage_options is a dict for the storage client: endpoint_url, region, ...)"
    )


def test_a_dict_as_options_says_storage_options(ckpt):
    path, sd = ckpt
    with pytest.raises(TypeError) as info:
        asyncload.load(fresh(sd), path, options={"endpoint_url": "http://127.0.0.1:1"})
    assert "a dict for the storage client goes to `storage_options=`" in str(info.value)


@pytest.mark.parametrize("face", FACES, ids=FACE_IDS)
def test_an_unknown_scheme_lists_the_schemes_asyncload_reads(face):
    from fsspec.registry import known_implementations

    sd = {"w": torch.zeros(2)}
    with pytest.raises(ValueError) as info:
        _call(face, sd, "s4://bucket/ck")
    text = str(info.value)
    assert text.startswith(
        "checkpoint 's4://bucket/ck' has the scheme 's4', which asyncload does not read: did "
        "you mean 's3://'"
    )
    assert (
        "asyncload reads local paths and the schemes file, s3, gs, gcs, http, https (its own "
        "clients), and through fsspec abfs, " in text
    )
    for protocol in known_implementations:  # fsspec's, plugins' included
        assert f" {protocol}" in text
    assert sd["w"].count_nonzero() == 0


@pytest.mark.parametrize("face", FACES, ids=FACE_IDS)
@pytest.mark.parametrize(
    ("url", "fixed"),
    [
        ("s3:/bucket/ck", "s3://bucket/ck"),
        ("gs:bucket/ck", "gs://bucket/ck"),
        ("https:/host/ck", "https://host/ck"),
        ("file:/tmp/ck", "file:///tmp/ck"),
    ],
)
def test_a_lost_slash_says_did_you_mean(face, url, fixed):
    with pytest.raises(ValueError) as info:
        _call(face, {"w": torch.zeros(2)}, url)
    assert str(info.value) == (
        f"checkpoint {url!r} is neither a local path that exists nor a URL: did you mean "
        f"{fixed!r}? (a URL's scheme is followed by '://')"
    )


def test_a_local_directory_named_like_a_scheme_still_loads(ckpt, tmp_path, monkeypatch):
    """``s3:/x`` is a relative path where a directory ``s3:`` exists: it loads as one."""
    path, sd = ckpt
    import shutil

    (tmp_path / "s3:").mkdir()
    shutil.copytree(path, tmp_path / "s3:" / "ck")
    monkeypatch.chdir(tmp_path)
    dst = fresh(sd)
    asyncload.load(dst, "s3:/ck")
    assert_bitwise_equal(sd, dst)
