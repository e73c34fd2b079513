"""A remote DCP load reads a record by one request once another record's headers are known
(issue 30: DCP lost to ``curl --parallel`` by a round of header probes per record).

torch.save writes the same headers before every tensor, so the engine probes the first large
record only and reads each later one whole by a guess of where its tensor starts (headers
into scratch, the tensor into its destination, the tail into scratch), then checks the
guess against the record's parsed headers. A wrong guess is never handed over: moved into
place in memory where only the tensor's start differs, read again where the headers say
otherwise; damaged headers are the typed error a probed record gives; the
first record's headers are waited for a bounded time only (a stall there is hedged:
``test_hedge_floor.py``). The requests come from the fault proxy's log in front of moto
(S3) and the HTTP range server; bytes are compared bit for bit; nothing is timed.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _remote import make_remote

import asyncload
from asyncload import CheckpointFormatError, LoadOptions
from asyncload.engine import streamed

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _wait_for_the_first_headers(monkeypatch):
    """The first record's headers waited for however long they take (a loaded machine may
    answer after the engine's bound, and then probes more records: right, but not what the
    request counts below pin)."""
    monkeypatch.setattr(streamed, "guess_wait", lambda storage: 60.0)


#: large records (2 MiB: probed or guessed, not read whole as small ones are)
ROWS = 512


def _save(path: Path, sd: dict[str, torch.Tensor]) -> None:
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True)
    dcp.save(sd, storage_writer=writer, no_dist=True)


def _records(path: Path) -> dict[str, tuple[int, int]]:
    """Each key's record in the one data file: ``(offset, end)``."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return {
        idx.fqn: (info.offset, info.offset + info.length) for idx, info in md.storage_data.items()
    }


def _ranges(log) -> list[tuple[int, int]]:
    """The byte ranges asked of the data file, half-open (an HTTP server's listing is
    asked for its size: no range)."""
    out = []
    for e in log:
        if e.path.endswith(".distcp") and e.range is not None:
            lo, hi = e.range.split("=", 1)[1].split("-")
            out.append((int(lo), int(hi) + 1))
    return out


def _within(ranges: list[tuple[int, int]], rec: tuple[int, int]) -> list[tuple[int, int]]:
    return [r for r in ranges if rec[0] <= r[0] and r[1] <= rec[1]]


def _touching(ranges: list[tuple[int, int]], rec: tuple[int, int]) -> list[tuple[int, int]]:
    return [r for r in ranges if r[0] < rec[1] and rec[0] < r[1]]


def _load(r, sd, **opts):
    dest = {k: torch.full(v.shape, 7, dtype=v.dtype) for k, v in sd.items()}
    stats = asyncload.load(
        dest,
        r.url,
        options=LoadOptions(transport="wire", **opts),
        storage_options=r.storage_options,
    )
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    return stats


def _state(n: int, seed: int = 30) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        out[f"w{i}"] = torch.randn((ROWS, 1024), generator=g)  # 2 MiB
        out[f"n{i}"] = torch.randn((64,), generator=g)  # small: read whole
    return out


@pytest.mark.parametrize("backend", ["s3", "http"])
def test_after_the_first_record_each_is_one_request(
    request, backend, tmp_path, bucket_name, fault_proxy
):
    sd = _state(6)
    _save(tmp_path / "ckpt", sd)
    recs = _records(tmp_path / "ckpt")
    r = make_remote(request, backend, tmp_path / "ckpt", bucket_name, fault_proxy)
    stats = _load(r, sd)
    ranges = _ranges(r.proxy.log)
    first, *later = sorted((recs[f"w{i}"] for i in range(6)), key=lambda x: x[0])
    ends = dict(recs.values())
    # the first large record, read at once by the header length this process's torch.save
    # writes: its first and last requests are its head and tail probes' ranges (its
    # headers, for the later guesses; the small record after it joins the last), the rest
    # between them; no byte read twice
    head = (first[0], first[0] + 4096)
    body = (first[0] + 4096, first[1] - 4096)
    tail = (first[1] - 4096, ends[first[1]])
    assert sorted(_touching(ranges, first)) == [head, body, tail], _touching(ranges, first)
    for rec in later:
        # each later one: one request for the whole record and the small record right
        # after it (read whole, as small records are), nothing else touches either
        small = (rec[1], ends[rec[1]])
        assert small[1] - small[0] < 4096, small
        assert _touching(ranges, rec) == [(rec[0], small[1])], (rec, _touching(ranges, rec))
    assert stats.bytes_assembled == sum(v.numel() * v.element_size() for v in sd.values())


def test_a_wrong_guess_is_moved_into_place_or_read_again_where_the_headers_say(
    request, tmp_path, bucket_name, fault_proxy
):
    g = torch.Generator().manual_seed(31)
    sd = {
        "a": torch.randn((ROWS, 1024), generator=g),
        # 60 leading dims of 1: a longer pickle, so the tensor starts later in its record
        "b": torch.randn((1,) * 60 + (ROWS * 1024,), generator=g),
        # saved transposed: where the guess starts right but the strides differ
        "c": torch.randn((1024, ROWS), generator=g).t(),
        "d": torch.randn((ROWS, 1024), generator=g),
    }
    _save(tmp_path / "ckpt", sd)
    recs = _records(tmp_path / "ckpt")
    r = make_remote(request, "s3", tmp_path / "ckpt", bucket_name, fault_proxy)
    stats = _load(r, sd)
    ranges = _ranges(r.proxy.log)
    # b's tensor starts later than guessed: every byte of it landed (in the destination
    # and the tail's scratch) and is moved into place, nothing read again
    assert _touching(ranges, recs["b"]) == [recs["b"]], _touching(ranges, recs["b"])
    # c's strides differ: the guessed read, then its tensor again where its headers say
    got = _within(ranges, recs["c"])
    assert len(got) == 2 and got[0] == recs["c"], got
    assert _touching(ranges, recs["d"]) == [recs["d"]]
    # the guessed bytes of b and c were not counted: only what the load handed over
    assert stats.bytes_assembled == sum(v.numel() * v.element_size() for v in sd.values())


def test_damaged_headers_of_a_guessed_record_are_a_format_error(
    request, tmp_path, bucket_name, fault_proxy
):
    sd = _state(3)
    _save(tmp_path / "ckpt", sd)
    recs = _records(tmp_path / "ckpt")
    second = sorted(recs[f"w{i}"] for i in range(3))[1]
    data = next((tmp_path / "ckpt").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[second[0] : second[0] + 4] = b"XXXX"  # the zip local header's signature
    data.write_bytes(bytes(raw))
    r = make_remote(request, "s3", tmp_path / "ckpt", bucket_name, fault_proxy)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(CheckpointFormatError) as info:
        asyncload.load(
            dest,
            r.url,
            options=LoadOptions(transport="wire"),
            storage_options=r.storage_options,
        )
    msg = str(info.value)
    assert data.name in msg and f"[{second[0]}, {second[1]})" in msg, msg
    # it was read by a guess (one request), not probed
    assert [r[0] for r in _touching(_ranges(r.proxy.log), second)] == [second[0]]


def test_verify_probes_every_record(request, tmp_path, bucket_name, fault_proxy):
    sd = _state(3)
    _save(tmp_path / "ckpt", sd)
    recs = _records(tmp_path / "ckpt")
    r = make_remote(request, "s3", tmp_path / "ckpt", bucket_name, fault_proxy)
    stats = _load(r, sd, verify=True)
    ranges = _ranges(r.proxy.log)
    for i in range(3):
        assert len(_within(ranges, recs[f"w{i}"])) == 3
    assert stats.verified_records >= 3


def test_a_checkpoint_whose_headers_differ_is_moved_into_place_not_read_again(
    request, tmp_path, bucket_name, fault_proxy, monkeypatch
):
    # another torch wrote headers 64 bytes shorter than this process's torch.save does (the
    # prior): the records read by that prior before the first record's headers were parsed
    # land 64 bytes off and are moved into place in memory; every later one is guessed by
    # the first record's parsed headers, one request each; no byte is read twice
    monkeypatch.setattr(streamed, "own_head_len", lambda: 704 + 64)
    moves: list[tuple[int, int, int]] = []
    real_shift = streamed._shift

    def shift(segments, guessed, true, n):
        moves.append((guessed, true, n))
        real_shift(segments, guessed, true, n)

    monkeypatch.setattr(streamed, "_shift", shift)
    sd = _state(8)
    _save(tmp_path / "ckpt", sd)
    recs = _records(tmp_path / "ckpt")
    r = make_remote(request, "s3", tmp_path / "ckpt", bucket_name, fault_proxy)
    stats = _load(r, sd)
    ranges = _ranges(r.proxy.log)
    large = sorted((recs[f"w{i}"] for i in range(8)), key=lambda x: x[0])
    ordered = sorted(ranges)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered)), ordered
    # the first record at least went out by the prior: moved 64 bytes down
    assert moves and all(true == guessed - 64 for guessed, true, _ in moves), moves
    assert large[0][0] + 704 + 64 in {guessed for guessed, _, _ in moves}, (moves, large[0])
    assert stats.bytes_assembled == sum(v.numel() * v.element_size() for v in sd.values())


@pytest.mark.parametrize(("off", "window"), [(37, 4096 + 5), (-37, 16)])
def test_a_tensor_moved_into_place_is_bit_for_bit_whichever_way_and_window(
    request, tmp_path, bucket_name, fault_proxy, monkeypatch, off, window
):
    # the prior is off by a few bytes either way (the tensor starts earlier or later than
    # guessed), and the move goes a window at a time (windows larger than the shift and
    # smaller): bit for bit, nothing read twice
    monkeypatch.setattr(streamed, "own_head_len", lambda: 704 + off)
    monkeypatch.setattr(streamed, "SHIFT_WINDOW", window)
    sd = _state(3)
    _save(tmp_path / "ckpt", sd)
    r = make_remote(request, "s3", tmp_path / "ckpt", bucket_name, fault_proxy)
    stats = _load(r, sd)
    ordered = sorted(_ranges(r.proxy.log))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered)), ordered
    assert stats.bytes_assembled == sum(v.numel() * v.element_size() for v in sd.values())


@pytest.mark.parametrize("wrong_prior", [False, True])
def test_more_records_than_read_slots_are_read_by_fewer_larger_requests(
    request, tmp_path, bucket_name, fault_proxy, monkeypatch, wrong_prior
):
    # 12 records of 2 MiB and 2 read slots: one request per record would queue for a slot
    # 12 times (a round trip late each), so neighbouring guessed records share requests of
    # the records' bytes over the slots (at most chunk_size), cut anywhere; the first
    # record's head and tail requests (its probes' ranges) stay its own. Bit for bit, no
    # byte of a record read twice; with a wrong prior (another torch's headers) the records
    # read by it are moved into place in memory
    if wrong_prior:
        monkeypatch.setattr(streamed, "own_head_len", lambda: 704 + 64)
    sd = _state(12)
    _save(tmp_path / "ckpt", sd)
    recs = _records(tmp_path / "ckpt")
    r = make_remote(request, "s3", tmp_path / "ckpt", bucket_name, fault_proxy)
    stats = _load(r, sd, concurrency=2)
    ranges = _ranges(r.proxy.log)
    large = sorted((recs[f"w{i}"] for i in range(12)), key=lambda x: x[0])
    first = large[0]
    head = (first[0], first[0] + 4096)
    assert head in ranges, ranges
    # a request spanning two records or more: fewer requests than records after the first
    # few speculated ones
    spanning = [
        x for x in ranges if sum(1 for rec in large if x[0] < rec[1] and rec[0] < x[1]) > 1
    ]
    assert spanning, ranges
    later = large[1:]
    assert len(_touching(ranges, (later[0][0], later[-1][1]))) < len(later), ranges
    # nothing read twice, whatever the prior: the requests are disjoint
    ordered = sorted(ranges)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered)), ordered
    assert stats.bytes_assembled == sum(v.numel() * v.element_size() for v in sd.values())


def test_join_limit():
    rec = streamed.Record.__new__(streamed.Record)  # only its length is asked
    object.__setattr__(rec, "length", 8 << 20)
    # as many records as slots, or fewer: one request each, none joined
    assert streamed.join_limit([rec] * 16, 16 << 20, 16) == 0
    # more: their bytes over the slots, at most chunk_size
    assert streamed.join_limit([rec] * 32, 16 << 20, 16) == 16 << 20
    assert streamed.join_limit([rec] * 32, 64 << 20, 16) == 16 << 20
    assert streamed.join_limit([rec] * 20, 64 << 20, 16) == 10 << 20
    assert streamed.join_limit([rec] * 32, 4 << 20, 16) == 4 << 20
