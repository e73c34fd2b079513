"""Issue 30, items 1 and 3 on the wire transport (S3 on moto, behind the fault proxy, whose
request log is what the tests count): the first data request of a DCP load leaves after the
listing and the ``.metadata`` GET only (no HEAD, no second metadata request, no size asked
file by file), ``LoadStats.time_to_first_byte`` is filled; neighbouring records of one file
whose tensors fit one chunk are read by one request straight into their destinations, the
bytes between them dropped; where the over-read bound or ``verify`` forbids it, one request
per record. Bytes compared bit for bit; requests counted, never timed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _remote import make_remote

import asyncload
from asyncload import LoadOptions

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
#: four 2 MiB tensors, each followed by a small one (DCP one file: eight records)
N = 4


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(30)
    out = {}
    for i in range(N):
        out[f"w{i}"] = torch.randn((512, 1024), generator=g)  # 2 MiB
        out[f"n{i}"] = torch.randn((256,), generator=g)
    return out


@pytest.fixture
def one_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = _state()
    d = tmp_path / "ckpt"
    dcp.save(
        sd, storage_writer=dcp.FileSystemWriter(str(d), single_file_per_rank=True), no_dist=True
    )
    return d, sd


def _load(r, sd, **opts):
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    stats = asyncload.load(
        dest,
        r.url,
        options=LoadOptions(transport="wire", **opts),
        storage_options=r.storage_options,
    )
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    return stats


def _span(rng: str | None) -> int:
    lo, _, hi = (rng or "").removeprefix("bytes=").partition("-")
    return int(hi) - int(lo) + 1 if lo.isdigit() and hi.isdigit() else 0


def test_first_data_request_follows_the_listing_and_metadata_only(
    request, one_file, bucket_name, fault_proxy
):
    path, sd = one_file
    r = make_remote(request, "s3", path, bucket_name, fault_proxy)
    stats = _load(r, sd)
    log = r.proxy.log
    first = next(i for i, e in enumerate(log) if e.path.endswith(".distcp"))
    before = log[:first]
    # the listing (sizes and versions of every file) and one GET of .metadata: nothing else
    assert len(before) <= 3, before
    assert [e.method for e in before] == ["GET"] * len(before), before
    assert sum(e.path.endswith("/.metadata") for e in before) == 1, before
    assert not any(e.method == "HEAD" for e in log), log
    assert stats.time_to_first_byte > 0


def test_neighbouring_records_are_read_by_one_request_each_pair(
    request, one_file, bucket_name, fault_proxy
):
    path, sd = one_file
    r = make_remote(request, "s3", path, bucket_name, fault_proxy)
    stats = _load(r, sd, chunk_size=4 * MiB)
    data = [e for e in r.proxy.log if e.path.endswith(".distcp") and _span(e.range) >= MiB]
    # two 2 MiB tensors per request (the small record and zip headers between them dropped;
    # a tensor's first and last bytes that the header probes brought are not asked again)
    assert len(data) == N // 2, data
    assert all(abs(_span(e.range) - 4 * MiB) < 64 * 1024 for e in data), data
    assert stats.bytes_assembled == sum(v.numel() * v.element_size() for v in sd.values())
    assert stats.bytes_read <= 1.15 * stats.bytes_assembled


@pytest.mark.parametrize(
    "opts",
    [
        {"chunk_size": 4 * MiB, "verify": True},  # each record's bytes checksummed on their own
        {"chunk_size": 4 * MiB, "max_over_read_ratio": 1.0},  # no byte to spare for a gap
        {"chunk_size": 2 * MiB},  # two tensors do not fit one chunk
    ],
    ids=["verify", "no-spare", "chunk-fits-one"],
)
def test_records_are_read_one_request_each_where_joining_is_not_allowed(
    request, one_file, bucket_name, fault_proxy, opts
):
    path, sd = one_file
    r = make_remote(request, "s3", path, bucket_name, fault_proxy)
    _load(r, sd, **opts)
    data = [e for e in r.proxy.log if e.path.endswith(".distcp") and _span(e.range) >= MiB]
    assert len(data) == N, data
    assert all(_span(e.range) <= 2 * MiB for e in data), data
