"""``.metadata`` read once for a multi-rank load (``LoadOptions.share_metadata``;
:mod:`asyncload.engine.metadata_read`): the group's rank 0 reads it, the other ranks decode
the bytes it broadcasts.

Every rank reaches the store through a fault proxy of its own, so each proxy's log holds
exactly the requests of one rank: which rank asked for ``.metadata`` is read from the logs,
never from the library's own counters. Every rank checks what it loaded bit for bit.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import RankResult, run_ranks
from test_distributed import big_model, same_bits

import asyncload
from asyncload import LoadOptions, ShardedLoadPlanner

pytestmark = [pytest.mark.timeout(180), pytest.mark.distributed]

WORLD = 3
OPTIONS = LoadOptions(chunk_size=256 << 10, min_chunk_size=64 << 10)


def w_load(
    rank: int, world: int, urls: list[str], options: list[dict[str, Any]], how: dict[str, Any]
) -> dict[str, Any]:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    planner = ShardedLoadPlanner() if how.get("sharded") else None
    stats = asyncload.load(
        sd,
        urls[rank],
        storage_options=options[rank],
        options=OPTIONS.replace(share_metadata=how.get("share", "auto")),
        planner=planner,
    )
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "shared": stats.metadata_shared,
        "read": stats.bytes_read,
    }


def _metadata_gets(proxy: Any) -> int:
    return sum(1 for e in proxy.log if e.method == "GET" and e.path.endswith("/.metadata"))


def _listings(proxy: Any) -> int:
    """Listing requests (S3 ListObjectsV2, GCS objects.list: both ask by ``prefix=``)."""
    return sum(1 for e in proxy.log if e.method == "GET" and "prefix=" in e.query)


def _data_gets_of(proxy: Any, name: str) -> int:
    return sum(1 for e in proxy.log if e.method == "GET" and e.path.endswith("/" + name))


def _data_gets(proxy: Any) -> int:
    return sum(1 for e in proxy.log if e.method == "GET" and e.path.endswith(".distcp"))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=str(tmp_path / "ck"))
    return tmp_path / "ck"


def _per_rank(
    request: Any, backend: str, saved: Path, fault_proxy: Any
) -> tuple[list, list, list]:
    """One proxy per rank in front of ``backend``'s server holding ``saved``: each rank's
    URL and storage options (S3 and GCS: one URL, the endpoint per rank)."""
    server = request.getfixturevalue(f"{backend}_server")
    url = server.upload_dir(saved, f"shmd-{uuid.uuid4().hex[:12]}", "ckpt")
    proxies = [fault_proxy(server) for _ in range(WORLD)]
    options = [server.storage_options(endpoint_url=p.endpoint_url) for p in proxies]
    return proxies, [url] * WORLD, options


def _all_bit_exact(results: list[RankResult]) -> list[dict[str, Any]]:
    for r in results:
        assert r.ok, (r.rank, r.error_type, r.message, r.traceback)
    values = [r.value for r in results]
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
    return values


@pytest.mark.parametrize("backend", ["s3", "gcs"])
@pytest.mark.parametrize("sharded", [False, True], ids=["pipelined", "sharded"])
def test_metadata_is_read_by_rank_0_alone(
    request: Any, backend: str, sharded: bool, saved: Path, fault_proxy: Any
) -> None:
    """One GET of ``.metadata`` and one listing of the data files for the whole group, in
    rank 0's proxy log; every other rank took both from rank 0 (``metadata_shared``), read
    its data through its own proxy, and loaded bit for bit."""
    proxies, urls, options = _per_rank(request, backend, saved, fault_proxy)
    how = {"sharded": sharded}
    values = _all_bit_exact(run_ranks(w_load, WORLD, urls, options, how, timeout=150))
    assert [_metadata_gets(p) for p in proxies] == [1, 0, 0]
    assert [_listings(p) for p in proxies] == [1, 0, 0]
    assert [v["shared"] for v in values] == [False, True, True]
    if not sharded:  # every rank reads its own data (shared: rank 0 may read it all)
        assert all(_data_gets(p) > 0 for p in proxies), [_data_gets(p) for p in proxies]


def test_a_listing_rank_0_could_not_make_is_made_by_every_rank(
    request: Any, saved: Path, fault_proxy: Any
) -> None:
    """Rank 0 may not list the bucket (403 on its listings): its message carries
    ``.metadata`` without a listing, and every other rank lists for itself; all bit for
    bit, one ``.metadata`` GET."""
    from asyncload.testing import status

    proxies, urls, options = _per_rank(request, "s3", saved, fault_proxy)
    rule = proxies[0].add_rule(status(403), path="prefix=", times=None)
    values = _all_bit_exact(run_ranks(w_load, WORLD, urls, options, {}, timeout=150))
    assert rule.fired >= 1
    assert [_metadata_gets(p) for p in proxies] == [1, 0, 0]
    assert [_listings(p) for p in proxies][1:] == [1, 1]
    assert [v["shared"] for v in values] == [False, True, True]


def test_without_sharing_every_rank_reads_its_own(
    request: Any, saved: Path, fault_proxy: Any
) -> None:
    """``share_metadata=False``: one GET per rank, as torch's ``dcp.load`` makes (the logs
    tell the two apart)."""
    proxies, urls, options = _per_rank(request, "s3", saved, fault_proxy)
    how = {"share": False}
    values = _all_bit_exact(run_ranks(w_load, WORLD, urls, options, how, timeout=150))
    assert [_metadata_gets(p) for p in proxies] == [1, 1, 1]
    assert [_listings(p) for p in proxies] == [1, 1, 1]
    assert [v["shared"] for v in values] == [False, False, False]


def test_a_rank_with_another_url_reads_its_own(saved: Path, fault_proxy: Any) -> None:
    """HTTP URLs name their host: each rank reaches the server through its own proxy, so
    no rank's URL is rank 0's and every rank reads its own ``.metadata`` (after rank 0's
    message said where it read it)."""
    from asyncload.testing import HTTPRangeServer

    server = HTTPRangeServer(root=saved.parent).start()
    try:
        proxies = [fault_proxy(server) for _ in range(WORLD)]
        urls = [server.url("ck", endpoint_url=p.endpoint_url) for p in proxies]
        options: list[dict[str, Any]] = [{} for _ in range(WORLD)]
        values = _all_bit_exact(run_ranks(w_load, WORLD, urls, options, {}, timeout=150))
    finally:
        server.stop()
    assert [_metadata_gets(p) for p in proxies] == [1, 1, 1]
    assert [v["shared"] for v in values] == [False, False, False]


def test_one_url_over_http_is_read_once(saved: Path, fault_proxy: Any) -> None:
    """Every rank through one proxy, one URL: one ``.metadata`` GET in all."""
    from asyncload.testing import HTTPRangeServer

    server = HTTPRangeServer(root=saved.parent).start()
    try:
        proxy = fault_proxy(server)
        urls = [server.url("ck", endpoint_url=proxy.endpoint_url)] * WORLD
        options: list[dict[str, Any]] = [{} for _ in range(WORLD)]
        values = _all_bit_exact(run_ranks(w_load, WORLD, urls, options, {}, timeout=150))
    finally:
        server.stop()
    assert _metadata_gets(proxy) == 1
    assert [v["shared"] for v in values] == [False, True, True]


def test_rank_0_failing_its_read_fails_every_rank_with_a_typed_error(
    request: Any, saved: Path, fault_proxy: Any
) -> None:
    """Rank 0's proxy answers every ``.metadata`` request with 403: rank 0 raises its typed
    error naming the file after sending "read it yourselves", and every other rank, which
    then read its own copy, is ended by rank 0's failure with ``DistributedLoadError``
    naming rank 0 (or by the failure itself, when it comes first): no rank hangs, none
    returns."""
    from asyncload.testing import status

    proxies, urls, options = _per_rank(request, "s3", saved, fault_proxy)
    proxies[0].add_rule(status(403), path="/.metadata", times=None)
    results = run_ranks(w_load, WORLD, urls, options, {}, timeout=150)
    assert [r.status for r in results] == ["error"] * WORLD, [r.message for r in results]
    assert "AsyncLoadError" in results[0].error_types, results[0].error_types
    assert ".metadata" in results[0].message and "403" in results[0].message, results[0].message
    for r in results[1:]:
        assert r.error_type == "DistributedLoadError", (r.rank, r.message)
        assert r.attrs.get("rank") == 0, (r.rank, r.attrs, r.message)
    # each reads its own copy, unless rank 0's failure reached it first
    assert all(_metadata_gets(p) <= 1 for p in proxies[1:]), [_metadata_gets(p) for p in proxies]


def w_local(
    rank: int, world: int, path: str, rank_local: bool, share: bool | str = True
) -> dict[str, Any]:
    import torch.distributed as dist

    full = big_model()
    if rank_local:  # dcp.save(..., use_collectives=False): __0.metadata, __1.metadata...
        full = {k: v + rank for k, v in full.items()}
        dcp.save(
            {k: v.clone() for k, v in full.items()}, checkpoint_id=path, use_collectives=False
        )
        dist.barrier()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    stats = asyncload.load(sd, path, options=OPTIONS.replace(share_metadata=share))
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "shared": stats.metadata_shared,
    }


def test_a_local_checkpoint_is_shared_when_asked(saved: Path) -> None:
    """``share_metadata=True`` on a local directory (a shared file system): rank 0 reads,
    every other rank decodes its bytes."""
    values = _all_bit_exact(run_ranks(w_local, WORLD, str(saved), False, timeout=120))
    assert [v["shared"] for v in values] == [False, True, True]


def test_a_local_checkpoint_is_read_by_every_rank_by_default(saved: Path) -> None:
    """``"auto"`` leaves a local directory to each rank (a node-local copy may differ)."""
    values = _all_bit_exact(run_ranks(w_local, WORLD, str(saved), False, "auto", timeout=120))
    assert [v["shared"] for v in values] == [False, False, False]


def w_aload(rank: int, world: int, url: str, options: list[dict[str, Any]]) -> dict[str, Any]:
    import asyncio

    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    stats = asyncio.run(asyncload.aload(sd, url, storage_options=options[rank], options=OPTIONS))
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "shared": stats.metadata_shared,
    }


def test_aload_reads_it_once_too(request: Any, saved: Path, fault_proxy: Any) -> None:
    """The async face runs the same steps on the caller's loop: one GET, bit for bit."""
    proxies, urls, options = _per_rank(request, "s3", saved, fault_proxy)
    values = _all_bit_exact(run_ranks(w_aload, WORLD, urls[0], options, timeout=150))
    assert [_metadata_gets(p) for p in proxies] == [1, 0, 0]
    assert [v["shared"] for v in values] == [False, True, True]


def w_mixed(
    rank: int, world: int, urls: list[str], options: list[dict[str, Any]], shares: list[Any]
) -> dict[str, Any]:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    stats = asyncload.load(
        sd,
        urls[rank],
        storage_options=options[rank],
        options=OPTIONS.replace(share_metadata=shares[rank], collective_timeout=60),
    )
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "shared": stats.metadata_shared,
    }


@pytest.mark.parametrize(
    "case", ["rank0-remote", "rank0-local", "options-differ"], ids=lambda c: c
)
def test_ranks_that_decide_differently_all_load(
    request: Any, saved: Path, fault_proxy: Any, case: str
) -> None:
    """Whether a rank wants rank 0's bytes is its own choice (its URL, its options); every
    rank takes part in the exchange all the same, so ranks that decide differently never
    wait at different barriers (they did: a hang, until this test). Rank 0 on S3 and the
    others on a local copy (``"auto"``: only rank 0 would share); rank 0 local and the
    others on S3 (rank 0 says "read it yourselves" at once); all on S3, rank 0 with ``True``
    and the others ``False``. All bit for bit."""
    proxies, urls, options = _per_rank(request, "s3", saved, fault_proxy)
    shares: list[Any] = ["auto"] * WORLD
    if case == "rank0-remote":
        urls = [urls[0]] + [str(saved)] * (WORLD - 1)
        options = [options[0]] + [{}] * (WORLD - 1)
        want = {"gets": [1, 0, 0], "shared": [False, False, False]}
    elif case == "rank0-local":
        urls = [str(saved), *urls[1:]]
        options = [{}, *options[1:]]
        want = {"gets": [0, 1, 1], "shared": [False, False, False]}
    else:
        shares = [True] + [False] * (WORLD - 1)
        want = {"gets": [1, 1, 1], "shared": [False, False, False]}
    values = _all_bit_exact(run_ranks(w_mixed, WORLD, urls, options, shares, timeout=150))
    assert [_metadata_gets(p) for p in proxies] == want["gets"]
    assert [v["shared"] for v in values] == want["shared"]


@pytest.mark.parametrize("share", [True, "auto"])
def test_a_safetensors_file_is_read_by_every_rank(
    request: Any, tmp_path: Path, fault_proxy: Any, share: bool | str
) -> None:
    """No ``.metadata`` to share: with ``True`` rank 0 finds a safetensors file and says
    "read it yourselves", and every rank probes the file itself; ``"auto"`` leaves a URL
    that names a file to each rank from the start. Bit for bit either way."""
    from safetensors.torch import save_file

    (tmp_path / "st").mkdir()
    save_file(
        {k: v.contiguous() for k, v in big_model().items()}, tmp_path / "st" / "m.safetensors"
    )
    server = request.getfixturevalue("s3_server")
    url = server.upload_dir(tmp_path / "st", f"shmd-{uuid.uuid4().hex[:12]}", "st")
    proxies = [fault_proxy(server) for _ in range(WORLD)]
    options = [server.storage_options(endpoint_url=p.endpoint_url) for p in proxies]
    urls = [f"{url}/m.safetensors"] * WORLD
    how = {"share": share}
    values = _all_bit_exact(run_ranks(w_load, WORLD, urls, options, how, timeout=150))
    assert [v["shared"] for v in values] == [False, False, False]
    assert [_metadata_gets(p) for p in proxies] == [0, 0, 0]
    assert all(_data_gets_of(p, "m.safetensors") > 0 for p in proxies)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_share_metadata_takes_true_false_or_auto(bad: Any) -> None:
    with pytest.raises(ValueError, match="share_metadata"):
        LoadOptions(share_metadata=bad)


def test_rank_local_metadata_is_never_shared(tmp_path: Path) -> None:
    """No global ``.metadata``: rank 0 reads its own ``__0.metadata`` and says so; every
    rank reads its own ``__r.metadata`` and loads its own values, bit for bit."""
    path = tmp_path / "ck"
    values = _all_bit_exact(run_ranks(w_local, WORLD, str(path), True, timeout=120))
    assert [v["shared"] for v in values] == [False, False, False]
    names = sorted(p.name for p in path.iterdir())
    assert ".metadata" not in names and "__2.metadata" in names
