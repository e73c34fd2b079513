"""Planning at scale, on one process: what one rank of a job on thousands of ranks spends
on planning a load, as pure functions over simulated layouts (no tensor bytes).

The model: a transformer of ``--layers`` layers (default 111: 1,002 tensors, about 97 B
parameters in bfloat16; width 8192, MLP 28672, 8 KV heads of 128, vocabulary 128256),
saved by ``dcp.save`` on 1,024 ranks, FSDP (``Shard(0)`` on 1,024 ranks) or FSDP x TP
(a 128 x 8 mesh: column-parallel q/k/v/gate/up/embedding/lm_head split along rows first
by TP then by FSDP, row-parallel o/down a grid, norms replicated over TP and saved once).
The checkpoint's ``Metadata`` is built as ``dcp.save`` writes it (one
``ChunkStorageMetadata`` per rank and tensor, empty shards included); its records are laid
out per rank file in state-dict order, each ``nbytes + 1577`` bytes (torch.save's zip
overhead for one tensor, measured), the tensor data 1 KiB in.

Per rank and case (loaded on 1,024 ... 8,192 ranks, FSDP or FSDP x TP):

* local planning: the read items of the rank's destination shards, by torch's
  ``create_default_local_load_plan`` (what ``DefaultLoadPlanner.create_local_plan`` runs)
  and by asyncload's ``state_dict_read_items`` (what ``PipelinedLoadPlanner`` runs), on
  the same state dict of destinations that speak DTensor's checkpoint protocol
  (``__create_chunk_list__``: the rank's box) over a meta tensor of the global shape;
  seconds (best of 3, ranks 0 and world/2) and heap peak (tracemalloc); both plans are
  checked equal, item for item;
* sharing (``ShardedLoadPlanner``): the needs each rank all-gathers, per read phase, as
  the session makes them (records up to ``min_chunk_size`` + probes read whole in phase 0,
  head and tail probes of larger ones, their data boxes in phase 1; pieces coalesced by
  ``make_chunks``' rule, checked against it on rank 0), for every rank; the pickled payload
  one rank contributes (``all_gather_object`` pickles it), the seconds to unpickle all of
  them (what every rank does after the all-gather), and what the share session then plans
  on a rank with adaptive sharing (the default): ``asyncload.distributed.share_plan._rank_plan`` over the
  packed needs as gathered (its part of the global plan: the ranks it shares files with, and
  the balanced work units it reads, sends or receives), seconds (best of 3, the slowest of
  ranks 0, world/2 and world-1) and heap peak, both phases summed. The whole plan's size
  (transfers, units, bytes read) is counted from the sweep's arrays; ``--reference`` also
  times it as every rank computed it before (``plan_transfers``, ``split_units``,
  ``balance_units``: one object per transfer and unit).

Targets (issue 13): local planning + the global plan <= 2 s and <= 1 GiB per rank at 8,192
ranks; payload per rank a few MiB at most.

Run:  python benchmarks/bench_planning.py            # the figures of docs/distributed.md (~2-3 min, 2 cores)
      python benchmarks/bench_planning.py --quick    # 12 layers, 1,024 and 8,192 ranks, FSDP (seconds)
      python benchmarks/bench_planning.py --decode --plot docs/img/planning_scaling.png
          # also the time to read .metadata (about 2 more minutes) and the PNG (needs matplotlib)
      python benchmarks/bench_planning.py --ranks 8192 --reference   # the 8,192-rank points, and the
          # whole plan as before, side by side
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from asyncload import LoadOptions
from asyncload.decoding import check_metadata
from asyncload.distributed import UNIT_SIZE
from asyncload.distributed import identity as identity_mod
from asyncload.distributed import share_plan as sharded
from asyncload.engine import Piece, make_chunks, read_items_for_chunks, state_dict_read_items
from asyncload.formats import HEAD_PROBE, TAIL_PROBE, decode_metadata

MiB = 1 << 20
DTYPE = torch.bfloat16
ITEM = 2
REC_OVERHEAD = 1577  # bytes of a torch.save zip around one tensor's data (measured with dcp.save)
DATA_IN = 1024  # where the data starts inside a record (approximately)
SAVED_RANKS = 1024

Box = tuple[tuple[int, ...], tuple[int, ...]]


# --- the model and its layouts -----------------------------------------------------------------


def model(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, kind)``; kind: ``col``/``row`` (TP column/row parallel), ``norm``."""
    h, kv, ffn, vocab = 8192, 1024, 28672, 128256
    out = [("embed.weight", (vocab, h), "col")]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "attn.q.weight", (h, h), "col"),
            (p + "attn.k.weight", (kv, h), "col"),
            (p + "attn.v.weight", (kv, h), "col"),
            (p + "attn.o.weight", (h, h), "row"),
            (p + "mlp.gate.weight", (ffn, h), "col"),
            (p + "mlp.up.weight", (ffn, h), "col"),
            (p + "mlp.down.weight", (h, ffn), "row"),
            (p + "attn_norm.weight", (h,), "norm"),
            (p + "mlp_norm.weight", (h,), "norm"),
        ]
    return [*out, ("norm.weight", (h,), "norm"), ("lm_head.weight", (vocab, h), "col")]


@dataclass(frozen=True)
class Mesh:
    dp: int
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"FSDP {self.dp}" if self.tp == 1 else f"FSDP x TP {self.dp}x{self.tp}"


def even_split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``n`` split like DTensor's ``Shard`` (ceil-sized; trailing parts empty at ``n``)."""
    step = -(-n // parts)
    a = min(i * step, n)
    return a, max(0, min(step, n - a))


def box(shape: tuple[int, ...], kind: str, mesh: Mesh, rank: int) -> Box:
    """What rank ``rank`` (= dp index * tp + tp index) holds of a tensor."""
    i, j = divmod(rank, mesh.tp)
    rest = tuple(shape[1:])
    if mesh.tp == 1 or kind == "norm":
        a, n = even_split(shape[0], mesh.dp, i)
        return (a, *[0] * len(rest)), (n, *rest)
    if kind == "col":  # TP's Shard(0), then FSDP's Shard(0) inside it (_StridedShard)
        ta, tn = even_split(shape[0], mesh.tp, j)
        a, n = even_split(tn, mesh.dp, i)
        return (ta + a, 0), (n, shape[1])
    a, n = even_split(shape[0], mesh.dp, i)  # row: FSDP rows x TP columns
    c, m = even_split(shape[1], mesh.tp, j)
    return (a, c), (n, m)


def saved_ranks(kind: str, mesh: Mesh) -> list[int]:
    """The ranks whose chunk of a tensor is in the checkpoint (replicas saved once)."""
    if kind == "norm" and mesh.tp > 1:
        return [i * mesh.tp for i in range(mesh.dp)]
    return list(range(mesh.world))


def chunk_md(b: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(b[0]), sizes=torch.Size(b[1]))


@dataclass
class Checkpoint:
    """The Metadata and, per tensor, each chunk's record: file index, offset, length."""

    md: Metadata
    files: dict[str, list[int]]
    offsets: dict[str, list[int]]
    lengths: dict[str, list[int]]


def build_checkpoint(tensors: list[tuple[str, tuple[int, ...], str]], mesh: Mesh) -> Checkpoint:
    props = TensorProperties(dtype=DTYPE)
    sdm: dict[str, Any] = {}
    files: dict[str, list[int]] = {}
    offsets: dict[str, list[int]] = {}
    lengths: dict[str, list[int]] = {}
    pos = [0] * mesh.world
    per_kind: dict[
        tuple[tuple[int, ...], str], tuple[list[ChunkStorageMetadata], list[int], list[int]]
    ] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for name, shape, kind in tensors:
        key = (shape, kind)
        if key not in per_kind:
            ranks = saved_ranks(kind, mesh)
            boxes = [box(shape, kind, mesh, r) for r in ranks]
            per_kind[key] = (
                [chunk_md(b) for b in boxes],
                ranks,
                [math.prod(b[1]) * ITEM + REC_OVERHEAD for b in boxes],
            )
        chunks, ranks, lens = per_kind[key]
        # one Metadata entry per tensor, its own chunk objects (as unpickled from .metadata)
        sdm[name] = TensorStorageMetadata(
            properties=props,
            size=torch.Size(shape),
            chunks=[
                ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                for c in chunks
            ],
        )
        offs = []
        for j, (f, n) in enumerate(zip(ranks, lens)):
            offs.append(pos[f])
            storage[MetadataIndex(name, chunks[j].offsets, j)] = _StorageInfo(
                f"__{f}_0.distcp", pos[f], n
            )
            pos[f] += n
        files[name], offsets[name], lengths[name] = ranks, offs, lens
    md = Metadata(state_dict_metadata=sdm, storage_data=storage, version="1.0.0")
    return Checkpoint(md, files, offsets, lengths)


class Held(torch.Tensor):
    """A rank's destination: a meta tensor of the global shape that holds ``box`` here,
    speaking DTensor's checkpoint protocol (both planners ask ``__create_chunk_list__``)."""

    _held: list[ChunkStorageMetadata]

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], held: Box) -> Held:
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=DTYPE, device="meta"))
        t._held = [chunk_md(held)]
        return t  # type: ignore[return-value]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._held


def destination(
    tensors: list[tuple[str, tuple[int, ...], str]], mesh: Mesh, rank: int
) -> dict[str, Any]:
    return {name: Held(shape, box(shape, kind, mesh, rank)) for name, shape, kind in tensors}


# --- measuring ---------------------------------------------------------------------------------------


def best_of(fn: Callable[[], Any], n: int = 3) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(n):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def heap_peak(fn: Callable[[], Any]) -> int:
    """Bytes the Python heap grew to at most during ``fn()`` (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def signature(items: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [
        (
            i.type,
            i.dest_index,
            i.dest_index.index,
            i.dest_offsets,
            i.storage_index,
            i.storage_index.index,
            *rest,
        )
        for i in items
        for rest in [(i.storage_offsets, i.lengths)]
    ]


# --- what a rank all-gathers ---------------------------------------------------------------------------


def coalesce(
    pieces: list[tuple[int, int]], chunk_size: int, min_chunk_size: int
) -> list[tuple[int, int]]:
    """``asyncload.engine.plan.make_chunks``' rule over one file's pieces ``(start, end)``."""
    out: list[tuple[int, int]] = []
    cur_start = cur_end = -1
    for s, e in sorted(pieces):
        if cur_start >= 0:
            gap = s - cur_end
            small = e - s < min_chunk_size and cur_end - cur_start < min_chunk_size
            if (gap <= 0 or (gap <= min_chunk_size and small)) and max(
                cur_end, e
            ) - cur_start <= chunk_size:
                cur_end = max(cur_end, e)
                continue
            out.append((cur_start, cur_end))
        cur_start, cur_end = s, e
    if cur_start >= 0:
        out.append((cur_start, cur_end))
    return out


def advertise(per_file: dict[int, list[tuple[int, int]]]) -> list[tuple[str, int, int]]:
    """The session's needs from its chunks (``asyncload.distributed.share_plan._advertise``: sorted, overlaps dropped)."""
    needs = []
    for f in sorted(per_file, key=lambda f: f"__{f}_0.distcp"):
        covered = -1
        for s, e in per_file[f]:
            lo = max(s, covered)
            if lo < e:
                needs.append((f"__{f}_0.distcp", lo, e))
            covered = max(covered, e)
    return needs


def group_items(
    ck: Checkpoint, groups: dict[tuple[tuple[int, ...], str], list[str]], mesh: Mesh
) -> dict[tuple[tuple[int, ...], str], dict[int, list[tuple[int, int, int]]]]:
    """Per group of tensors with one layout and per rank: ``(saved chunk, first byte in the
    record's data, span in bytes)`` of each read item. The tensors of a group share their
    layout, so one intersection (asyncload's sweep, every rank's box at once) serves all."""
    sdm = ck.md.state_dict_metadata
    out: dict[tuple[tuple[int, ...], str], dict[int, list[tuple[int, int, int]]]] = {}
    for (shape, kind), names in groups.items():
        md = sdm[names[0]]
        held = [chunk_md(box(shape, kind, mesh, r)) for r in range(mesh.world)]
        by_rank: dict[int, list[tuple[int, int, int]]] = {}
        for it in read_items_for_chunks(names[0], md, held):
            if math.prod(it.lengths) == 0:
                continue
            j = it.storage_index.index
            assert j is not None and it.dest_index.index is not None
            saved = md.chunks[j].sizes
            strides = [math.prod(saved[d + 1 :]) for d in range(len(saved))]
            first = sum(o * s for o, s in zip(it.storage_offsets, strides)) * ITEM
            span = (sum((n - 1) * s for n, s in zip(it.lengths, strides)) + 1) * ITEM
            by_rank.setdefault(it.dest_index.index, []).append((j, first, span))
        out[(shape, kind)] = by_rank
    return out


def rank_needs(
    ck: Checkpoint,
    groups: dict[tuple[tuple[int, ...], str], list[str]],
    items: dict[tuple[tuple[int, ...], str], dict[int, list[tuple[int, int, int]]]],
    rank: int,
    options: LoadOptions,
) -> tuple[list[list[tuple[str, int, int]]], dict[int, list[list[tuple[int, int]]]]]:
    """The needs of ``rank`` for phase 0 and phase 1, and the raw pieces (for checking the
    coalescing), by the session's rules."""
    cs, mcs = options.chunk_policy.chunk_size, options.chunk_policy.min_chunk_size
    small = min(mcs + HEAD_PROBE + TAIL_PROBE, cs)
    pieces: dict[int, list[list[tuple[int, int]]]] = {}  # file -> [phase 0 pieces, phase 1 pieces]
    for key, names in groups.items():
        for j, first, span in items[key].get(rank, ()):
            for name in names:
                f = ck.files[name][j]
                off, ln = ck.offsets[name][j], ck.lengths[name][j]
                p0, p1 = pieces.setdefault(f, [[], []])
                if ln <= small:
                    p0.append((off, off + ln))  # a small record: read whole in phase 0
                    continue
                p0.append((off, off + min(HEAD_PROBE, ln)))
                p0.append((off + ln - min(TAIL_PROBE, ln), off + ln))
                start = off + DATA_IN + first
                for lo in range(0, span, cs):
                    p1.append((start + lo, start + min(span, lo + cs)))
    needs = []
    for phase in (0, 1):
        per_file = {
            f: coalesce(sorted(set(p[phase])), cs, mcs) for f, p in pieces.items() if p[phase]
        }
        needs.append(advertise(per_file))
    return needs, pieces


def check_coalescing(pieces: dict[int, list[list[tuple[int, int]]]], options: LoadOptions) -> None:
    """``coalesce`` gives what ``make_chunks`` gives on the same pieces."""
    cs, mcs = options.chunk_policy.chunk_size, options.chunk_policy.min_chunk_size
    for f, phases in pieces.items():
        for p in phases:
            ps = sorted(set(p))
            want = [
                (c.start, c.end)
                for c in make_chunks(
                    [Piece("x", s, e) for s, e in ps], chunk_size=cs, min_chunk_size=mcs
                )
            ]
            assert coalesce(ps, cs, mcs) == want, f


def identities(md: Metadata) -> Any:
    """What the share session digests of the metadata (once per rank and load)."""
    return identity_mod.file_identities(md)


def encode(needs: list[tuple[str, int, int]], identity: Any) -> bytes:
    """What one rank contributes to the all-gather (``all_gather_object`` pickles it): the
    share session's compact form (the digests of the files it needs, its ranges packed)
    when this tree has one, else the list of ranges."""
    pack = getattr(sharded, "_pack", None)
    if pack is None:
        return pickle.dumps(needs)
    if isinstance(identity, dict):
        identity = {f: identity.get(f, "") for f in sorted({n for n, _, _ in needs})}
    return pickle.dumps((identity, pack(needs)))


def decode(blob: bytes) -> Any:
    """What every rank does with each rank's contribution after the all-gather
    (``all_gather_object`` unpickles it); the share session plans from the packed ranges as
    they come."""
    return pickle.loads(blob)


def unit_size(options: LoadOptions) -> int:
    return min(UNIT_SIZE, options.effective_chunk_size)


def rank_plan(gathered: list[Any], rank: int, options: LoadOptions) -> Any:
    """What the share session plans on ``rank`` (adaptive sharing, the default): its part of
    the global plan, from the packed needs as gathered (``_rank_plan``)."""
    return sharded._rank_plan([g[1] for g in gathered], rank, unit_size(options))


def full_plan(gathered: list[Any], options: LoadOptions) -> tuple[int, int, int]:
    """The whole plan, one object per transfer and unit (``plan_transfers``, ``split_units``,
    ``balance_units``: the reference, what every rank computed before ``_rank_plan``):
    transfers, units, bytes read."""
    transfers, load = sharded.plan_transfers([g[1] for g in gathered])
    units = sharded.balance_units(sharded.split_units(transfers, unit_size(options)), load)
    return len(transfers), len(units), sum(load)


def full_counts(gathered: list[Any], options: LoadOptions) -> tuple[int, int, int]:
    """The whole plan's size, from the sweep's arrays (no object per transfer): transfers,
    units, bytes read."""
    needs = [g[1] for g in gathered]
    shared = sharded._sweep(needs, range(len(needs)))
    starts = sharded._split(shared.start, shared.end, unit_size(options))[0]
    return (
        len(shared.start),
        len(starts),
        int(shared.alone.sum() + (shared.end - shared.start).sum()),
    )


# --- one case -----------------------------------------------------------------------------------------


def run_case(
    tensors: list[tuple[str, tuple[int, ...], str]],
    ck: Checkpoint,
    mesh: Mesh,
    options: LoadOptions,
    reference: bool = False,
) -> dict[str, Any]:
    row: dict[str, Any] = {"mesh": str(mesh), "ranks": mesh.world, "tensors": len(tensors)}
    md = ck.md
    # local planning on two ranks: torch's intersection and asyncload's sweep
    t_torch, t_ours = [], []
    for rank in (0, mesh.world // 2):
        sd = destination(tensors, mesh, rank)
        tt, want = best_of(lambda sd=sd: create_default_local_load_plan(sd, md, True).items)
        to, got = best_of(lambda sd=sd: state_dict_read_items(sd, md, strict=True))
        if signature(got) != signature(want):
            raise SystemExit(f"{mesh} rank {rank}: asyncload's read items differ from torch's")
        t_torch.append(tt)
        t_ours.append(to)
        row["items_per_rank"] = max(row.get("items_per_rank", 0), len(got))
    sd = destination(tensors, mesh, mesh.world // 2)
    row["local_torch_s"] = max(t_torch)
    row["local_ours_s"] = max(t_ours)
    row["local_torch_heap"] = heap_peak(lambda: create_default_local_load_plan(sd, md, True))
    row["local_ours_heap"] = heap_peak(lambda: state_dict_read_items(sd, md, strict=True))
    # every rank's needs, as the share session all-gathers them
    groups: dict[tuple[tuple[int, ...], str], list[str]] = {}
    for name, shape, kind in tensors:
        groups.setdefault((shape, kind), []).append(name)
    t0 = time.perf_counter()
    items = group_items(ck, groups, mesh)
    all_needs: list[list[list[tuple[str, int, int]]]] = [[], []]
    for rank in range(mesh.world):
        needs, pieces = rank_needs(ck, groups, items, rank, options)
        if rank == 0:
            check_coalescing(pieces, options)
        for phase in (0, 1):
            all_needs[phase].append(needs[phase])
    wanted = (
        sum(
            math.prod(box(shape, kind, mesh, r)[1])
            for _, shape, kind in tensors
            for r in range(mesh.world)
        )
        * ITEM
    )
    row["simulate_s"] = time.perf_counter() - t0
    row["wanted_bytes"] = wanted
    row["needed_bytes"] = sum(e - s for phase in all_needs for ns in phase for _, s, e in ns)
    identity = identities(md)
    sums = dict.fromkeys(
        ("payload_max", "gathered_bytes", "decode_s", "decode_heap", "plan_s", "plan_heap"), 0.0
    )
    sums.update(
        dict.fromkeys(
            ("units_rank", "component", "full_s", "full_heap", "transfers", "units"), 0.0
        )
    )
    sums["read_bytes"] = 0.0
    samples = sorted({0, mesh.world // 2, mesh.world - 1})
    for phase in (0, 1):
        blobs = [encode(ns, identity) for ns in all_needs[phase]]
        sums["payload_max"] += max(map(len, blobs))
        sums["gathered_bytes"] += sum(map(len, blobs))
        d, gathered = best_of(lambda blobs=blobs: [decode(b) for b in blobs], 1)
        sums["decode_s"] += d
        sums["decode_heap"] = max(
            sums["decode_heap"], heap_peak(lambda blobs=blobs: [decode(b) for b in blobs])
        )
        # the runtime: each rank plans its part; the slowest of the sampled ranks
        times, parts = [], []
        for rank in samples:
            t, part = best_of(lambda g=gathered, r=rank: rank_plan(g, r, options), 3)
            times.append(t)
            parts.append(part)
        sums["plan_s"] += max(times)
        peak = max(
            heap_peak(lambda g=gathered, r=rank: rank_plan(g, r, options)) for rank in samples
        )
        sums["plan_heap"] = max(sums["plan_heap"], peak)
        sums["units_rank"] += max(len(p.items) for p in parts)
        sums["component"] = max(sums["component"], max(len(p.ranks) for p in parts))
        # the whole plan: how many transfers and units, the bytes read (and, --reference, its cost)
        if reference:
            f, (n_t, n_u, read) = best_of(lambda g=gathered: full_plan(g, options), 1)
            sums["full_s"] += f
            sums["full_heap"] = max(
                sums["full_heap"], heap_peak(lambda g=gathered: full_plan(g, options))
            )
        else:
            n_t, n_u, read = full_counts(gathered, options)
        sums["transfers"] += n_t
        sums["units"] += n_u
        sums["read_bytes"] += read
        del blobs, gathered, parts
    row |= sums
    row["entries_per_rank"] = sum(len(ns) for phase in all_needs for ns in phase) / mesh.world
    row["total_s"] = row["local_ours_s"] + sums["decode_s"] + sums["plan_s"]
    return row


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


#: The per-rank table: header, row key, unit (s: seconds, MiB/KiB: bytes, n: a count).
COLUMNS = [
    ("load mesh", "mesh", ""),
    ("ranks", "ranks", ""),
    ("read items/rank", "items_per_rank", ""),
    ("local plan torch s", "local_torch_s", "s"),
    ("local plan asyncload s", "local_ours_s", "s"),
    ("heap torch MiB", "local_torch_heap", "MiB"),
    ("heap asyncload MiB", "local_ours_heap", "MiB"),
    ("needs ranges/rank", "entries_per_rank", "n"),
    ("payload/rank KiB", "payload_max", "KiB"),
    ("all-gathered MiB", "gathered_bytes", "MiB"),
    ("decode s", "decode_s", "s"),
    ("transfers (all)", "transfers", "n"),
    ("units (all)", "units", "n"),
    ("component ranks", "component", "n"),
    ("units/rank", "units_rank", "n"),
    ("rank plan s", "plan_s", "s"),
    ("heap decode MiB", "decode_heap", "MiB"),
    ("heap rank plan MiB", "plan_heap", "MiB"),
    ("local + decode + rank plan s", "total_s", "s"),
]
#: With --reference: the whole plan as every rank computed it before (one object per unit).
REFERENCE = [
    ("full plan s (reference)", "full_s", "s"),
    ("heap full plan MiB", "full_heap", "MiB"),
]


def cell(value: Any, unit: str) -> str:
    if unit == "s":
        return f"{value:.3f}"
    if unit in ("MiB", "KiB"):
        return f"{value / (MiB if unit == 'MiB' else 1024):.1f}"
    return f"{value:.0f}" if unit == "n" else str(value)


def print_rows(rows: list[dict[str, Any]], reference: bool) -> None:
    columns = COLUMNS + (REFERENCE if reference else [])
    cols = [(head, lambda r, k=key, u=unit: cell(r[k], u)) for head, key, unit in columns]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "|".join([" --- "] * len(cols)) + "|")
    for r in rows:
        print("| " + " | ".join(f(r) for _, f in cols) + " |")
    print()
    print(
        "| load mesh | ranks | destination bytes (all ranks) | in the needs (all ranks) | ratio | read with sharing | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        w = r["wanted_bytes"]
        print(
            f"| {r['mesh']} | {r['ranks']} | {w / 2**30:.1f} GiB | {r['needed_bytes'] / 2**30:.1f} GiB "
            f"| {r['needed_bytes'] / w:.2f}x | {r['read_bytes'] / 2**30:.1f} GiB | {r['read_bytes'] / w:.2f}x |"
        )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for tp, label in ((False, "FSDP"), (True, "FSDP x TP (tp 8)")):
        sel = [r for r in rows if ("TP" in r["mesh"]) == tp]
        if not sel:
            continue
        xs = [r["ranks"] for r in sel]
        ax_t.plot(
            xs,
            [r["local_torch_s"] for r in sel],
            "o--",
            label=f"{label}: torch DefaultLoadPlanner local planning",
        )
        ax_t.plot(
            xs,
            [r["local_ours_s"] for r in sel],
            "o-",
            label=f"{label}: asyncload (PipelinedLoadPlanner) local planning",
        )
        both = [r["decode_s"] + r["plan_s"] for r in sel]
        ax_t.plot(
            xs, both, "s-", label=f"{label}: ShardedLoadPlanner: decode needs + this rank's plan"
        )
        if any(r["full_s"] for r in sel):
            full = [r["decode_s"] + r["full_s"] for r in sel]
            ax_t.plot(xs, full, "x:", label=f"{label}: decode + the whole plan (before)")
        # one unit on the axis (MiB, log scale): a payload of KiB sits at 10^-3..10^-2
        ax_b.plot(
            xs, [r["payload_max"] / MiB for r in sel], "o-", label=f"{label}: payload per rank"
        )
        ax_b.plot(
            xs, [r["gathered_bytes"] / MiB for r in sel], "s--", label=f"{label}: all-gathered"
        )
        # a plan with no units has no heap of its own: left out of the log axis, not drawn at 0
        heap = [r["plan_heap"] / MiB or float("nan") for r in sel]
        ax_b.plot(xs, heap, "^-", label=f"{label}: heap of this rank's plan")
        ax_b.plot(
            xs,
            [r["decode_heap"] / MiB for r in sel],
            "v--",
            label=f"{label}: heap of the gathered needs",
        )
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks loading (checkpoint saved on 1,024)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.set_ylabel("seconds per rank")
    ax_t.axhline(2.0, color="grey", lw=0.8, ls=":")
    ax_b.set_yscale("log")
    ax_b.set_ylabel("MiB per rank")
    fig.suptitle(
        "Planning a load of a 1,002-tensor model saved on 1,024 ranks (one rank, pure functions)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=111)
    ap.add_argument(
        "--quick", action="store_true", help="12 layers; FSDP only, 1,024 and 8,192 ranks"
    )
    ap.add_argument(
        "--decode",
        action="store_true",
        help="also time reading .metadata: pickle.loads and asyncload's decode",
    )
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--plot", help="write the PNG plot here (needs matplotlib)")
    ap.add_argument(
        "--ranks", help="only these numbers of ranks loading, comma-separated (e.g. 8192)"
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also time the whole plan as one object per transfer and unit (plan_transfers, split_units, "
        "balance_units; about 10 s per 8,192-rank case)",
    )
    ap.add_argument(
        "--plot-from",
        metavar="JSON",
        help="only redraw --plot from rows stored earlier (docs/img/planning_scaling.json: the table of docs/distributed.md)",
    )
    args = ap.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            stored = json.load(f)
        plot(stored["rows"], args.plot or "planning_scaling.png")
        return
    layers = 12 if args.quick else args.layers
    tensors = model(layers)
    options = LoadOptions()
    cases: list[tuple[Mesh, list[Mesh]]] = [
        (
            Mesh(SAVED_RANKS),
            [Mesh(n) for n in ((1024, 8192) if args.quick else (1024, 2048, 4096, 8192))],
        ),
    ]
    if not args.quick:
        cases.append((Mesh(128, 8), [Mesh(128, 8), Mesh(256, 8), Mesh(512, 8), Mesh(1024, 8)]))
    if args.ranks:
        keep = {int(n) for n in args.ranks.split(",")}
        cases = [(saved, [m for m in loads if m.world in keep]) for saved, loads in cases]
    print(
        f"{len(tensors)} tensors, {sum(math.prod(s) for _, s, _ in tensors) * ITEM / 2**30:.0f} GiB in bfloat16; "
        f"torch {torch.__version__}; chunk_size {options.effective_chunk_size >> 20} MiB, "
        f"min_chunk_size {options.chunk_policy.min_chunk_size >> 20} MiB; load average {loadavg()}"
    )
    rows = []
    for saved_mesh, loads in cases:
        t0 = time.perf_counter()
        ck = build_checkpoint(tensors, saved_mesh)
        chunks = sum(len(v.chunks) for v in ck.md.state_dict_metadata.values())
        built = time.perf_counter() - t0
        ident, _ = best_of(lambda md=ck.md: identities(md), 1)
        checked, _ = best_of(lambda md=ck.md: check_metadata(md, "simulated .metadata"), 1)
        print(
            f"saved as {saved_mesh}: {chunks:,} chunks in the metadata (built in {built:.1f} s); once per rank and "
            f"load: check_metadata {checked:.2f} s, the share session's metadata digests {ident:.2f} s",
            flush=True,
        )
        if args.decode and saved_mesh.tp == 1:
            raw = pickle.dumps(ck.md)
            loads_s, _ = best_of(lambda raw=raw: pickle.loads(raw), 1)
            ours_s, _ = best_of(
                lambda raw=raw: decode_metadata(raw, "simulated/.metadata", max_size=len(raw)), 1
            )
            print(
                f"  .metadata: {len(raw) / MiB:.1f} MiB pickled; pickle.loads (torch's reader) {loads_s:.1f} s, "
                f"asyncload's decode_metadata (allow-list machine + check_metadata) {ours_s:.1f} s",
                flush=True,
            )
            del raw
        for mesh in loads:
            row = run_case(tensors, ck, mesh, options, args.reference)
            row["saved"] = str(saved_mesh)
            rows.append(row)
            print(
                f"  loaded as {mesh}: local planning torch {row['local_torch_s']:.3f} s, asyncload "
                f"{row['local_ours_s']:.3f} s; this rank's plan {row['plan_s']:.3f} s; "
                f"payload {row['payload_max'] / 1024:.1f} KiB/rank (simulated every rank in {row['simulate_s']:.1f} s)",
                flush=True,
            )
        del ck
        gc.collect()
    print()
    print_rows(rows, args.reference)
    print(f"\nload average after: {loadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    from _parts import run_part  # --part NAME: a folded-in part (benchmarks/README.md)

    run_part(__file__, {"claims": "_planning_claims.py", "metadata": "_planning_metadata.py"})
    main()
