"""A rank's local load plan: the read items that fill its destination chunks from the
saved chunks, found by a sorted sweep instead of torch's scan.

torch's ``DefaultLoadPlanner.create_local_plan`` intersects each destination chunk with
the saved chunks of its tensor (``create_read_items_for_chunk_list``). Since torch 2.10
it sweeps along the dimension with the largest extent, but a destination chunk still
tests every saved chunk it has passed in that dimension, and every saved chunk when the
tensor is sharded along another one (FSDP's ``Shard(0)`` of a wide matrix): a rank of a
job on thousands of ranks tests thousands of saved chunks per tensor (pytorch#169113).

Here each tensor's saved chunks are sorted once along the dimension that separates them
best (guessed from the first chunk: the dimension it is the smallest part of); a
destination chunk bisects to the saved chunks that start within ``(start - longest, end)``
along it and tests only those in every dimension. The answer is torch's own, bit for bit: the same
``ReadItem`` s (offsets, lengths, storage indexes) in the same order, which is found out once per
process from torch itself (:func:`_torch_order`); a torch that orders some other way, or a layout
whose chunks disagree on their number of dimensions, is handed to torch's own function.
"""

from __future__ import annotations

import bisect
import functools
import operator
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

__all__ = ["local_load_plan", "read_items_for_chunks", "state_dict_read_items"]


def local_load_plan(planner: DefaultLoadPlanner, skip: Collection[str] = ()) -> LoadPlan:
    """What ``DefaultLoadPlanner.create_local_plan`` returns for ``planner`` (set up), with
    the intersection done by :func:`read_items_for_chunks`. Keys in ``skip`` (tied
    destinations, filled through another key) are left out of the plan.

    Raises what torch's planner raises for a destination that does not match (``RuntimeError``
    for a missing key, ``ValueError`` for a size mismatch or a tensor saved as an object).
    """
    md = planner.metadata
    if md is None:
        raise ValueError("the planner was not set up with metadata")
    if planner.flatten_state_dict:
        _rekey_pre_2_4(planner, md)
    state_dict = planner.state_dict
    if skip:
        state_dict = {k: v for k, v in state_dict.items() if k not in skip}
    return LoadPlan(state_dict_read_items(state_dict, md, strict=not planner.allow_partial_load))


def _rekey_pre_2_4(planner: DefaultLoadPlanner, md: Metadata) -> None:
    """torch's step before planning: keys the destination lacks may be those of a
    checkpoint saved by torch < 2.4, which flattened nested containers differently; then
    the destination is flattened that way (as ``DefaultLoadPlanner.create_local_plan``)."""
    current = set(planner.state_dict)
    missing = {k for k in md.state_dict_metadata if k not in current}
    if not missing:
        return
    from torch.distributed.checkpoint import _version
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    _version._derived_version = "2_3"
    try:
        old_state_dict, old_mappings = flatten_state_dict(planner.original_state_dict)
    finally:
        _version._derived_version = None
    if missing.intersection(old_state_dict):
        planner.state_dict, planner.mappings = old_state_dict, old_mappings


def state_dict_read_items(
    state_dict: dict[str, Any], metadata: Metadata, *, strict: bool = True
) -> list[ReadItem]:
    """torch's ``create_default_local_load_plan(state_dict, metadata, strict).items``, with
    the intersection done by :func:`read_items_for_chunks`."""
    from torch.distributed.checkpoint.planner_helpers import (
        _create_chunk_list,
        _create_read_item_for_byteio,
    )
    from torch.distributed.tensor import DTensor

    saved = metadata.state_dict_metadata
    items: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        if fqn not in saved:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        md = saved[fqn]
        if (
            isinstance(md, TensorStorageMetadata)
            and getattr(obj, "size", None) is not None
            and md.size != obj.size()
        ):
            raise ValueError(
                f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}"
            )
        # a DTensor on a submesh this rank is not part of: nothing to read here
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue
        if isinstance(md, BytesStorageMetadata):
            items.append(
                _create_read_item_for_byteio(
                    dest_index=MetadataIndex(fqn),
                    dest_offset=0,
                    storage_index=MetadataIndex(fqn),
                    storage_offset=0,
                    length=0,
                )
            )
            continue
        try:
            local_chunks = _create_chunk_list(obj)
        except ValueError as ex:
            raise ValueError(
                f"Invalid checkpoint metadata for {fqn}, expected BytesStorageMetadata but found {type(md)}"
            ) from ex
        items += read_items_for_chunks(fqn, md, local_chunks)
    return items


def read_items_for_chunks(
    fqn: str, checkpoint_md: TensorStorageMetadata, local_chunks: Sequence[ChunkStorageMetadata]
) -> list[ReadItem]:
    """torch's ``create_read_items_for_chunk_list(fqn, checkpoint_md, local_chunks)``:
    one ``ReadItem`` per (destination chunk, saved chunk) pair that overlaps, in torch's
    order, found by a sorted sweep over the saved chunks.

    Every chunk has as many dimensions as the first destination chunk (what
    ``check_metadata`` ensures for a checkpoint's chunks, and torch assumes)."""
    saved = checkpoint_md.chunks
    if not local_chunks or not saved:
        return []
    if len(saved) == 1 and len(local_chunks) == 1:
        # one process's checkpoint into one process's tensor: the whole box, when they agree
        sc, lc = saved[0], local_chunks[0]
        if (
            sc.offsets == lc.offsets
            and sc.sizes == lc.sizes
            and not any(sc.offsets)
            and all(sc.sizes)
        ):
            zeros = torch.Size([0] * len(sc.offsets))
            return [
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, lc.offsets, 0),
                    dest_offsets=zeros,
                    storage_index=MetadataIndex(fqn, sc.offsets, 0),
                    storage_offsets=zeros,
                    lengths=torch.Size(sc.sizes),
                )
            ]
    order = _torch_order()
    if order is None:  # pragma: no cover - a torch with a third order
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        return create_read_items_for_chunk_list(fqn, checkpoint_md, list(local_chunks))
    ndim = len(local_chunks[0].offsets)
    if ndim == 0:
        hits = [list(range(len(saved))) for _ in local_chunks]
        locals_in_order: Sequence[int] = range(len(local_chunks))
    else:
        hits = _sweep(saved, local_chunks, _split_dim(checkpoint_md, ndim))
        t = -1  # torch's sweep dimension, found only when the order depends on it
        if order == "sweep" and (len(local_chunks) > 1 or any(len(h) > 1 for h in hits)):
            t = _torch_sweep_dim(saved, local_chunks, ndim)
            for h in hits:
                if len(h) > 1:
                    h.sort(key=lambda j: (saved[j].offsets[t] + saved[j].sizes[t], j))
        if t >= 0 and len(local_chunks) > 1:
            locals_in_order = sorted(
                range(len(local_chunks)), key=lambda i: local_chunks[i].offsets[t]
            )
        else:
            locals_in_order = range(len(local_chunks))
    items: list[ReadItem] = []
    for li in locals_in_order:
        lc = local_chunks[li]
        dest_index = MetadataIndex(fqn, lc.offsets, li)
        for j in hits[li]:
            sc = saved[j]
            storage_offsets, dest_offsets, lengths = _narrow(sc, lc)
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=dest_index,
                    dest_offsets=torch.Size(dest_offsets),
                    storage_index=MetadataIndex(fqn, sc.offsets, j),
                    storage_offsets=torch.Size(storage_offsets),
                    lengths=torch.Size(lengths),
                )
            )
    return items


def _split_dim(md: TensorStorageMetadata, ndim: int) -> int:
    """The dimension the saved chunks are most likely split in most: where the first
    chunk is the smallest part of the tensor (a guess that costs O(1); any answer is
    correct, a good one keeps the candidates few)."""
    if ndim == 1 or len(md.size) != ndim:
        return 0
    first = md.chunks[0].sizes
    return max(range(ndim), key=lambda d: md.size[d] / first[d] if first[d] else float("inf"))


def _sweep(
    saved: Sequence[ChunkStorageMetadata], local_chunks: Sequence[ChunkStorageMetadata], p: int
) -> list[list[int]]:
    """For each destination chunk, the indexes of the saved chunks that overlap it, in
    index order. The saved chunks are sorted by start along dimension ``p`` once; a
    destination chunk ``[a, b)`` along ``p`` tests only those that start in
    ``(a - longest, b)``, ``longest`` the largest saved length along ``p``."""
    starts = [c.offsets[p] for c in saved]
    longest = max([c.sizes[p] for c in saved])
    if starts == sorted(starts):  # the usual case: dcp.save lists chunks in rank order
        by_start: Sequence[int] = range(len(saved))
        sorted_starts = starts
    else:
        by_start = sorted(range(len(saved)), key=starts.__getitem__)
        sorted_starts = [starts[i] for i in by_start]
    hits: list[list[int]] = []
    for lc in local_chunks:
        lo, ls = lc.offsets, lc.sizes
        a = lo[p]
        i0 = bisect.bisect_right(sorted_starts, a - longest)
        i1 = bisect.bisect_left(sorted_starts, a + ls[p])
        found = [j for j in by_start[i0:i1] if _overlap(lo, ls, saved[j].offsets, saved[j].sizes)]
        found.sort()
        hits.append(found)
    return hits


def _torch_sweep_dim(
    saved: Sequence[ChunkStorageMetadata], local_chunks: Sequence[ChunkStorageMetadata], ndim: int
) -> int:
    """The dimension torch sweeps along: the first with the largest extent over all chunks."""
    if ndim == 1:
        return 0
    best, t = 0, 0
    for d in range(ndim):
        extent = max(
            max(map(operator.add, [c.offsets[d] for c in saved], [c.sizes[d] for c in saved])),
            max(c.offsets[d] + c.sizes[d] for c in local_chunks),
        )
        if extent > best:
            best, t = extent, d
    return t


def _overlap(lo: Sequence[int], ls: Sequence[int], so: Sequence[int], ss: Sequence[int]) -> bool:
    """torch's ``_check_shard_metadata_pair_overlap``: no dimension separates the two boxes."""
    return all(a < b + m and b < a + n for a, n, b, m in zip(lo, ls, so, ss))


def _narrow(
    saved: ChunkStorageMetadata, local: ChunkStorageMetadata
) -> tuple[list[int], list[int], list[int]]:
    """torch's ``_shards_get_overlap_region_wrt_saved_tensor``: the overlap's offsets in the
    saved chunk, in the destination chunk, and its lengths."""
    storage_offsets: list[int] = []
    dest_offsets: list[int] = []
    lengths: list[int] = []
    for so, lo, ss, ls in zip(saved.offsets, local.offsets, saved.sizes, local.sizes):
        lengths.append(min(so + ss, lo + ls) - max(lo, so))
        if so > lo:
            storage_offsets.append(0)
            dest_offsets.append(so - lo)
        else:
            storage_offsets.append(lo - so)
            dest_offsets.append(0)
    return storage_offsets, dest_offsets, lengths


@functools.cache
def _torch_order() -> str | None:
    """How this torch orders read items, asked of torch once on a layout where the two
    known orders differ: ``"sweep"`` (torch >= 2.10: destination chunks by start along the
    sweep dimension, then saved chunks by end along it), ``"scan"`` (older: by index, then
    by index), None for neither (then torch's own function does every intersection)."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    def chunk(start: int, end: int) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([start]), sizes=torch.Size([end - start]))

    md = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size([4]),
        chunks=[chunk(2, 4), chunk(0, 2)],
    )
    got = [
        (r.dest_index.index, r.storage_index.index)
        for r in create_read_items_for_chunk_list("probe", md, [chunk(1, 4), chunk(0, 1)])
    ]
    if got == [(1, 1), (0, 1), (0, 0)]:
        return "sweep"
    if got == [(0, 0), (0, 1), (1, 1)]:
        return "scan"
    return None  # pragma: no cover - a torch with a third order
