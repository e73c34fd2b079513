"""The load's configuration, resolved once (asyncload.engine.config): which options govern,
the memory plan, and the session that carries both (its collaborators through the
constructor, the one step where a plain dcp.load's planner takes over)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _ckpt import assert_bitwise_equal, make_checkpoint, random_tensor, zeros_like_tree

import asyncload
from asyncload import LoadOptions, PipelinedLoadPlanner, PipelinedReader, ShardedLoadPlanner
from asyncload.engine.config import (
    MemoryPlan,
    PlannerTerms,
    governing_options,
    resolve_config,
    ring_geometry,
)
from asyncload.engine.cuda_ring import PinnedRing
from asyncload.engine.session import LoadSession
from asyncload.faces.terms import planner_terms

pytestmark = pytest.mark.timeout(60)

KiB = 1 << 10
MiB = 1 << 20


def test_options_given_govern_else_the_planners_own_else_the_defaults() -> None:
    mine = LoadOptions(chunk_size=64 * KiB)
    knobs = PipelinedLoadPlanner(chunk_size=4096)
    assert governing_options(mine, planner_terms(knobs)) is mine
    assert governing_options(None, planner_terms(knobs)) is knobs.options
    assert governing_options(None, planner_terms(PipelinedLoadPlanner())) == LoadOptions()
    assert resolve_config(mine, planner_terms(knobs)).chunking.chunk_size == 64 * KiB
    assert resolve_config(None, planner_terms(knobs)).chunking.chunk_size == 4096
    assert resolve_config() == resolve_config(LoadOptions())
    with pytest.raises(TypeError, match="options must be a LoadOptions, not dict"):
        resolve_config({"chunk_size": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="terms must be a PlannerTerms"):
        resolve_config(None, knobs)  # type: ignore[arg-type]  # a planner: made into terms first


def test_a_planner_brings_only_what_the_face_says() -> None:
    """planner_terms: asyncload's planners say what they bring; any other planner, or none,
    brings nothing (the engine never inspects a planner for it)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    assert planner_terms(None) == PlannerTerms()
    assert planner_terms(DefaultLoadPlanner()) == PlannerTerms()
    own = PipelinedLoadPlanner(chunk_size=4096)
    terms = planner_terms(own)
    assert terms.options is own.options
    assert terms.share is None and terms.collective_timeout is None
    assert planner_terms(PipelinedLoadPlanner()).options is None  # not set explicitly
    terms.destinations_checked(d := {"w": torch.zeros(1)})  # type: ignore[misc]
    assert own._destinations_checked is d
    assert terms.report is not None and terms.report().missing_keys is own.missing_keys
    sharded = planner_terms(ShardedLoadPlanner())
    assert sharded.share is not None and sharded.collective_timeout is not None


def test_config_holds_the_narrow_policies() -> None:
    o = LoadOptions(timeout=7.0, retries=2, hedge=False, chunk_size=8 * MiB, io_threads=3)
    c = resolve_config(o)
    assert c.retry == o.retry_policy and c.hedge == o.hedge_policy and c.chunking == o.chunk_policy
    assert (c.retry.timeout, c.retry.retries, c.hedge.enabled, c.io_threads) == (7.0, 2, False, 3)
    assert c.collective_timeout == o.collective_timeout
    with pytest.raises(AttributeError):
        c.io_threads = 4  # type: ignore[misc]  # frozen


def test_a_planners_collective_timeout_is_resolved_into_the_config() -> None:
    class Planner(ShardedLoadPlanner):
        def collective_timeout_for(self, options: LoadOptions) -> float | None:
            return 12.5

    assert resolve_config(LoadOptions(), planner_terms(Planner())).collective_timeout == 12.5
    given = planner_terms(ShardedLoadPlanner(collective_timeout=3.0))
    assert resolve_config(LoadOptions(collective_timeout=9.0), given).collective_timeout == 3.0
    unset = planner_terms(ShardedLoadPlanner())
    assert resolve_config(LoadOptions(collective_timeout=9.0), unset).collective_timeout == 9.0
    # a planner arriving late (dcp.load) with no options of its own: its timeout still counts
    late = resolve_config(LoadOptions(collective_timeout=9.0))
    assert given.options is None
    assert late.with_planner(given).collective_timeout == 3.0
    assert late.with_planner(unset).collective_timeout == 9.0
    assert late.with_planner(given).planner is given


@pytest.mark.parametrize(
    ("budget", "chunk"), [(64 * KiB, 16 * MiB), (512 * MiB, 16 * MiB), (8 * MiB, 1 * MiB)]
)
def test_memory_plan_states_every_share_of_the_budget(budget: int, chunk: int) -> None:
    o = LoadOptions(memory_budget=budget, chunk_size=chunk)
    plan = resolve_config(o).memory
    slots, slot = ring_geometry(budget, min(chunk, budget))
    assert plan == MemoryPlan(budget, budget, slots * slot, slots, slot, budget, budget)
    assert (
        plan.pinned <= budget
        and plan.peak == plan.reads + plan.pinned + plan.streaming + plan.sends
    )
    # a load into device tensors reads chunks of at most one slot
    staged = resolve_config(o).staged
    assert staged.chunk_size <= slot and staged.min_chunk_size <= slot
    if o.effective_chunk_size <= slot:  # the chunks fit a slot: the load's own chunking
        assert staged == o.chunk_policy


def test_the_session_is_made_with_its_collaborators_and_says_so(tmp_path) -> None:
    seen: list[tuple[int, int]] = []
    ticks = iter(range(1000))
    options = LoadOptions(chunk_size=64 * KiB)
    config = resolve_config(options)
    session = LoadSession(
        tmp_path / "ckpt",
        config=config,
        options=options,
        progress=lambda done, total: seen.append((done, total)),
        clock=lambda: float(next(ticks)),
    )
    assert session.config is config and session.options is options
    assert session.group is None and session.monitor is None and session.progress is not None
    with pytest.raises(AttributeError):
        session.monitor = object()  # type: ignore[misc]  # given when made, never replaced
    text = repr(session)
    assert "not started" in text and "open=nothing" in text and "chunks=65536" in text
    session.begin()
    assert "started" in repr(session)
    assert session.live_stats().seconds == 1.0  # the session's clock


def test_a_plain_dcp_load_switches_config_once_when_the_planner_arrives(tmp_path) -> None:
    a = LoadOptions(chunk_size=32 * KiB)
    b = LoadOptions(chunk_size=4096)
    reader = PipelinedReader(tmp_path, options=a)
    session = reader.session
    assert session.options is a
    session.planner_arrived(planner_terms(PipelinedLoadPlanner()))  # no options of its own
    assert session.options is a
    terms = planner_terms(PipelinedLoadPlanner(options=b))
    session.planner_arrived(terms)
    assert session.options is b and session.config.chunking.chunk_size == 4096
    assert session.config.planner is terms
    session.begin()  # the reader's next load starts under the reader's config again
    assert session.options is a and session.config.planner == PlannerTerms()
    sharded = planner_terms(ShardedLoadPlanner())  # no options of its own: only its terms
    session.planner_arrived(sharded)
    assert session.options is a and session.config.planner is sharded


def test_the_engine_never_inspects_a_planner() -> None:
    """What a planner brings reaches the engine through PlannerTerms only (issue 46, item 4):
    no module of asyncload/engine looks a planner's attributes up by name."""
    import re
    from pathlib import Path

    import asyncload.engine

    engine = Path(asyncload.engine.__file__).parent
    probe = re.compile(r"\b(getattr|hasattr)\(\s*planner\b")
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(engine.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert found == []


def test_pinned_ring_counts_its_bytes_on_a_meter() -> None:
    from asyncload.engine.cuda_ring import DeviceCopier

    class HostCopier(DeviceCopier):
        def claims(self, t: torch.Tensor) -> bool:
            return False

        def host_empty(self, nbytes: int) -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8)

    async def main() -> None:
        ring = PinnedRing(HostCopier(), 2, 1024)
        a = await ring.acquire()
        b = await ring.acquire()
        assert a is not b and ring.statistics().used == 2048
        third = asyncio.ensure_future(ring.acquire())
        await asyncio.sleep(0)
        assert not third.done() and ring.statistics().waiting == 1 and ring.waits == 1
        ring.release(a)
        assert await third is a
        ring.release(b)
        ring.release(a)
        st = ring.statistics()
        assert (st.name, st.capacity, st.used, st.peak, st.waiting) == (
            "pinned staging",
            2048,
            0,
            2048,
            0,
        )

    asyncio.run(main())


def test_the_smallest_budget_loads_and_streams_whole(tmp_path) -> None:
    sd = {f"t{i}": random_tensor((64, 64), torch.float32, i) for i in range(8)}
    path = make_checkpoint(tmp_path / "ckpt", sd)
    opts = LoadOptions(memory_budget=64 * KiB, chunk_size=16 * KiB)
    got = dict(asyncload.iter_tensors(path, options=opts))
    assert_bitwise_equal(got, sd)
    dst = zeros_like_tree(sd)
    stats = asyncload.load(dst, path, options=opts)
    assert stats.peak_buffered_bytes <= 64 * KiB


def test_the_config_is_fixed_once_tensor_data_is_read(tmp_path) -> None:
    """Nothing changes a load's configuration mid-load (issue 46, item 4): a planner's
    options re-resolve it before the load reads tensor data, and raise once it has begun
    (asked from the planner's own hooks, inside ``dcp.load``); the next load is free again."""
    import torch.distributed.checkpoint as dcp

    sd = {f"t{i}": random_tensor((32, 32), torch.float32, i) for i in range(3)}
    path = make_checkpoint(tmp_path / "ckpt", sd)
    a, b = LoadOptions(chunk_size=32 * KiB), LoadOptions(chunk_size=4096)
    c = LoadOptions(chunk_size=8192, retries=1)
    reader = PipelinedReader(path, options=a)
    session = reader.session
    seen: list[str] = []

    class Asking(PipelinedLoadPlanner):
        """Asks for other options from its hooks: at planning, before any read (allowed),
        and at each destination (asked while the reads are being set up: refused)."""

        def create_local_plan(self):  # type: ignore[no-untyped-def]
            session.planner_arrived(planner_terms(PipelinedLoadPlanner(options=c)))
            seen.append(f"planning: chunks of {session.config.chunking.chunk_size}")
            return super().create_local_plan()

        def resolve_tensor(self, read_item):  # type: ignore[no-untyped-def]
            try:
                session.planner_arrived(planner_terms(PipelinedLoadPlanner(options=c)))
            except RuntimeError as exc:
                seen.append(str(exc))
            return super().resolve_tensor(read_item)

    dst = zeros_like_tree(sd)
    dcp.load(dst, storage_reader=reader, planner=Asking(options=b))
    assert_bitwise_equal(dst, sd)
    # before the reads: c governed planning; read_data's planner (b) took over before reading
    assert seen[0] == "planning: chunks of 8192"
    assert session.options is b and session.config.chunking.chunk_size == 4096
    assert len(seen) == 1 + 3  # one refusal per tensor
    assert set(seen[1:]) == {
        f"LoadSession.planner_arrived: a planner's options would change chunk_size, "
        f"min_chunk_size, retries of the load of {path} after it began reading tensor data; "
        "a load's configuration is fixed from then on (give the options when the load "
        "starts, or start another load)"
    }
    # after the reads, still refused; terms that change no option still set config.planner
    with pytest.raises(RuntimeError, match="would change chunk_size, min_chunk_size, retries"):
        session.planner_arrived(planner_terms(PipelinedLoadPlanner(options=c)))
    assert session.options is b
    for same in (None, b, LoadOptions(chunk_size=4096)):  # none, the config's, equal ones
        terms = planner_terms(PipelinedLoadPlanner(options=same) if same else None)
        session.planner_arrived(terms)
        assert session.options is b and session.config.planner is terms
    session.begin()  # the next load: free again until it reads
    session.planner_arrived(planner_terms(PipelinedLoadPlanner(options=c)))
    assert session.options is c and session.config.retry.retries == 1


def test_a_plain_dcp_load_with_a_planners_options_still_works(tmp_path) -> None:
    """The guard leaves the one legitimate switch alone: ``dcp.load`` hands the reader a
    planner made with options after ``.metadata`` was read; those options govern the reads,
    and a reader reused for a second load switches again."""
    import torch.distributed.checkpoint as dcp

    sd = {f"t{i}": random_tensor((64, 64), torch.float32, i) for i in range(4)}
    path = make_checkpoint(tmp_path / "ckpt", sd)
    reader = PipelinedReader(path, options=LoadOptions(chunk_size=32 * KiB))
    for chunk in (4096, 8192):
        dst = zeros_like_tree(sd)
        dcp.load(
            dst,
            storage_reader=reader,
            planner=PipelinedLoadPlanner(options=LoadOptions(chunk_size=chunk)),
        )
        assert_bitwise_equal(dst, sd)
        assert reader.session.config.chunking.chunk_size == chunk
        assert reader.session.stats is not None
        assert reader.session.stats.bytes_assembled == 4 * 64 * 64 * 4


def _types_in(hint: object) -> set[object]:
    """``hint`` and every type inside it (``X | None``, ``tuple[X, ...]``)."""
    import typing

    found = {hint}
    for arg in typing.get_args(hint):
        found |= _types_in(arg)
    return found


def test_the_config_holds_resolved_fields_and_no_load_options() -> None:
    """One configuration channel (issue 46, item 4): LoadConfig holds what the options
    resolve to, field by field; no LoadOptions travels inside it (nor inside its groups)."""
    import dataclasses
    import typing

    from asyncload.engine import config as config_module

    def fields_of(cls: type) -> dict[str, object]:
        hints = typing.get_type_hints(cls, vars(config_module))
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    top = fields_of(config_module.LoadConfig)
    assert "options" not in top
    for name, hint in top.items():
        assert LoadOptions not in _types_in(hint), name
        if name != "planner" and dataclasses.is_dataclass(hint):  # a group of fields
            for inner, inner_hint in fields_of(hint).items():  # type: ignore[arg-type]
                assert LoadOptions not in _types_in(inner_hint), f"{name}.{inner}"

    def probe(obj: object) -> None:  # and no LoadOptions value, at any depth
        assert not isinstance(obj, LoadOptions)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, PlannerTerms):
            for f in dataclasses.fields(obj):
                probe(getattr(obj, f.name))

    o = LoadOptions(
        chunk_size=256 * KiB,
        min_chunk_size=64 * KiB,
        memory_budget=256 * KiB,
        concurrency="auto",
        timeout=9.0,
        retries=2,
        verify=True,
        allow_dtype_cast=True,
        strict_unexpected_keys=True,
        max_metadata_size=5 * MiB,
        max_over_read_ratio=2.0,
        safe_globals=("collections.OrderedDict",),
        transport="fsspec",
        local_mapped_copies=False,
        use_uvloop=False,
        late_rank_log_after=7.0,
        share_metadata=True,
        collective_timeout=11.0,
    )
    c = resolve_config(o)
    probe(c)
    assert (c.chunking.chunk_size, c.chunking.min_chunk_size) == (256 * KiB, 64 * KiB)
    # a 256 KiB budget: two slots of 128 KiB, a device load's chunks cut to one slot
    assert (c.memory.pinned_slots, c.memory.slot_size) == (2, 128 * KiB)
    assert (c.staged.chunk_size, c.staged.min_chunk_size) == (128 * KiB, 64 * KiB)
    assert (c.concurrency.auto, c.concurrency.initial, c.concurrency.max_in_flight) == (
        True,
        8,
        64,
    )
    assert (c.retry.timeout, c.retry.retries) == (9.0, 2)
    assert c.checks == config_module.CheckPolicy(
        verify=True,
        allow_dtype_cast=True,
        strict_unexpected_keys=True,
        max_metadata_size=5 * MiB,
        max_over_read_ratio=2.0,
        safe_globals=("collections.OrderedDict",),
    )
    assert c.storage == config_module.StoragePolicy(
        transport="fsspec", mapped_copies=False, max_listing_size=5 * MiB
    )
    assert c.ranks == config_module.RankPolicy(
        collective_timeout=11.0, late_rank_log_after=7.0, share_metadata=True
    )
    assert (c.use_uvloop, c.collective_timeout, c.memory.budget) == (False, 11.0, 256 * KiB)
    fixed = resolve_config(LoadOptions(concurrency=5, io_threads=3))
    assert fixed.concurrency == config_module.Concurrency(auto=False, initial=5, max_in_flight=5)
    assert fixed.io_threads == 3
    # settings name every option, in LoadOptions' order: what planner_arrived compares
    names = [f.name for f in dataclasses.fields(LoadOptions)]
    assert list(config_module.settings(c)) == names
    assert config_module.settings(c)["memory_budget"] == 256 * KiB
    assert config_module.settings(resolve_config(LoadOptions(chunk_size=4096))) == (
        config_module.settings(resolve_config(LoadOptions(chunk_size=4096)))
    )


def test_a_pipeline_keeps_no_planner_alive() -> None:
    """The pipeline's config brings no planner's terms (the store's throttle callback makes a
    reference cycle of the pipeline: a planner kept there would keep a stream's tensors
    alive until a garbage collection; tests/faces/test_iter_tensors.py measures it)."""
    import concurrent.futures

    from asyncload.common.stats import StatsRecorder
    from asyncload.engine import Pipeline
    from asyncload.storage import LocalStorage

    terms = planner_terms(PipelinedLoadPlanner(chunk_size=4096))
    config = resolve_config(None, terms)
    assert config.planner is terms
    bare = config.without_planner()
    assert bare.planner == PlannerTerms() and bare.chunking == config.chunking
    assert bare.without_planner() is bare
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        pipe = Pipeline(LocalStorage(".", ex), config, StatsRecorder(), ex)
        assert pipe.config.planner == PlannerTerms()
        assert pipe.config.chunking == pipe.chunking == config.chunking
