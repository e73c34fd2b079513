"""Adaptive claims of node-aware sharing as work stealing
(:mod:`asyncload.distributed.node_claims`): a node claims its own planned blocks as it
reads them and takes over other nodes' blocks, from the back, only once its own are claimed;
a slow node's share shrinks.

Multi-rank tests run 4 gloo processes as 2 simulated nodes of 2 (distinct ``node_id``s on
one host); each rank reaches an HTTP range server through its own fault proxy. Every rank
checks what it loaded bit for bit; byte counters are asserted as bounds, never timings.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from test_distributed import big_model, same_bits, tensor_bytes
from test_nodes import FIELDS, OPTIONS, _left_in_shm

import asyncload
from asyncload import ShardedLoadPlanner

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

KiB = 1 << 10


def w_urls(rank: int, world: int, urls: list[str], adaptive: bool) -> Any:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    planner = ShardedLoadPlanner(
        node_id=f"node{rank // 2}",
        sharing="always",
        adaptive=adaptive,
        wait_for_peers=True,
        unit_size=16 * KiB,  # blocks of 64 KiB: 32 of them, 16 planned for each node
    )
    # the phase within one ring (a budget of 8 MiB): a node can take over any block
    options = OPTIONS.replace(memory_budget=8 << 20)
    stats = asyncload.load(sd, urls[rank], options=options, planner=planner)
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "stats": {f: getattr(stats, f) for f in FIELDS},
    }


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[Any, list[Any]]]:
    """One HTTP range server with the checkpoint; each of 4 ranks reaches it through its
    own fault proxy."""
    from asyncload.testing import FaultProxy, HTTPRangeServer

    dcp.save(
        {k: v.clone() for k, v in big_model().items()},
        checkpoint_id=str(tmp_path / "ck"),
        no_dist=True,
    )
    server = HTTPRangeServer(root=tmp_path).start()
    proxies = [FaultProxy(server).start() for _ in range(4)]
    try:
        yield server, proxies
    finally:
        for p in proxies:
            p.stop()
        server.stop()


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "static"])
def test_a_slow_node_reads_less_from_storage(proxied: Any, adaptive: bool) -> None:
    """Node 1's ranks wait 0.3 s for every data request. Adaptive: node 0 claims its own
    blocks, then takes over node 1's from the back, so node 1 reads well under the half the
    plan gave it (static: the planned half); either way every block is read from storage
    once, each node takes in the checkpoint once, and every rank loads it bit for bit."""
    from asyncload.testing import delay

    server, proxies = proxied
    for p in proxies[2:]:
        p.add_rule(delay(0.3), data_only=True, times=None)
    urls = [server.url("ck", endpoint_url=p.endpoint_url) for p in proxies]
    before = _left_in_shm()
    total = tensor_bytes(big_model())
    values = all_ok(run_ranks(w_urls, 4, urls, adaptive, timeout=100))
    stats = [v["stats"] for v in values]
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
        assert v["stats"]["bytes_assembled"] == total
    read = [stats[0]["bytes_read"] + stats[1]["bytes_read"]]
    read.append(stats[2]["bytes_read"] + stats[3]["bytes_read"])
    assert total <= sum(read) <= 1.05 * total, read
    if adaptive:
        assert read[1] < 0.3 * total, read  # the plan gave it half
        taken = [stats[0]["bytes_taken_over"] + stats[1]["bytes_taken_over"]]
        taken.append(stats[2]["bytes_taken_over"] + stats[3]["bytes_taken_over"])
        assert taken[0] > 0.2 * total and taken[1] < 0.05 * total, taken
    else:
        assert 0.45 * total <= read[1] <= 0.55 * total, read
    for node in (0, 1):
        mine = stats[2 * node : 2 * node + 2]
        intake = sum(s["bytes_read"] + s["bytes_from_other_nodes"] for s in mine)
        assert total <= intake <= 1.05 * total, (node, intake)
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
    assert _left_in_shm() <= before


def test_a_look_at_a_claim_never_writes() -> None:
    """What the claims rely on, against a real TCPStore: ``compare_set(key, "?", "?")``
    returns ``"?"`` for a key not set, and sets nothing; once a claim set the key, it returns
    the claimant, and a later claim returns the first claimant."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    s = dist.PrefixStore("nb/0/", store)
    assert s.compare_set("7", "?", "?") == b"?"
    assert not s.check(["7"])
    assert s.compare_set("7", "", "3") == b"3"
    assert s.compare_set("7", "?", "?") == b"3"
    assert s.compare_set("7", "", "1") == b"3"
