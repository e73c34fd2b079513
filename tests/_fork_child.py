"""Child process of tests/engine/test_robustness.py: uses asyncload, then forks (os.fork, with a
background load still running, and a multiprocessing 'fork' pool like DataLoader workers);
every child loads the checkpoint itself. Prints one JSON line.

    python _fork_child.py CKPT
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import traceback

import torch

import asyncload

CKPT = sys.argv[1]
N, ROWS, COLS = 8, 256, 256


def fresh() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(ROWS, COLS) for i in range(N)}


def ok(dest: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(dest[f"t{i}"], torch.full((ROWS, COLS), float(i))) for i in range(N))


def load_and_check(_: int = 0) -> bool:
    dest = fresh()
    asyncload.load(
        dest,
        CKPT,
        options=asyncload.LoadOptions(chunk_size=1 << 16, min_chunk_size=1 << 12, concurrency=4),
    )
    threads = [t.name for t in threading.enumerate() if t.name.startswith("asyncload-io")]
    return ok(dest) and not threads


async def aload_and_check() -> bool:
    dest = fresh()
    await asyncload.aload(dest, CKPT)
    return ok(dest)


def main() -> None:
    res: dict[str, object] = {"parent_first": load_and_check()}
    # fork while a background load is running in another thread
    dest_bg = fresh()
    handle = asyncload.start_load(
        dest_bg,
        CKPT,
        options=asyncload.LoadOptions(chunk_size=1 << 12, min_chunk_size=1 << 10, concurrency=2),
    )
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # what DataLoader workers do first: GNU OpenMP's thread pool does not survive a
            # fork, and any parallel torch op in the child would wait for it forever
            torch.set_num_threads(1)
            import asyncio

            good = load_and_check() and asyncio.run(aload_and_check()) and load_and_check()
            code = 0 if good else 1
        except BaseException:
            traceback.print_exc()
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    res["os_fork_child_exit"] = os.waitstatus_to_exitcode(status)
    handle.result(timeout=60)
    res["parent_background"] = ok(dest_bg)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        res["fork_pool"] = pool.map(load_and_check, range(4))
    res["parent_after"] = load_and_check()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
