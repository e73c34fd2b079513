"""What to read: a tensor's bytes in a file, a box of it, a destination view ->
byte-range pieces; pieces -> chunks (small neighbours coalesced, large ranges split).

Pure planning, no I/O. A saved tensor may have any dense layout (a transposed
tensor is saved with its strides): dimensions are ordered by stride, so the storage
is row-major in that order, and a box of the tensor is a set of runs. A run whose
destination memory is contiguous in the same order is read straight into it; other
runs, and runs whose gaps are small enough to read through (``max_gap``, by default
``min_chunk_size``), go through a staging buffer and one strided copy.

Reading a gap costs its bytes; skipping it costs one more request. :func:`break_even_gap`
prices the two from a store's per-request latency and bandwidth, and :func:`make_chunks`
reads through a gap only when that is cheaper and, under ``max_over_read``, only while the
bytes read through gaps stay within a budget (``LoadOptions.max_over_read_ratio``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from asyncload.common.errors import CheckpointFormatError, StateDictMismatchError
from asyncload.engine.assembly import memory_of, tensor_over
from asyncload.engine.chunks import Chunk, Piece, TensorLocation

__all__ = [
    "break_even_gap",
    "can_copy",
    "cast_loss",
    "check_cast",
    "make_chunks",
    "plan_tensor",
    "widening_is_lossless",
]

_COPYABLE: dict[tuple[torch.dtype, torch.dtype], bool] = {}

_INTS = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
_FLOATS = tuple(
    d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        *(
            getattr(torch, n, None)
            for n in (
                "float8_e4m3fn",
                "float8_e5m2",
                "float8_e4m3fnuz",
                "float8_e5m2fnuz",
                "float8_e8m0fnu",
            )
        ),
    )
    if isinstance(d, torch.dtype)
)
#: complex dtype -> the float dtype of each component
_COMPLEX = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}


@functools.cache
def _float_traits(dt: torch.dtype) -> tuple[int, float, float, bool, bool, bool]:
    """(mantissa bits, largest finite, smallest positive, has inf, has negatives, has zero) of a float dtype."""
    fi = torch.finfo(dt)
    # mantissa bits probed (finfo's eps of float8_e5m2fnuz says 3 bits, it has 2)
    mant = 0
    while (x := 1 + 2.0 ** -(mant + 1)) != 1.0 and float(
        torch.tensor(x, dtype=torch.float64).to(dt)
    ) == x:
        mant += 1
    smallest = fi.tiny * 2.0**-mant  # the smallest subnormal (no subnormals without mantissa bits)
    probe = torch.tensor([math.inf, -1.0, 0.0], dtype=torch.float64).to(dt).to(torch.float64)
    return (
        mant,
        fi.max,
        smallest,
        bool(probe[0].isinf()),
        bool(probe[1] == -1.0),
        bool(probe[2] == 0.0),
    )


def _int_range(dt: torch.dtype) -> tuple[int, int]:
    if dt == torch.bool:
        return 0, 1
    ii = torch.iinfo(dt)
    return int(ii.min), int(ii.max)


def _int_into_float(src: torch.dtype, dst: torch.dtype) -> str | None:
    lo, hi = _int_range(src)
    mant, fmax, _, _, negatives, zero = _float_traits(dst)
    if (lo < 0 and not negatives) or not zero or hi > fmax:
        return f"{dst} cannot hold every value of {src}"
    # the most significant bits: ``hi`` (``lo`` is minus a power of two, exact wherever it fits)
    if hi.bit_length() > mant + 1:
        return f"integers of {src} have more significant bits than the {mant + 1} of {dst}"
    return None


def _float_into_float(src: torch.dtype, dst: torch.dtype) -> str | None:
    s_mant, s_max, s_small, s_inf, s_neg, s_zero = _float_traits(src)
    d_mant, d_max, d_small, d_inf, d_neg, d_zero = _float_traits(dst)
    if d_mant < s_mant:
        return f"narrowing: {dst} has {d_mant} mantissa bits, {src} {s_mant}"
    if d_max < s_max or d_small > s_small:
        return f"narrowing: {dst} has a smaller exponent range than {src}"
    if (s_inf and not d_inf) or (s_neg and not d_neg) or (s_zero and not d_zero):
        return f"{dst} has no {'infinity' if s_inf and not d_inf else 'negative numbers' if s_neg and not d_neg else 'zero'}"
    return None


def cast_loss(src: torch.dtype, dst: torch.dtype) -> str | None:
    """Why converting every ``src`` value into ``dst`` can change a value (``None``: it
    cannot, the conversion is lossless widening). The one rule of which dtype changes load
    without ``LoadOptions.allow_dtype_cast`` (docs/errors.md tabulates it)."""
    if src == dst:
        return None
    if dst == torch.bool:
        return "a conversion into bool keeps only zero or not"
    src_int = src == torch.bool or src in _INTS
    if src_int and dst in _INTS:
        lo, hi = _int_range(src)
        dlo, dhi = _int_range(dst)
        if lo < dlo or hi > dhi:
            return f"{dst} cannot hold every value of {src}" + (
                " (negative numbers)" if lo < 0 <= dlo else ""
            )
        return None
    if src in _COMPLEX:
        if dst not in _COMPLEX:
            return "a complex number into a real type drops the imaginary part"
        return _float_into_float(_COMPLEX[src], _COMPLEX[dst])
    d_real = _COMPLEX.get(dst, dst)
    if d_real not in _FLOATS:
        if src in _FLOATS and (dst in _INTS):
            return "a float into an integer type drops the fraction (and overflows)"
        return f"torch defines no lossless conversion from {src} to {dst}"
    if src_int:
        return _int_into_float(src, d_real)
    if src in _FLOATS:
        return _float_into_float(src, d_real)
    return f"torch defines no lossless conversion from {src} to {dst}"


def widening_is_lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value converts into ``dst`` exactly (bf16 -> fp32, int8 -> int32...)."""
    return cast_loss(src, dst) is None


def check_cast(src: torch.dtype, dst: torch.dtype, *, allow_cast: bool, what: str) -> None:
    """Raise StateDictMismatchError unless a saved ``src`` may load into a ``dst`` destination:
    the same dtype, lossless widening, or any conversion torch has when ``allow_cast``.
    ``what`` names the place (``"key 'w'"``)."""
    if src == dst:
        return
    if not allow_cast:
        loss = cast_loss(src, dst)
        if loss is not None:
            raise StateDictMismatchError(
                f"{what}: the destination has dtype {dst}, the checkpoint {src}: {loss} "
                "(set LoadOptions.allow_dtype_cast=True to convert on load anyway; lossless widening, "
                "such as torch.bfloat16 into torch.float32, needs no option)"
            )
    if not can_copy(src, dst):
        raise StateDictMismatchError(
            f"{what}: the checkpoint's {src} cannot be converted to the destination's {dst} "
            f"(torch has no conversion between them): load into a {src} destination"
        )


def can_copy(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether torch can copy (convert) ``src`` elements into a ``dst`` tensor: not every
    pair can (``torch.bits8``, ``torch.float4_e2m1fn_x2`` and the like have no conversion
    kernels). Probed once per pair on two bytes of memory, then cached."""
    if src == dst:
        return True
    known = _COPYABLE.get((src, dst))
    if known is None:
        try:
            a = torch.zeros(src.itemsize, dtype=torch.uint8).view(src)
            b = torch.zeros(dst.itemsize, dtype=torch.uint8).view(dst)
            b.copy_(a)
            known = True
        except Exception:
            known = False
        _COPYABLE[(src, dst)] = known
    return known


def _contiguous_box(lens: Sequence[int], strides: Sequence[int]) -> bool:
    expected = 1
    for n, s in zip(reversed(lens), reversed(strides)):
        if n == 1:
            continue
        if s != expected:
            return False
        expected *= n
    return True


def _span_elems(lens: Sequence[int], strides: Sequence[int]) -> int:
    return sum((n - 1) * s for n, s in zip(lens, strides)) + 1


def _max_gap_elems(lens: Sequence[int], strides: Sequence[int]) -> int:
    gap = 0
    for i, n in enumerate(lens):
        if n > 1:
            inner = _span_elems(lens[i + 1 :], strides[i + 1 :])
            gap = max(gap, strides[i] - inner)
    return gap


def plan_tensor(
    loc: TensorLocation,
    offsets: Sequence[int],
    lengths: Sequence[int],
    dest: torch.Tensor,
    *,
    chunk_size: int,
    min_chunk_size: int,
    allow_cast: bool = False,
    key: str = "",
    direct_ok: bool = True,
    stager: Any = None,
    max_gap: int | None = None,
) -> list[Piece]:
    """Pieces that copy box ``[offsets, offsets + lengths)`` of the saved tensor into ``dest``.

    Runs of the box separated by gaps up to ``max_gap`` bytes (``None``: ``min_chunk_size``)
    are read as one staged piece, the gaps read through; ``max_gap=0`` reads every run on
    its own (joining runs is then left to :func:`make_chunks` and its over-read budget).

    ``dest`` has shape ``lengths`` (already narrowed to the destination box). When
    ``stager`` (a ``_cuda.DeviceStager``) claims ``dest``, every piece is staged through
    pinned memory and copied to the device by the stager's deliverer (``pinned=True``).
    """
    loc.check()
    n = len(loc.size)
    if (
        len(offsets) != n
        or len(lengths) != n
        or any(o < 0 or o + ln > s for o, ln, s in zip(offsets, lengths, loc.size))
    ):
        raise CheckpointFormatError(
            f"{loc.where}: read of box offsets {list(offsets)} lengths {list(lengths)} "
            f"does not fit the saved chunk of size {list(loc.size)}"
        )
    if tuple(dest.shape) != tuple(lengths):
        raise StateDictMismatchError(
            f"{key or loc.where}: destination has shape {list(dest.shape)}, "
            f"the checkpoint's piece has shape {list(lengths)}"
        )
    check_cast(
        loc.dtype, dest.dtype, allow_cast=allow_cast, what=f"key {key!r}" if key else loc.where
    )
    if math.prod(lengths) == 0:
        return []
    isz = loc.itemsize
    on_device = stager is not None and stager.claims(dest)
    can_direct = (
        direct_ok and dest.dtype == loc.dtype and dest.device.type == "cpu" and not on_device
    )
    if (
        can_direct
        and not any(offsets)
        and tuple(lengths) == tuple(loc.size)
        and _contiguous_box(lengths, loc.stride)
        and dest.is_contiguous()
    ):
        # the common case (a whole saved tensor, row-major, into a CPU tensor of its dtype):
        # the pieces the box walk below makes for it, without the walk
        start_b = loc.data_start + loc.storage_offset * isz
        nbytes = math.prod(lengths) * isz
        mv = memory_of(dest)
        return [
            Piece(
                loc.name,
                start_b + lo,
                start_b + min(nbytes, lo + chunk_size),
                into=mv[lo : lo + chunk_size],
                keep=dest,
            )
            for lo in range(0, nbytes, chunk_size)
        ]
    gap_ok = min_chunk_size if max_gap is None else max_gap
    perm = sorted(range(n), key=lambda i: (-loc.stride[i], i))
    strides_p = [loc.stride[i] for i in perm]
    offs_p = [offsets[i] for i in perm]
    lens_p = [lengths[i] for i in perm]
    dest_p = dest.permute(perm) if n > 1 else dest
    src_dtype = loc.dtype
    pieces: list[Piece] = []

    def base_elem(o: Sequence[int]) -> int:
        return loc.storage_offset + sum(a * s for a, s in zip(o, strides_p))

    def emit_direct(
        start_b: int, nbytes: int, view: torch.Tensor, mv: memoryview | None = None
    ) -> None:
        if mv is None:
            mv = memory_of(view)
        for lo in range(0, nbytes, chunk_size):
            hi = min(nbytes, lo + chunk_size)
            pieces.append(Piece(loc.name, start_b + lo, start_b + hi, into=mv[lo:hi], keep=view))

    def emit_staged(start_b: int, end_b: int, lens: list[int], view: torch.Tensor) -> None:
        shape = list(lens)
        strides = list(strides_p)
        useful = view.numel() * view.element_size()
        if on_device:
            pieces.append(
                Piece(
                    loc.name,
                    start_b,
                    end_b,
                    deliver=stager.deliverer(view, src_dtype, shape, strides),
                    keep=view,
                    pinned=True,
                    useful=useful,
                )
            )
            return

        def deliver(
            data: memoryview,
            shape: list[int] = shape,
            strides: list[int] = strides,
            view: torch.Tensor = view,
        ) -> None:
            src = tensor_over(data, src_dtype).as_strided(shape, strides, 0)
            view.copy_(src)

        pieces.append(Piece(loc.name, start_b, end_b, deliver=deliver, keep=view, useful=useful))

    # boxes still to place, depth first in order (an explicit stack: a recursive closure would
    # be a reference cycle keeping the destination views alive until a garbage collection)
    todo = [(list(offs_p), list(lens_p))]
    while todo:
        o, lens = todo.pop()
        view = dest_p
        for d, (a, ln) in enumerate(zip(o, lens)):
            rel = a - offs_p[d]
            if rel != 0 or ln != view.shape[d]:
                view = view.narrow(d, rel, ln)
        start_e = base_elem(o)
        span = _span_elems(lens, strides_p)
        start_b = loc.data_start + start_e * isz
        end_b = start_b + span * isz
        if _contiguous_box(lens, strides_p):
            if can_direct and view.is_contiguous():
                emit_direct(start_b, end_b - start_b, view)
                continue
            if end_b - start_b <= chunk_size:
                emit_staged(start_b, end_b, lens, view)
                continue
        elif end_b - start_b <= chunk_size and _max_gap_elems(lens, strides_p) * isz <= gap_ok:
            emit_staged(start_b, end_b, lens, view)
            continue
        # split along the outermost dimension that has more than one index; rows are
        # grouped into one staged read when the gaps between them are small
        d = next(i for i, ln in enumerate(lens) if ln > 1)
        row_bytes = max(1, strides_p[d] * isz)
        row_gap = (strides_p[d] - _span_elems(lens[d + 1 :], strides_p[d + 1 :])) * isz
        group = 1
        if row_gap <= gap_ok and _max_gap_elems(lens[d + 1 :], strides_p[d + 1 :]) * isz <= gap_ok:
            group = max(1, chunk_size // row_bytes)
        if group >= lens[d]:
            group = max(1, lens[d] // 2)
        if (
            group == 1
            and can_direct
            and view.is_contiguous()
            and _contiguous_box(lens[d + 1 :], strides_p[d + 1 :])
        ):
            # one direct run per index of ``d`` (a column slice's rows), without a box each
            inner = math.prod(lens[d + 1 :]) * isz
            step = strides_p[d] * isz
            mv = memory_of(view)
            for a in range(lens[d]):
                emit_direct(start_b + a * step, inner, view, mv[a * inner : (a + 1) * inner])
            continue
        subs = []
        for a in range(0, lens[d], group):
            sub_o = list(o)
            sub_l = list(lens)
            sub_o[d] = o[d] + a
            sub_l[d] = min(group, lens[d] - a)
            subs.append((sub_o, sub_l))
        todo.extend(reversed(subs))

    return pieces


def break_even_gap(latency: float, bandwidth: float) -> int:
    """The gap, in bytes, that costs as much to read through as one more request does:
    ``latency`` (seconds a request costs beyond its bytes) times ``bandwidth`` (bytes per
    second of one stream). Smaller gaps are cheaper read; larger ones cheaper skipped."""
    if not latency > 0 or not bandwidth > 0:
        return 0
    return int(min(latency * bandwidth, float(1 << 62)))


def make_chunks(
    pieces: Iterable[Piece],
    *,
    chunk_size: int,
    min_chunk_size: int,
    max_over_read: int | None = None,
    charge: Callable[[str, int, int], int] | None = None,
) -> list[Chunk]:
    """Group pieces into read requests: sorted by file and offset; neighbours joined when
    the gap is small (``min_chunk_size``) and the request stays within ``chunk_size``.

    ``max_over_read`` bounds the bytes read through gaps, over all files together: the
    cheapest gaps are joined first (each saves one request for the fewest bytes) until the
    next would exceed it. ``None``: no bound. ``charge(name, start, end)``: the bytes of a
    gap that count against the bound (default: all of them)."""
    by_file: dict[str, list[Piece]] = {}
    for p in pieces:
        by_file.setdefault(p.name, []).append(p)
    for ps in by_file.values():
        ps.sort(key=lambda p: (p.start, p.end))
    chosen = (
        None
        if max_over_read is None
        else _chosen_gaps(by_file, min_chunk_size, max_over_read, charge)
    )
    chunks: list[Chunk] = []
    for name, ps in by_file.items():
        cur: list[Piece] = []
        cur_start = cur_end = 0
        for i, p in enumerate(ps):
            if cur:
                gap = p.start - cur_end
                if chosen is None:
                    small = p.nbytes < min_chunk_size and (cur_end - cur_start) < min_chunk_size
                    joined = 0 < gap <= min_chunk_size and small
                else:
                    joined = (name, i) in chosen
                if (gap <= 0 or (gap > 0 and joined)) and max(
                    cur_end, p.end
                ) - cur_start <= chunk_size:
                    cur.append(p)
                    cur_end = max(cur_end, p.end)
                    continue
                chunks.append(_chunk(name, cur, cur_start, cur_end))
            cur, cur_start, cur_end = [p], p.start, p.end
        if cur:
            chunks.append(_chunk(name, cur, cur_start, cur_end))
    return chunks


def _chosen_gaps(
    by_file: dict[str, list[Piece]],
    min_chunk_size: int,
    budget: int,
    charge: Callable[[str, int, int], int] | None,
) -> set[tuple[str, int]]:
    """The gaps (file, index of the piece after it) worth reading through within ``budget``
    bytes: gaps up to ``min_chunk_size`` between pieces smaller than it, cheapest first."""
    candidates: list[tuple[int, str, int]] = []
    for name, ps in by_file.items():
        end = None
        prev = 0
        for i, p in enumerate(ps):
            if end is not None:
                gap = p.start - end
                if (
                    0 < gap <= min_chunk_size
                    and p.nbytes < min_chunk_size
                    and prev < min_chunk_size
                ):
                    candidates.append(
                        (gap if charge is None else charge(name, end, p.start), name, i)
                    )
            end = p.end if end is None else max(end, p.end)
            prev = p.nbytes
    # equal gaps (a column slice's rows) are taken spread over the file, not in a row: the
    # same bytes and requests, but the requests stay small (tiny local reads are batched)
    candidates.sort(key=lambda c: (c[0], _spread_key(c[2]), c[1]))
    chosen: set[tuple[str, int]] = set()
    for cost, name, i in candidates:
        if cost > budget:
            break
        budget -= cost
        chosen.add((name, i))
    return chosen


def _spread_key(i: int) -> int:
    """``i`` with its 32 low bits reversed: sorting by it visits 0..n spread evenly (0, n/2, n/4, 3n/4...)."""
    return int(f"{i & 0xFFFFFFFF:032b}"[::-1], 2) | (i >> 32) << 32


def _chunk(name: str, ps: list[Piece], start: int, end: int) -> Chunk:
    trackers = {id(p.tracker): p.tracker for p in ps if p.tracker is not None}
    return Chunk(name, start, end, ps, trackers=tuple(trackers.values()))
