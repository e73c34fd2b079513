"""plan_tensor / make_chunks: boxes of saved tensors -> byte-range pieces -> read requests.

Every test executes the plan against an in-memory "file" (bytes) holding a saved tensor's
storage, exactly as the pipeline would (direct pieces copy into destination memory, staged
pieces go through ``deliver``), and checks the destination bit for bit.
"""

from __future__ import annotations

import ctypes
import itertools
import math

import pytest
import torch
from _ckpt import assert_bitwise_equal, random_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncload import CheckpointFormatError, StateDictMismatchError
from asyncload.engine.chunks import Piece, TensorLocation
from asyncload.engine.plan import make_chunks, plan_tensor

pytestmark = pytest.mark.timeout(60)

HEADER = 1000  # bytes before the storage in the fake file (like a zip local header)


def fake_file(saved: torch.Tensor, *, pad_after: int = 100) -> bytes:
    """A file holding ``saved``'s whole storage at HEADER, as torch.save lays it out."""
    raw = bytes(saved.untyped_storage())
    return b"\xaa" * HEADER + raw + b"\xbb" * pad_after


def location(saved: torch.Tensor, name: str = "f.distcp") -> TensorLocation:
    """The TensorLocation of ``saved`` as torch.save would store it: its whole storage at HEADER."""
    st_ = saved.untyped_storage()
    return TensorLocation(
        name=name,
        data_start=HEADER,
        storage_nbytes=st_.nbytes(),
        dtype=saved.dtype,
        size=tuple(saved.shape),
        stride=tuple(saved.stride()),
        storage_offset=saved.storage_offset(),
        where=f"record in {name}",
    )


def run_pieces(pieces: list[Piece], data: bytes) -> None:
    for p in pieces:
        part = memoryview(data)[p.start : p.end]
        assert len(part) == p.nbytes
        if p.into is not None:
            assert p.deliver is None
            p.into[:] = part
        else:
            assert p.deliver is not None
            p.deliver(part)


def run_chunks(chunks, data: bytes) -> None:
    for c in chunks:
        buf = memoryview(data)[c.start : c.end]
        assert c.segments, c
        for s in c.segments:
            assert c.start <= s.start < s.end <= c.end
            part = buf[s.start - c.start : s.end - c.start]
            if s.into is not None:
                s.into[:] = part
            else:
                s.deliver(part)


def plan(saved, offsets, lengths, dest, *, chunk_size=1 << 20, min_chunk_size=0, **kw):
    return plan_tensor(
        location(saved),
        offsets,
        lengths,
        dest,
        chunk_size=chunk_size,
        min_chunk_size=min_chunk_size,
        **kw,
    )


def box_of(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    v = t
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        v = v.narrow(d, o, n)
    return v


# --- rows, columns, splits ---------------------------------------------------------------


def test_row_slice_is_one_direct_contiguous_range():
    saved = random_tensor((100, 64), torch.float32, seed=1)
    data = fake_file(saved)
    dest = torch.zeros(30, 64)
    pieces = plan(saved, (20, 0), (30, 64), dest)
    assert len(pieces) == 1
    p = pieces[0]
    assert p.into is not None and p.deliver is None
    assert (p.start, p.end) == (HEADER + 20 * 64 * 4, HEADER + 50 * 64 * 4)
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved[20:50])


def test_row_slice_split_at_chunk_size():
    saved = random_tensor((100, 64), torch.float32, seed=2)  # 256 bytes per row
    data = fake_file(saved)
    dest = torch.zeros(40, 64)
    cs = 1000  # not a multiple of a row or an element: the split is by bytes
    pieces = plan(saved, (10, 0), (40, 64), dest, chunk_size=cs)
    total = 40 * 64 * 4
    assert len(pieces) == math.ceil(total / cs)
    assert all(p.nbytes <= cs and p.into is not None for p in pieces)
    # the pieces tile the range exactly, in order
    assert pieces[0].start == HEADER + 10 * 256
    assert all(a.end == b.start for a, b in itertools.pairwise(pieces))
    assert pieces[-1].end == HEADER + 50 * 256
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved[10:50])


def test_column_slice_with_big_gaps_gives_strided_ranges():
    saved = random_tensor((20, 1000), torch.float32, seed=3)  # rows of 4000 bytes
    data = fake_file(saved)
    dest = torch.zeros(20, 10)
    pieces = plan(saved, (0, 500), (20, 10), dest, chunk_size=1 << 20, min_chunk_size=100)
    assert len(pieces) == 20
    starts = [p.start for p in pieces]
    assert starts == [HEADER + (r * 1000 + 500) * 4 for r in range(20)]
    assert all(p.nbytes == 40 for p in pieces)
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved[:, 500:510])
    # each run is one request: the gaps (3960 bytes) exceed min_chunk_size, nothing is coalesced
    chunks = make_chunks(pieces, chunk_size=1 << 20, min_chunk_size=100)
    assert len(chunks) == 20
    assert [(c.start, c.end) for c in chunks] == [(p.start, p.end) for p in pieces]


def test_column_slice_with_small_gaps_is_coalesced_into_one_staged_read():
    saved = random_tensor((20, 100), torch.int16, seed=4)  # rows of 200 bytes
    data = fake_file(saved)
    dest = torch.zeros(20, 10, dtype=torch.int16)
    pieces = plan(saved, (0, 30), (20, 10), dest, chunk_size=1 << 20, min_chunk_size=180)
    assert len(pieces) == 1
    p = pieces[0]
    assert p.deliver is not None and p.into is None
    assert (p.start, p.end) == (HEADER + 30 * 2, HEADER + (19 * 100 + 40) * 2)
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved[:, 30:40])


def test_column_slice_gap_exactly_min_chunk_size_is_coalesced_and_one_more_byte_is_not():
    saved = random_tensor((8, 100), torch.uint8, seed=5)
    data = fake_file(saved)
    gap = 100 - 10
    dest = torch.zeros(8, 10, dtype=torch.uint8)
    assert len(plan(saved, (0, 0), (8, 10), dest, min_chunk_size=gap)) == 1
    pieces = plan(saved, (0, 0), (8, 10), dest, min_chunk_size=gap - 1)
    assert len(pieces) == 8
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved[:, :10])


def test_coalesced_column_slice_split_at_chunk_size():
    saved = random_tensor((64, 50), torch.float32, seed=6)  # rows of 200 bytes
    data = fake_file(saved)
    dest = torch.zeros(64, 40)
    cs = 1024
    pieces = plan(saved, (0, 5), (64, 40), dest, chunk_size=cs, min_chunk_size=64)
    assert len(pieces) > 1
    assert all(p.nbytes <= cs for p in pieces)
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved[:, 5:45])


def test_transposed_saved_tensor_into_contiguous_destination():
    saved = random_tensor((300, 70), torch.float32, seed=7).t()  # (70, 300), stride (1, 70)
    data = fake_file(saved)
    dest = torch.zeros(70, 300)
    pieces = plan(saved, (0, 0), (70, 300), dest, chunk_size=4096, min_chunk_size=1024)
    assert all(p.nbytes <= 4096 for p in pieces)
    # the storage is read once, in order: no byte twice
    assert sum(p.nbytes for p in pieces) == 300 * 70 * 4
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved)


def test_transposed_saved_tensor_into_transposed_destination_is_direct():
    saved = random_tensor((300, 70), torch.float32, seed=8).t()
    data = fake_file(saved)
    dest = torch.zeros(300, 70).t()  # same layout as saved
    pieces = plan(saved, (0, 0), (70, 300), dest, chunk_size=1 << 20)
    assert len(pieces) == 1 and pieces[0].into is not None
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved)


def test_storage_offset_respected():
    big = random_tensor((50, 40), torch.float64, seed=9)
    saved = big[10:30, 5:25]  # a view: storage_offset 405, the whole storage saved
    assert saved.storage_offset() == 405
    data = fake_file(big)
    dest = torch.zeros(20, 20, dtype=torch.float64)
    pieces = plan(saved, (0, 0), (20, 20), dest, min_chunk_size=0)
    assert pieces[0].start == HEADER + 405 * 8
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved)


def test_dtype_cast_only_when_allowed():
    # a lossy cast (narrowing) needs allow_cast; lossless widening does not (tests/engine/test_dtype_rules.py)
    saved = random_tensor((16, 16), torch.float32, seed=10).nan_to_num(0.0, 0.0, 0.0)
    data = fake_file(saved)
    dest = torch.zeros(16, 16, dtype=torch.float16)
    with pytest.raises(StateDictMismatchError, match="allow_dtype_cast") as ei:
        plan(saved, (0, 0), (16, 16), dest, key="layer.w")
    assert (
        "layer.w" in str(ei.value)
        and "torch.float16" in str(ei.value)
        and "torch.float32" in str(ei.value)
    )
    pieces = plan(saved, (0, 0), (16, 16), dest, allow_cast=True)
    assert all(p.into is None for p in pieces)  # never raw bytes into a different dtype
    run_pieces(pieces, data)
    assert torch.equal(dest, saved.half())


def test_wrong_destination_shape_and_out_of_range_box():
    saved = random_tensor((10, 10), torch.float32, seed=11)
    with pytest.raises(StateDictMismatchError, match=r"k.*\[3, 4\].*\[3, 5\]"):
        plan(saved, (0, 0), (3, 5), torch.zeros(3, 4), key="k")
    with pytest.raises(CheckpointFormatError):
        plan(saved, (8, 0), (3, 10), torch.zeros(3, 10))


def test_location_check_rejects_storage_too_small():
    loc = TensorLocation(
        name="f",
        data_start=0,
        storage_nbytes=100,
        dtype=torch.float32,
        size=(5, 6),
        stride=(6, 1),
        where="record 'x'",
    )
    with pytest.raises(CheckpointFormatError, match="record 'x'.*needs 120 bytes.*has 100"):
        loc.check()


def test_empty_box_plans_nothing():
    saved = random_tensor((10, 10), torch.float32, seed=12)
    assert plan(saved, (0, 0), (0, 10), torch.zeros(0, 10)) == []


def test_zero_dim_tensor():
    saved = random_tensor((), torch.complex128, seed=13)
    data = fake_file(saved)
    dest = torch.zeros((), dtype=torch.complex128)
    pieces = plan(saved, (), (), dest)
    assert [(p.start, p.end) for p in pieces] == [(HEADER, HEADER + 16)]
    run_pieces(pieces, data)
    assert_bitwise_equal(dest, saved)


# --- make_chunks ---------------------------------------------------------------------------


def _p(name, start, end):
    return Piece(name, start, end, into=memoryview(bytearray(end - start)))


def test_make_chunks_coalesces_small_neighbours_within_min_chunk_size():
    ps = [_p("a", 0, 10), _p("a", 30, 40), _p("a", 60, 70)]
    chunks = make_chunks(ps, chunk_size=1000, min_chunk_size=50)
    assert [(c.start, c.end) for c in chunks] == [(0, 70)]
    assert len(chunks[0].segments) == 3
    assert not chunks[0].tiles_into()  # gaps are read and thrown away: staged
    # coalescing stops once the request has grown to min_chunk_size
    chunks = make_chunks(ps, chunk_size=1000, min_chunk_size=20)
    assert [(c.start, c.end) for c in chunks] == [(0, 40), (60, 70)]
    chunks = make_chunks(ps, chunk_size=1000, min_chunk_size=19)
    assert [(c.start, c.end) for c in chunks] == [(0, 10), (30, 40), (60, 70)]


def test_make_chunks_joins_adjacent_pieces_up_to_chunk_size():
    ps = [_p("a", i * 100, (i + 1) * 100) for i in range(10)]
    chunks = make_chunks(ps, chunk_size=350, min_chunk_size=0)
    assert [(c.start, c.end) for c in chunks] == [(0, 300), (300, 600), (600, 900), (900, 1000)]
    assert all(c.tiles_into() for c in chunks)


def test_make_chunks_never_exceeds_chunk_size_and_keeps_files_apart():
    ps = [_p("b", 0, 10), _p("a", 5, 15), _p("a", 0, 5), _p("b", 12, 20)]
    chunks = make_chunks(ps, chunk_size=1000, min_chunk_size=100)
    got = sorted((c.name, c.start, c.end) for c in chunks)
    assert got == [("a", 0, 15), ("b", 0, 20)]
    chunks = make_chunks(ps, chunk_size=12, min_chunk_size=100)
    assert all(c.nbytes <= 12 for c in chunks)
    assert sorted(s.start for c in chunks for s in c.segments) == sorted(p.start for p in ps)


def test_make_chunks_large_pieces_are_not_coalesced_across_gaps():
    ps = [_p("a", 0, 500), _p("a", 510, 1010)]
    chunks = make_chunks(ps, chunk_size=4096, min_chunk_size=100)
    assert [(c.start, c.end) for c in chunks] == [(0, 500), (510, 1010)]


# --- property: any layout, any box, any destination layout, any sizes ----------------------

DTYPES = [torch.uint8, torch.int16, torch.float32, torch.float64, torch.complex128, torch.bfloat16]


@st.composite
def cases(draw):
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    perm = draw(st.permutations(range(ndim))) if ndim else []
    # the saved tensor: a permutation of a contiguous tensor, maybe with a storage offset
    pre = draw(st.integers(0, 3))
    phys = [shape[i] for i in perm]
    inv = [perm.index(i) for i in range(ndim)]
    offsets, lengths = [], []
    for n in shape:
        o = draw(st.integers(0, n - 1))
        offsets.append(o)
        lengths.append(draw(st.integers(1, n - o)))
    dest_perm = draw(st.permutations(range(ndim))) if ndim else []
    dest_pad = draw(st.integers(0, 2))
    chunk_size = draw(st.sampled_from([1, 7, 16, 64, 200, 1 << 20]))
    min_chunk_size = draw(st.sampled_from([0, 1, 8, 50, 1 << 20]))
    return (
        shape,
        dtype,
        perm,
        inv,
        pre,
        phys,
        offsets,
        lengths,
        dest_perm,
        dest_pad,
        chunk_size,
        min(min_chunk_size, chunk_size),
        draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_property_any_box_any_layout_is_bit_exact(case):
    (
        shape,
        dtype,
        _perm,
        inv,
        pre,
        phys,
        offsets,
        lengths,
        dest_perm,
        dest_pad,
        chunk_size,
        min_chunk_size,
        via_chunks,
    ) = case
    numel = math.prod(shape)
    isz = torch.empty((), dtype=dtype).element_size()
    flat = random_tensor((pre + numel,), dtype, seed=numel + pre)
    saved = flat[pre:].view(phys).permute(inv) if shape else flat[pre:].view(())
    assert tuple(saved.shape) == shape
    data = fake_file(flat)
    # a destination that is a permuted view into a padded buffer (often non-contiguous)
    dshape = [lengths[i] for i in dest_perm]
    buf = torch.zeros([n + dest_pad for n in dshape], dtype=dtype)
    region = box_of(buf, [0] * len(dshape), dshape)
    inv_dest = [dest_perm.index(i) for i in range(len(dest_perm))]
    dest = region.permute(inv_dest) if shape else region
    assert tuple(dest.shape) == tuple(lengths)
    outside = buf.clone()
    pieces = plan(
        saved, offsets, lengths, dest, chunk_size=chunk_size, min_chunk_size=min_chunk_size
    )
    for p in pieces:
        assert p.nbytes <= max(chunk_size, isz), (p.nbytes, chunk_size)
        assert HEADER <= p.start < p.end <= HEADER + flat.numel() * isz
    if via_chunks:
        chunks = make_chunks(pieces, chunk_size=chunk_size, min_chunk_size=min_chunk_size)
        for c in chunks:
            assert c.nbytes <= max(chunk_size, isz)
        run_chunks(chunks, data)
    else:
        run_pieces(pieces, data)
    want = box_of(saved, offsets, lengths)
    assert_bitwise_equal(dest.contiguous(), want.contiguous())
    # nothing outside the destination view was written
    mask = torch.ones(buf.shape, dtype=torch.bool)
    box_of(mask, [0] * len(dshape), dshape).fill_(False)
    assert_bitwise_equal(buf[mask], outside[mask])


@pytest.mark.parametrize(
    "dtype", [torch.complex128, torch.complex64, torch.float64, torch.int64, torch.bfloat16]
)
@pytest.mark.parametrize("misalign", [1, 3, 8])
def test_staged_copy_from_a_misaligned_buffer_is_bit_exact(
    dtype: torch.dtype, misalign: int
) -> None:
    """A staged piece's bytes can sit at any offset of a read buffer; torch's copy kernels
    need element-aligned sources (a misaligned complex128 source crashed the process: found
    by the property test above with --hypothesis-seed=11307)."""
    saved = random_tensor((1, 7, 4), dtype, seed=misalign)
    # the box that crashed: rows narrower than their stride, into a padded strided view
    dest = torch.zeros(80, dtype=dtype).as_strided((1, 2, 3), (20, 5, 1), 0)
    pieces = plan(saved, [0, 0, 0], [1, 2, 3], dest, chunk_size=1 << 20, min_chunk_size=1 << 20)
    raw = saved.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert pieces and all(p.deliver is not None and p.into is None for p in pieces)  # staged
    for p in pieces:
        part = raw[p.start - HEADER : p.end - HEADER]
        buf = bytes(misalign) + part  # the piece's bytes at a misaligned address
        p.deliver(memoryview(buf)[misalign:])  # type: ignore[misc]
    assert_bitwise_equal(dest, saved[:, :2, :3])


# --- the whole-tensor fast path --------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (3, 5), (1, 9), (9, 1), (2, 1, 3), (40, 33), ()])
@pytest.mark.parametrize("chunk", [16, 1000, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.float64])
def test_a_whole_contiguous_tensor_is_read_straight_into_its_destination_in_chunk_size_runs(
    shape, chunk, dtype
):
    """The common case (a whole saved tensor, row-major, into a contiguous CPU destination of
    its dtype) skips the box walk: one direct run of the storage, cut at ``chunk_size``, each
    into the destination's own memory at the same offset; bit for bit."""
    saved = random_tensor(shape, dtype, 3)
    off = 2 if saved.numel() else 0  # a storage offset: the tensor starts 2 elements in
    storage = torch.cat([random_tensor((off,), dtype, 4), saved.reshape(-1)])
    view = storage[off:].view(shape)
    loc = location(view)
    dest = torch.zeros(shape, dtype=dtype)
    pieces = plan_tensor(
        loc, [0] * len(shape), list(shape), dest, chunk_size=chunk, min_chunk_size=8
    )
    nbytes = saved.numel() * saved.element_size()
    start = HEADER + off * saved.element_size()
    want = [(start + lo, start + min(nbytes, lo + chunk)) for lo in range(0, nbytes, chunk)]
    assert [(p.start, p.end) for p in pieces] == want
    assert all(p.into is not None and p.deliver is None for p in pieces)
    base = dest.data_ptr()
    assert [ctypes.addressof(ctypes.c_char.from_buffer(p.into)) - base for p in pieces] == [
        lo - start for lo, _ in want
    ]
    run_pieces(pieces, fake_file(view))
    assert_bitwise_equal(dest, saved)
