"""Several hosts on one machine (``asyncload.testing.netns``): 2 nodes x 2 ranks, each node a
network namespace with its own capped link, ranks started per node by torchrun, the
checkpoint served over HTTP from a storage host. Runs where ``ip netns`` works (root,
iproute2); skipped elsewhere, with the reason.

Asserts bytes, never timings: every rank loads bit for bit, with both planners, on a
replicated and an FSDP-like sharded layout; with ``ShardedLoadPlanner`` (grouping ranks by
their host names) the replicated checkpoint is read from storage about once in total and
each node takes about half of it from the other node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncload.testing.netns import available, hosts

pytestmark = [pytest.mark.timeout(300), pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def netns() -> None:
    """Skip (with the reason) where network namespaces cannot be made."""
    why = available()
    if why is not None:
        pytest.skip(f"no network namespaces: {why}")


def test_hosts_are_made_and_removed(netns: None) -> None:
    """Two hosts and a storage host reach each other over the bridge; every namespace is
    gone after the context, also when the block raises."""
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with pytest.raises(RuntimeError), hosts(2, rate_mbit=100) as net:
        assert net.addr("n0") != net.addr("storage")
        ping = net.run(
            "n1",
            [sys.executable, "-c", _CONNECT, net.addr("n0")],
            capture_output=True,
            text=True,
        )
        # n0 listens nowhere: the connection is refused (reached), not unreachable
        assert "refused" in ping.stdout, ping.stdout + ping.stderr
        raise RuntimeError("leave the context by an error")
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before


_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=5)
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print("error", e)
"""


def test_two_nodes_of_two_ranks_bit_exact(netns: None, tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_multinode.py"),
            "--nodes",
            "2",
            "--per-node",
            "2",
            "--size-mib",
            "8",
            "--rounds",
            "1",
            "--rate-mbit",
            "800",
            "--check",
            "--json",
            str(out),
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["layout"], r["kind"]) for r in rows} == {
        (layout, kind) for layout in ("replicated", "sharded") for kind in ("sharded", "pipelined")
    }
    assert all(r["bad"] == 0 for r in rows)
    size = 8.0
    for r in rows:
        if r["kind"] == "sharded":
            assert size <= r["storage_mib"] <= 1.05 * size + 0.5, r
        if r["layout"] == "replicated" and r["kind"] == "sharded":
            assert 0 < r["other_nodes_mib"] <= 1.05 * size, r  # about half per node
        if r["layout"] == "replicated" and r["kind"] == "pipelined":
            assert r["storage_mib"] >= 4 * size * 0.99, r  # every rank reads it all
