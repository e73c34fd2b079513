"""Issue 30, item 3 on the wire transport (S3 on moto, behind the fault proxy, whose request
log is what the tests count): the first request for a DCP load's data files leaves after the
listing and the ``.metadata`` GET only (no HEAD, no second metadata request, no size asked
file by file), for one file and for a file per item, and ``LoadStats.time_to_first_byte`` is
filled. Bytes compared bit for bit; requests counted, never timed.
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
#: four 2 MiB tensors, each followed by a small one (eight records)
N = 4


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(30)
    out = {}
    for i in range(N):
        out[f"w{i}"] = torch.randn((512, 1024), generator=g)  # 2 MiB
        out[f"n{i}"] = torch.randn((256,), generator=g)
    return out


@pytest.fixture(params=[True, False], ids=["one-file", "per-item"])
def saved(request, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = _state()
    d = tmp_path / "ckpt"
    writer = dcp.FileSystemWriter(str(d), single_file_per_rank=request.param)
    dcp.save(sd, storage_writer=writer, no_dist=True)
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


def test_first_data_request_follows_the_listing_and_metadata_only(
    request, saved, bucket_name, fault_proxy
):
    path, sd = saved
    r = make_remote(request, "s3", path, bucket_name, fault_proxy)
    stats = _load(r, sd)
    log = r.proxy.log
    first = next(i for i, e in enumerate(log) if e.path.endswith(".distcp"))
    before = log[:first]
    # the listing (sizes and versions of every file) and one GET of .metadata, sent side by
    # side: nothing else (the issue allows three round trips; these are two requests)
    assert len(before) == 2, before
    assert [e.method for e in before] == ["GET", "GET"], before
    assert sum("list-type=2" in e.query for e in before) == 1, before
    assert sum(e.path.endswith("/.metadata") for e in before) == 1, before
    assert not any(e.method == "HEAD" for e in log), log
    assert stats.time_to_first_byte > 0
    # and every data file is asked for by ranged GETs only: no HEAD, no unranged GET
    assert all(e.range for e in log if e.path.endswith(".distcp")), log
