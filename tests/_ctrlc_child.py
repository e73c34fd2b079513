"""Child process of tests/engine/test_robustness.py: loads a checkpoint again and again, each time
interrupted (SIGINT delivered to the main thread, or ``_thread.interrupt_main``) after a
given delay; after each, reports what was left behind. Prints one JSON line.

    python _ctrlc_child.py CKPT MODES DELAY [DELAY ...]

MODES: comma-separated, each tried at every delay: ``signal`` (SIGINT delivered to the
main thread), ``interrupt_main``, or ``http`` alone (a real SIGINT, the checkpoint read over
HTTP through a proxy).
"""

from __future__ import annotations

import _thread
import gc
import json
import signal
import sys
import threading
import time
import warnings

import torch

import asyncload
from asyncload import LoadOptions
from asyncload.engine import Meter
from asyncload.testing.interrupts import open_files_under, tasks_on_library_loops

# The faces (and torch.distributed.checkpoint) are imported on first use: here, before the
# interrupts below, as `import asyncload` did; an import interrupted half-way (sympy's, under
# torch's) is Python's state, not the load's.
_ = asyncload.load

CKPT, MODES = sys.argv[1], sys.argv[2].split(",")
DELAYS = [float(x) for x in sys.argv[3:]]
#: MODE "http": the checkpoint is read over HTTP through a proxy adding 5 ms each way, and
#: after each interrupt no connection to it may remain open; the Ctrl-C is a real SIGINT
REMOTE = MODES == ["http"]
SOURCE: str = CKPT
STORAGE_OPTIONS: dict[str, object] = {}
PROXY_PORT = 0
N, ROWS, COLS = 16, 1024, 2048  # 16 x 8 MiB float32, as the test wrote them
OPTS = LoadOptions(
    chunk_size=1 << 20, min_chunk_size=1 << 16, concurrency=8, memory_budget=8 << 20
)


def fresh() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(ROWS, COLS) for i in range(N)}


def leftovers() -> dict[str, object]:
    deadline = time.monotonic() + 3.0
    while True:  # executor threads finish their current read, then exit
        threads = sorted(
            t.name for t in threading.enumerate() if t.name.startswith("asyncload-io")
        )
        if not threads or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    fds = open_files_under(CKPT)
    conns = []
    if REMOTE:
        import psutil

        deadline = time.monotonic() + 3.0
        while True:
            conns = [
                str(c.laddr)
                for c in psutil.Process().net_connections(kind="tcp")
                if c.raddr and c.raddr.port == PROXY_PORT and c.fd != -1
            ]
            if not conns or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    gc.collect()
    with (
        warnings.catch_warnings()
    ):  # isinstance on every object touches deprecated torch attributes
        warnings.simplefilter("ignore")
        meters = [b for b in gc.get_objects() if isinstance(b, Meter)]
        budgets = [b.used for b in meters if b.name == "read budget"]
    tasks = tasks_on_library_loops()
    return {
        "threads": threads,
        "fds": fds,
        "budget_used": [u for u in budgets if u],
        "tasks": tasks,
        "connections": conns,
    }


def main() -> None:
    main_ident = threading.main_thread().ident
    out = []
    for delay, mode in [(d, m) for d in DELAYS for m in MODES]:
        sent: dict[str, float] = {}

        def fire(sent: dict[str, float] = sent, mode: str = mode) -> None:
            sent["t"] = time.monotonic()
            if mode in ("signal", "http"):
                signal.pthread_kill(main_ident, signal.SIGINT)  # type: ignore[arg-type]
            else:
                _thread.interrupt_main()

        dest = fresh()
        timer = threading.Timer(delay, fire)
        outcome, returned = "completed", 0.0
        loaded = False
        try:
            try:
                timer.start()
                asyncload.load(dest, SOURCE, options=OPTS, storage_options=STORAGE_OPTIONS)
                loaded = True
                returned = time.monotonic()
                while timer.is_alive() or "t" not in sent:  # a late Ctrl-C must land here
                    time.sleep(0.001)
                time.sleep(0.05)
            except KeyboardInterrupt:
                if not loaded:
                    returned = time.monotonic()
                    outcome = "interrupted"
        except KeyboardInterrupt:  # arrived between the load and the wait: the load completed
            pass
        timer.join()
        if outcome == "interrupted":
            lag = returned - sent["t"]
        else:
            lag = 0.0
        out.append({"delay": delay, "mode": mode, "outcome": outcome, "lag": lag, **leftovers()})
    # the library still works after all that
    dest = fresh()
    asyncload.load(dest, SOURCE, options=OPTS, storage_options=STORAGE_OPTIONS)
    ok = all(torch.equal(dest[f"t{i}"], torch.full((ROWS, COLS), float(i))) for i in range(N))
    print(json.dumps({"runs": out, "final_load_ok": ok}))


if __name__ == "__main__":
    if REMOTE:
        from pathlib import Path

        from asyncload.testing import FaultProxy, HTTPRangeServer

        ckpt = Path(CKPT)
        with HTTPRangeServer(ckpt.parent) as server, FaultProxy(server, latency=0.005) as proxy:
            PROXY_PORT = proxy.port
            SOURCE = server.url("", ckpt.name, endpoint_url=proxy.endpoint_url)
            STORAGE_OPTIONS = server.storage_options()
            main()
    else:
        main()
