"""The shape of a decoded DCP ``.metadata``, field by field (:func:`check_metadata`), and
the paths of a planner's ``planner_data`` (:func:`check_planner_paths`): what a hostile
``.metadata`` could claim is refused before anything is planned or read. The chunk
coverage check counts its work (:class:`~asyncload.decoding.work.WorkBudget`).

Raised: :class:`CheckpointFormatError` for any field of the wrong type or range, chunks
that overlap, leave holes or lie outside their tensor, and a work budget overrun.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from asyncload.common.errors import CheckpointFormatError
from asyncload.common.paths import check_relative_path
from asyncload.decoding.structure import _check_structure
from asyncload.decoding.tables import _is_int
from asyncload.decoding.vm import short_repr
from asyncload.decoding.work import WorkBudget

# --- the shape of a DCP .metadata ---------------------------------------------------


def _check_size(v: Any, where: str, ndim: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, tuple) or len(v) > 1024 or not all(_is_int(x) and x >= 0 for x in v):
        raise CheckpointFormatError(f"{where} is not a shape: {short_repr(v)}")
    if ndim is not None and len(v) != ndim:
        raise CheckpointFormatError(f"{where} has {len(v)} dimensions, the tensor has {ndim}")
    return v


def _check_coverage(
    chunks: list[Any], size: tuple[int, ...], where: str, work: WorkBudget | None = None
) -> None:
    """A saved tensor's chunks are disjoint and cover every element of its ``size``.

    A load plans its reads from the chunks: a gap would leave destination elements
    unwritten (old values reported as loaded), an overlap would write some twice from
    different bytes. Cost: a volume sum, then a sweep over the chunks sorted by their
    offsets, comparing each with the chunks that can still reach it in the swept
    dimension (DCP's chunks are a grid: each meets a few neighbours). Each chunk charges
    ``work`` a unit plus one per chunk it is compared with.
    """
    if work is None:
        work = WorkBudget()
    total = math.prod(size)
    if total == 0:
        return  # an empty tensor: DCP writes one chunk of the same empty size
    boxes = []
    volume = 0
    for i, ch in enumerate(chunks):
        lens = tuple(ch.sizes)
        n = math.prod(lens)
        if n == 0:
            continue  # holds no element: neither covers nor overlaps anything
        volume += n
        boxes.append((tuple(ch.offsets), lens, i))
    if not boxes:
        raise CheckpointFormatError(
            f"{where}: the tensor of size {list(size)} lists no chunk that holds its elements: "
            f"nothing of it was saved"
        )
    if len(size) == 0:  # a scalar: any non-empty chunk is the whole tensor
        if len(boxes) > 1:
            raise CheckpointFormatError(
                f"{where}: the scalar tensor is saved in {len(boxes)} overlapping chunks"
            )
        return
    # sweep along the dimension the chunks are split most in (row- or column-sharded alike)
    d = max(range(len(size)), key=lambda k: len({b[0][k] for b in boxes}))
    boxes.sort(key=lambda b: (b[0][d], b[2]))
    active: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    for box in boxes:
        offs, lens, i = box
        # chunks that end before this one starts in dimension d can meet no later chunk
        work.charge(1 + len(active), where)
        active = [b for b in active if b[0][d] + b[1][d] > offs[d]]
        for o2, l2, j in active:
            if all(a < b + m and b < a + n for a, n, b, m in zip(offs, lens, o2, l2)):
                raise CheckpointFormatError(
                    f"{where}: chunks {j} (at {list(o2)}, size {list(l2)}) and {i} (at "
                    f"{list(offs)}, "
                    f"size {list(lens)}) overlap"
                )
        active.append(box)
    if volume != total:
        raise CheckpointFormatError(
            f"{where}: the chunks hold {volume} of the tensor's {total} elements (size "
            f"{list(size)}): "
            "part of the tensor was not saved"
        )


# The checks below in bulk, for the layouts DCP writes: each proves a table right or says
# it cannot (then the field-by-field checks run and name what is wrong). A .metadata of
# 1 M chunks would otherwise spend seconds in Python per field.

_offsets_of = operator.attrgetter("offsets")
_sizes_of = operator.attrgetter("sizes")
_NONE = type(None)


def _int64s(shapes: list[Any], ndim: int) -> np.ndarray[Any, Any] | None:
    """``shapes`` (torch.Size objects of ``ndim`` ints: int64 by construction) as an array
    of ``len(shapes)`` rows, or None when any is something else."""
    if shapes and (set(map(type, shapes)) != {torch.Size} or set(map(len, shapes)) != {ndim}):
        return None
    flat = np.fromiter(
        itertools.chain.from_iterable(shapes), dtype=np.int64, count=len(shapes) * ndim
    )
    return flat.reshape(len(shapes), ndim)


def _grid_covers(
    offs: np.ndarray[Any, Any], lens: np.ndarray[Any, Any], size: tuple[int, ...]
) -> bool:
    """Whether the boxes (``offs``, ``lens``: rows inside ``size``) with elements are the
    cells of a grid, each once: per dimension their extents partition the tensor's, and
    there are as many boxes as cells. Then they are disjoint and cover every element."""
    held = (lens > 0).all(axis=1)
    offs, lens = offs[held], lens[held]
    boxes = len(offs)
    if boxes == 0:
        return False
    if boxes == 1:  # one chunk (what one process saves): a grid of one cell is the whole tensor
        return bool((offs[0] == 0).all() and (lens[0] == np.asarray(size, dtype=np.int64)).all())
    cell = np.zeros(boxes, dtype=np.int64)
    cells = 1
    for k, extent in enumerate(size):
        starts = _unique(offs[:, k])
        at = np.searchsorted(starts, offs[:, k])
        length = np.zeros(len(starts), dtype=np.int64)
        length[at] = lens[:, k]
        if (length[at] != lens[:, k]).any():  # one start, two lengths
            return False
        if (
            starts[0] != 0
            or (starts[1:] != starts[:-1] + length[:-1]).any()
            or starts[-1] + length[-1] != extent
        ):
            return False
        cells *= len(starts)
        if cells > boxes:
            return False
        cell = cell * len(starts) + at
    return cells == boxes and len(_unique(cell)) == boxes


def _unique(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``np.unique(a)`` of a 1-D integer array (``np.unique`` imports ``numpy.ma`` on first
    use: 5 ms of a fresh process's first load)."""
    s = np.sort(a)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s


def _chunks_fine(chunks: list[Any], size: tuple[int, ...], chunk_type: type) -> bool:
    """Whether a tensor's chunks are provably what the field-by-field checks accept."""
    if type(size) is not torch.Size:
        return False
    if len(chunks) == 1:  # what one process saves: one chunk, the whole tensor (no arrays needed)
        only = chunks[0]
        if type(only) is not chunk_type:
            return False
        offs, lens = getattr(only, "offsets", None), getattr(only, "sizes", None)
        return (
            type(offs) is torch.Size
            and type(lens) is torch.Size
            and len(offs) == len(size)
            and not any(offs)
            and tuple(lens) == tuple(size)
        )
    if set(map(type, chunks)) != {chunk_type}:
        return False
    try:
        offs_list, lens_list = list(map(_offsets_of, chunks)), list(map(_sizes_of, chunks))
    except AttributeError:
        return False
    ndim = len(size)
    offs, lens = _int64s(offs_list, ndim), _int64s(lens_list, ndim)
    if offs is None or lens is None or (ndim and (offs.min() < 0 or lens.min() < 0)):
        return False
    if (
        ndim and (offs > np.array(size, dtype=np.int64) - lens).any()
    ):  # o + n > s, without overflow
        return False
    if math.prod(size) == 0:
        return True
    if ndim == 0:
        return len(chunks) == 1
    return _grid_covers(offs, lens, size)


_I64_MAX = (1 << 63) - 1


def _storage_fine(sd: dict[Any, Any], index_type: type, info_type: type) -> bool:
    """Whether ``storage_data`` is provably what the field-by-field checks accept."""
    if not sd:
        return True
    keys, infos = list(sd), list(sd.values())
    if set(map(type, keys)) != {index_type} or set(map(type, infos)) != {info_type}:
        return False
    try:
        fqns = list(map(operator.attrgetter("fqn"), keys))
        offsets = list(map(operator.attrgetter("offset"), keys))
        hints = list(map(operator.attrgetter("index"), keys))
        paths = list(map(operator.attrgetter("relative_path"), infos))
        starts = list(map(operator.attrgetter("offset"), infos))
        lengths = list(map(operator.attrgetter("length"), infos))
    except AttributeError:
        return False
    if set(map(type, fqns)) != {str} or not set(map(type, hints)) <= {int, _NONE}:
        return False
    if {getattr(i, "transform_descriptors", None) is None for i in infos} != {True}:
        return False
    shapes = [o for o in offsets if o is not None]
    if not set(map(type, shapes)) <= {torch.Size} or (shapes and max(map(len, shapes)) > 1024):
        return False
    if min(itertools.chain.from_iterable(shapes), default=0) < 0:
        return False
    ints = [h for h in hints if h is not None]
    if ints and (min(ints) < 0 or max(ints) > _I64_MAX):
        return False
    if (
        set(map(type, starts)) != {int}
        or set(map(type, lengths)) != {int}
        or set(map(type, paths)) != {str}
    ):
        return False
    if min(starts) < 0 or min(lengths) < 0 or max(starts) > _I64_MAX or max(lengths) > _I64_MAX:
        return False
    try:
        for path in set(paths):
            check_relative_path(path, "")
    except CheckpointFormatError:
        return False
    return True


def check_metadata(md: Any, what: str, work: WorkBudget | None = None) -> None:
    """Check that a decoded ``.metadata`` has the shape DCP writes, field by field.

    Raises CheckpointFormatError naming the first field that does not: keys that are
    not strings, chunks that do not fit their tensor, storage entries with a negative
    offset or a path outside the checkpoint, and so on. After this, every value the
    planner and reader use has the type they expect.

    ``work`` is charged a unit per key, storage entry and path step, per dimension of each
    chunk, per chunk pair compared and per node of the structure walks; a budget with a
    limit ends the check with a CheckpointFormatError naming it.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not isinstance(md, Metadata):
        raise CheckpointFormatError(
            f"{what} does not hold DCP Metadata (found {type(md).__name__})"
        )
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise CheckpointFormatError(
            f"{what}: state_dict_metadata is a {type(sdm).__name__}, not a dict"
        )
    if work is None:
        work = WorkBudget()
    for fqn, smd in sdm.items():
        work.charge(1, what)
        if type(fqn) is not str:
            raise CheckpointFormatError(f"{what}: key {short_repr(fqn)} is not a string")
        where = f"{what}: key {fqn!r:.200}"
        if isinstance(smd, TensorStorageMetadata):
            props = getattr(smd, "properties", None)
            if not isinstance(props, TensorProperties) or not isinstance(
                getattr(props, "dtype", None), torch.dtype
            ):
                raise CheckpointFormatError(f"{where} has malformed tensor properties")
            size = _check_size(getattr(smd, "size", None), f"{where} size")
            chunks = getattr(smd, "chunks", None)
            if not isinstance(chunks, list):
                raise CheckpointFormatError(
                    f"{where}: chunks is a {type(chunks).__name__}, not a list"
                )
            work.charge(len(chunks) * max(1, len(size)), where)
            if _chunks_fine(chunks, size, ChunkStorageMetadata):
                continue
            for i, ch in enumerate(chunks):
                if not isinstance(ch, ChunkStorageMetadata):
                    raise CheckpointFormatError(f"{where}: chunk {i} is a {type(ch).__name__}")
                offs = _check_size(
                    getattr(ch, "offsets", None), f"{where} chunk {i} offsets", len(size)
                )
                lens = _check_size(
                    getattr(ch, "sizes", None), f"{where} chunk {i} sizes", len(size)
                )
                if any(o + n > s for o, n, s in zip(offs, lens, size)):
                    raise CheckpointFormatError(
                        f"{where}: chunk {i} at {list(offs)} of size {list(lens)} "
                        f"lies outside the tensor of size {list(size)}"
                    )
            _check_coverage(chunks, size, where, work)
        elif not isinstance(smd, BytesStorageMetadata):
            raise CheckpointFormatError(f"{where} is described by a {type(smd).__name__}")
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        raise CheckpointFormatError(f"{what}: storage_data is a {type(sd).__name__}, not a dict")
    work.charge(len(sd), what)
    for idx, info in () if _storage_fine(sd, MetadataIndex, _StorageInfo) else sd.items():
        if not isinstance(idx, MetadataIndex) or type(getattr(idx, "fqn", None)) is not str:
            raise CheckpointFormatError(
                f"{what}: storage_data key {short_repr(idx)} is not a MetadataIndex"
            )
        off = getattr(idx, "offset", None)
        if off is not None:
            _check_size(off, f"{what}: storage_data key {idx.fqn!r:.200} offset")
        hint = getattr(idx, "index", None)
        if hint is not None and not (_is_int(hint) and hint >= 0):
            raise CheckpointFormatError(
                f"{what}: storage_data key {idx.fqn!r:.200} has index {short_repr(hint)}"
            )
        where = f"{what}: storage entry of {idx.fqn!r:.200}"
        check_relative_path(getattr(info, "relative_path", None), where)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_is_int(offset) and offset >= 0 and _is_int(length) and length >= 0):  # type: ignore[operator]
            raise CheckpointFormatError(
                f"{where} has offset {short_repr(offset)} and length {short_repr(length)}"
            )
        td = getattr(info, "transform_descriptors", None)
        if td is not None and (
            not isinstance(td, (list, tuple)) or not all(type(t) is str for t in td)
        ):
            raise CheckpointFormatError(f"{where} has malformed transform descriptors")
    version = getattr(md, "version", None)
    if version is not None and (type(version) is not str or len(version) > 64):
        raise CheckpointFormatError(
            f"{what}: version {short_repr(version)} is not a version string"
        )
    meta = getattr(md, "storage_meta", None)
    if meta is not None and not isinstance(meta, StorageMeta):
        raise CheckpointFormatError(f"{what}: storage_meta is a {type(meta).__name__}")
    planner_data = getattr(md, "planner_data", None)
    _check_structure(planner_data, f"{what} (planner_data)", 64, 1 << 24, work)
    _check_structure(meta, f"{what} (storage_meta)", 16, 1 << 20, work)
    check_planner_paths(sdm, planner_data, what, work)


def check_planner_paths(
    sdm: Mapping[str, Any], planner_data: Any, what: str, work: WorkBudget | None = None
) -> None:
    """Check that the paths ``planner_data`` gives the keys of ``sdm`` nest them into one tree
    without a clash, before anything is allocated or nested. A key's path is its entry (a
    non-empty tuple or list), else ``(fqn,)``, as :func:`asyncload.faces.allocating.nest` takes it.

    Each step is a ``str`` (a dict key) or an ``int`` (a list index, ``0 <= i < len(sdm)``: a
    list of ``n`` saved elements holds at least ``n`` keys), the first a ``str``; the steps
    under one container are all of one kind; no path is another's, nor runs through another
    key's value (a tensor, an object). Raises :class:`CheckpointFormatError` naming the key,
    its path and the rule, so that a forged ``.metadata`` can neither write into a tensor's
    elements, nor grow a list without bound, nor end in a raw ``IndexError``/``TypeError``.
    Time and memory: linear in the paths' total length (charged to ``work``, a unit a step).
    """
    mapping = planner_data if isinstance(planner_data, dict) else {}
    n = len(sdm)
    # a trie of the paths: inner nodes are dicts, a key's place holds its name (a str)
    root: dict[Any, Any] = {}
    for fqn in sdm:
        path = mapping.get(fqn)
        if not isinstance(path, (tuple, list)) or not path:
            path = (fqn,)
        node: Any = root
        last = len(path) - 1
        if work is not None:
            work.charge(1 + last, what)
        for i, step in enumerate(path):
            kind = type(step)
            if kind is int:
                if not 0 <= step < n:
                    _bad_path(
                        what,
                        fqn,
                        path,
                        f"indexes a list at {step}, outside the {n} keys of the checkpoint",
                    )
            elif kind is not str:
                _bad_path(
                    what,
                    fqn,
                    path,
                    f"has a step of type {kind.__name__}, neither a string nor an int",
                )
            child = node.get(step)
            if child is None:
                if node:
                    first = next(iter(node))
                    if type(first) is not kind:
                        where = f"{'a list' if type(first) is int else 'a dict'} that holds {short_repr(first)}"
                        _bad_path(what, fqn, path, f"steps into {where} with {short_repr(step)}")
                elif node is root and kind is not str:
                    _bad_path(
                        what, fqn, path, "does not start with a string (the top level is a dict)"
                    )
                child = node[step] = fqn if i == last else {}
            elif type(child) is str:
                rule = "is the path of key" if i == last else "runs through the value of key"
                _bad_path(
                    what,
                    fqn,
                    path,
                    f"{rule} {child!r:.200} too" if i == last else f"{rule} {child!r:.200}",
                )
            elif i == last:
                _bad_path(what, fqn, path, "is a container of other keys' values")
            node = child


def _bad_path(what: str, fqn: str, path: Any, rule: str) -> None:
    raise CheckpointFormatError(
        f"{what}: planner_data nests key {fqn!r:.200} at {short_repr(path)}, which {rule}: "
        "the metadata is damaged or forged"
    )
