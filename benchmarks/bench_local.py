"""Local-disk load benchmark: the raw read bound, torch's dcp.load (FileSystemReader) and
asyncload.load, interleaved in one run on the same checkpoint, warm page cache.

    python benchmarks/bench_local.py --size-mib 1024 --rounds 3            # one warmed process
    python benchmarks/bench_local.py --size-mib 1024 --rounds 3 --fresh    # + first loads in fresh processes
    PYTHONPATH=/path/to/tree python benchmarks/bench_local.py --fresh-only # another asyncload tree
    python benchmarks/bench_local.py --size-mib 1024 --rounds 3 --cold-only  # cold page cache (root)

Prints throughput (GiB/s of tensor bytes), ratios to the raw bound and peak RSS above
the destination tensors (the destination is allocated with torch.zeros before timing).
Peak RSS is the kernel's high-water mark, reset before each call; glibc may serve a reader
from memory an earlier reader freed, so the figure can understate a reader's allocations.
The warmed section also replays asyncload's own positional reads into the real
destinations with plain ``preadv`` ("raw into the destinations"): the kernel's copy alone,
each byte landing at its destination's address, not at its file offset in one buffer.

``--fresh`` adds what a job that resumes once sees: each contender's FIRST load in a fresh
subprocess (benchmarks/_fresh_child.py; imports and the touched torch.zeros destination
before the clock; page cache warmed by the parent before every round), interleaved round by
round, the bound measured the same way (positional reads into a touched destination-sized
buffer in a fresh process). Then asyncload's fixed cost: the first ``asyncload.load`` of a
one-tensor checkpoint in a fresh process (and a second load of it in the same process), and
a timeline of a first load (file opens, first positional reads, "asyncload" DEBUG log
records, modules imported during the call).

``--cold`` (root: it writes ``/proc/sys/vm/drop_caches``): every contender's first load in
a fresh process, the page cache dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``) in
the child after its imports and destination, just before the clock, interleaved round by
round: cold raw reads into a touched
destination-sized buffer (plain ``preadv``; with ``posix_fadvise`` SEQUENTIAL + WILLNEED;
``O_DIRECT`` into a page-aligned buffer), torch's ``dcp.load`` and ``asyncload.load``.

``--matrix`` (issue 45, item 1) runs only first loads in fresh processes, for each layout
of ``--layout`` (``dcp``: one ``.distcp`` file; ``dcp-many``: ``FileSystemWriter(thread_count=8)``'s
files; ``safetensors``: 4 shards and their index; ``torchsave``: one zip) and each destination
of ``--dest`` (``touched``: ``torch.zeros``; ``untouched``: ``torch.empty``; ``to_empty``: a meta
module's ``to_empty``), each layout beside its own bound (its files read into a touched
destination-sized buffer; ``--untouched-bound`` adds the same into ``torch.empty``),
interleaved round by round, every import before the clock. ``--shape model`` is issue 45's
checkpoint (per GiB 16 layers of a 2048x2048 and a 2048x4096 float32, a 1024x4096 bfloat16 and
16 norms of 2048 floats: 304 keys), ``--shape bench`` (the default) this script's own. It
prints x bound, peak RSS above the destination (the destination's own pages taken off where
the load faults them in), CPU seconds and minor page faults per GiB::

    python benchmarks/bench_local.py --matrix --shape model --layout dcp,dcp-many,safetensors,torchsave \
        --dest touched,untouched,to_empty --untouched-bound --size-mib 1024 --rounds 3

``--verify`` adds ``verify=True`` (every tensor record's CRC-32 checked) beside
``asyncload.load``, on the DCP checkpoint and on the same tensors saved in one ``torch.save``
file, and prints the median of the per-round ratios: what checking the CRC-32s costs a whole
local load at the page-cache bound (docs/performance.md, "What checking CRC-32 costs").

``--uvloop`` compares the event loops. A local load runs on uvloop only when the program has
imported it (asyncload never imports it for one): with the flag this process imports uvloop
before its warmed section, whose default contender then runs on uvloop, beside
``LoadOptions(use_uvloop=False)`` (the standard loop); the fresh sections add a contender
whose process imports uvloop before the clock.

Children inherit this process's asyncload: the
directory above ``asyncload.__file__`` goes first on their PYTHONPATH, and each child's
``asyncload.__file__`` is checked against this one. asyncload's bytecode is written first
(``_common.ensure_bytecode``), as ``pip install`` writes an installed package's: the
children import it as they import torch's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
import _common as C

import asyncload

_BUFS = [bytearray(8 << 20) for _ in range(2)]  # allocated and touched once, reused by every round


def raw_bound(files: list[str], threads: int = 2, block: int = 8 << 20) -> None:
    """Plain positional reads of every byte of the .distcp files on ``threads`` threads into
    already-touched buffers: what the page cache can deliver, nothing parsed or placed."""
    jobs = []
    for f in files:
        size = os.path.getsize(f)
        for off in range(0, size, block):
            jobs.append((f, off, min(block, size - off)))
    bufs = _BUFS[:threads]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    try:

        def work(i: int) -> None:
            mv = memoryview(bufs[i])
            for f, off, n in jobs[i::threads]:
                os.preadv(fds[f], [mv[:n]], off)

        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)


CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fresh_child.py")
BAR_MS = 20.0  # the bar: fixed cost of the first load in a fresh process


def loadavg(when: str) -> None:
    la = os.getloadavg()
    print(
        f"load average ({when}): {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}  [{time.strftime('%H:%M:%S')}]",
        flush=True,
    )


def child_env() -> dict[str, str]:
    """This process's asyncload first on the child's path (then whatever PYTHONPATH held)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(asyncload.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env


def run_child(cfg: dict[str, object], env: dict[str, str]) -> dict[str, object]:
    r = subprocess.run(
        [sys.executable, CHILD, json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        raise SystemExit(
            f"fresh child {cfg['mode']} failed (rc {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        )
    res: dict[str, object] = json.loads(lines[-1][len("RESULT ") :])
    got = res.get("asyncload_file")
    if got is not None and os.path.realpath(str(got)) != os.path.realpath(asyncload.__file__):
        raise SystemExit(f"fresh child imported {got}, this process {asyncload.__file__}")
    return res


def print_timeline(title: str, res: dict[str, object], per_kind: int = 4) -> float | None:
    """Print a timeline child's events (at most ``per_kind`` of each kind); return the time
    of the first positional read (ms from the call), if any."""
    print(
        f"\n{title}: {float(res['seconds']) * 1e3:.2f} ms in all (ms from the call; DEBUG logging on)"
    )
    shown: dict[str, int] = {}
    first_read = None
    for ms, what in res["events"]:  # type: ignore[attr-defined]
        kind = (
            what.split(" #")[0]
            if what.startswith("os.")
            else what.split()[0]
            if what.startswith(("import", "thread"))
            else " ".join(what.split()[:2])
        )
        if what.startswith(("os.pread", "os.preadv", "os.readv")) and first_read is None:
            first_read = ms
        shown[kind] = shown.get(kind, 0) + 1
        if shown[kind] <= per_kind:
            print(f"  {ms:9.2f}  {what}")
    more = {k: n - per_kind for k, n in shown.items() if n > per_kind}
    if more:
        print("  (not shown: " + ", ".join(f"{n} more '{k}'" for k, n in more.items()) + ")")
    print(f"  {float(res['seconds']) * 1e3:9.2f}  returned")
    mods = res["modules_imported"]
    assert isinstance(mods, list)
    top = sorted({m.split(".")[0] for m in mods})
    print(
        f"  modules imported during the call: {len(mods)}"
        + (f" (packages: {', '.join(top[:12])})" if mods else "")
    )
    print(f"  threads left running after the call: {res['threads_left']}")
    if first_read is not None:
        print(f"  first positional read at {first_read:.2f} ms")
    return first_read


def _destination_reads(
    dest: dict[str, torch.Tensor], path: str, opts: asyncload.LoadOptions
) -> list[tuple[str, int, list[memoryview]]]:
    """The positional reads of asyncload's data phase into ``dest`` (file, offset, the
    destinations' memory), captured from one load: what "raw into the destinations" replays.
    Unlike the destination-sized buffer, real destinations do not sit at their bytes' file
    offset modulo 4 KiB, which costs the kernel's copy a few percent (docs/performance.md)."""
    from asyncload.storage import RetryingStorage

    got: list[tuple[str, int, list[memoryview]]] = []
    orig = RetryingStorage.readinto_shared

    async def capture(
        self: RetryingStorage, reads: list[tuple[str, int, list[memoryview]]], **kw: object
    ) -> None:
        got.extend((name, start, list(views)) for name, start, views in reads)
        await orig(self, reads, **kw)  # type: ignore[arg-type]

    RetryingStorage.readinto_shared = capture  # type: ignore[method-assign,assignment]
    try:
        asyncload.load(dest, path, options=opts)
    finally:
        RetryingStorage.readinto_shared = orig  # type: ignore[method-assign]
    return got


def _replay(path: str, reads: list[tuple[str, int, list[memoryview]]], threads: int = 2) -> None:
    """Plain ``preadv`` of ``reads`` on ``threads`` threads, each taking the next read."""
    names = sorted({name for name, _, _ in reads})
    fds = {n: os.open(os.path.join(path, n), os.O_RDONLY) for n in names}
    todo = list(reversed(reads))
    try:

        def work() -> None:
            while True:
                try:
                    name, start, views = todo.pop()
                except IndexError:
                    return
                os.preadv(fds[name], views, start)

        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            for f in [ex.submit(work) for _ in range(threads)]:
                f.result()
    finally:
        for fd in fds.values():
            os.close(fd)


def warm_section(
    args: argparse.Namespace,
    path: str,
    files: list[str],
    total: int,
    file_bytes: int,
    shapes: dict[str, tuple[list[int], str]],
    opts: asyncload.LoadOptions,
    pt_path: str | None = None,
) -> None:
    template = {k: torch.empty(s, dtype=getattr(torch, dt)) for k, (s, dt) in shapes.items()}
    dest = C.zeros_like(template)
    del template
    raw_bound(files)  # warm the page cache
    big = torch.zeros(file_bytes, dtype=torch.uint8)
    big_mv = memoryview(big.numpy())
    replay = _destination_reads(dest, path, opts)
    competitors = {
        "raw bound (preadv, 2 threads)": lambda: raw_bound(files),
        "raw into destination-sized buffer": lambda: C.raw_into_destination(files, big_mv),
        "raw into the destinations": lambda: _replay(path, replay),
        "torch dcp.load FileSystemReader": lambda: dcp.load(
            dest, storage_reader=dcp.FileSystemReader(path), no_dist=True
        ),
        "asyncload.load": lambda: asyncload.load(dest, path, options=opts),
    }
    if args.verify:
        vopts = opts.replace(verify=True)
        competitors["asyncload.load verify=True"] = lambda: asyncload.load(
            dest, path, options=vopts
        )
        if pt_path is not None:  # the same tensors in one torch.save file (records' CRC-32)
            pt: str = pt_path
            with open(pt, "rb") as f:  # warm the page cache
                while f.read(64 << 20):
                    pass
            competitors["asyncload.load torch.save file"] = lambda: asyncload.load(
                dest, pt, options=opts
            )
            competitors["asyncload.load torch.save verify=True"] = lambda: asyncload.load(
                dest, pt, options=vopts
            )
    if args.uvloop:
        import uvloop  # noqa: F401  # the default contender's local loads then run on it

        aopts = opts.replace(use_uvloop=False)
        competitors = {
            "asyncload.load (uvloop imported)" if k == "asyncload.load" else k: v
            for k, v in competitors.items()
        }
        competitors["asyncload.load use_uvloop=False"] = lambda: asyncload.load(
            dest, path, options=aopts
        )
    times: dict[str, list[float]] = {k: [] for k in competitors}
    peaks: dict[str, list[int]] = {k: [] for k in competitors}
    cpu: dict[str, list[float]] = {k: [] for k in competitors}  # CPU seconds, all threads
    names = list(competitors)
    for r in range(args.rounds):
        for name in (
            names[r % len(names) :] + names[: r % len(names)]
        ):  # the order rotated each round
            cpu0 = time.process_time()
            dt, peak = C.measure(competitors[name])
            cpu[name].append(time.process_time() - cpu0)
            times[name].append(dt)
            peaks[name].append(peak)
    print(
        f"\n== one warmed process ==\ncheckpoint: {C.gib(total)} GiB of tensors in {len(files)} file(s) "
        f"({C.gib(file_bytes)} GiB), {len(dest)} keys; warm page cache; median of {args.rounds} interleaved "
        f"rounds; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    print(
        f"asyncload options: concurrency={args.concurrency} chunk_size={args.chunk_mib} MiB "
        f"memory_budget={args.budget_mib} MiB"
    )
    bound = C.median(times["raw bound (preadv, 2 threads)"])
    dbound = C.median(times["raw into destination-sized buffer"])
    rbound = C.median(times["raw into the destinations"])
    print(
        f"{'reader':36s} {'seconds':>8s} {'GiB/s':>7s} {'x bound':>8s} {'x dest bound':>12s} "
        f"{'x into dests':>12s} {'peak RSS above dest':>20s}"
    )
    for name in competitors:
        t = C.median(times[name])
        print(
            f"{name:36s} {t:8.3f} {total / t / (1 << 30):7.2f} {bound / t:8.2f} {dbound / t:12.2f} "
            f"{rbound / t:12.2f} {max(peaks[name]) / (1 << 20):17.1f} MiB"
        )
    print(
        "(x dest bound: the issue's bound, a destination-sized buffer read at the file's offsets; x into dests: "
        f"asyncload's own reads into the real destinations, replayed with plain preadv, {len(replay)} reads)"
    )
    if args.verify:  # what checking every record's CRC-32 costs a whole local load
        pairs = [("asyncload.load", "asyncload.load verify=True", "DCP")]
        if pt_path is not None:
            pairs.append(
                (
                    "asyncload.load torch.save file",
                    "asyncload.load torch.save verify=True",
                    "torch.save",
                )
            )
        print(
            f"\nverify's cost (crc32: {crc_impl()}; wall: the load's seconds, CPU: its process's)"
        )
        for off, on, what in pairs:
            ratios = [b / a for a, b in zip(times[off], times[on])]
            wall = C.median(ratios)
            fastest = min(times[on]) / min(times[off])
            cpu_ratio = C.median(cpu[on]) / C.median(cpu[off])
            print(
                f"  {what}: wall, median of per-round ratios {wall:.3f} ({(wall - 1) * 100:+.1f}%); "
                f"fastest on / fastest off {fastest:.3f} ({(fastest - 1) * 100:+.1f}%); CPU "
                f"{C.median(cpu[off]):.3f} s -> {C.median(cpu[on]):.3f} s ({(cpu_ratio - 1) * 100:+.1f}%)"
            )
            print(f"    per-round wall ratios: {', '.join(f'{r:.2f}' for r in ratios)}")
    st = asyncload.load(dest, path, options=opts)
    print(f"\nasyncload stats: {st}", flush=True)


def crc_impl() -> str:
    import asyncload.engine.crc as crc

    return crc.CRC32_IMPL


def run_rounds(
    args: argparse.Namespace,
    contenders: dict[str, dict[str, object]],
    base: dict[str, object],
    checks: dict[str, float],
    before: Callable[[], object],
    what: str,
) -> dict[str, list[dict[str, object]]]:
    """Each contender in a fresh child per round, interleaved, the order rotated each round;
    ``before()`` runs before every child (warms the page cache, for example)."""
    env = child_env()
    names = list(contenders)
    res: dict[str, list[dict[str, object]]] = {k: [] for k in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            before()
            out = run_child({**base, **contenders[name]}, env)
            if "check" in out and out["check"] != checks:
                raise SystemExit(
                    f"{name} ({what}) loaded wrong values: {out['check']} != {checks}"
                )
            res[name].append(out)
    return res


def fresh_section(
    args: argparse.Namespace,
    tmp: str,
    path: str,
    files: list[str],
    total: int,
    shapes_file: str,
    checks: dict[str, float],
    o: dict[str, object],
) -> None:
    env = child_env()
    base: dict[str, object] = {
        "path": path,
        "files": files,
        "shapes": shapes_file,
        "check": checks,
    }
    contenders: dict[str, dict[str, object]] = {
        "raw into destination-sized buffer": {"mode": "bound"},
        "torch dcp.load FileSystemReader": {"mode": "torch", "second": True},
        "asyncload.load": {"mode": "asyncload", "options": o, "second": True},
    }
    if args.uvloop:
        contenders["asyncload.load, uvloop imported"] = {
            "mode": "asyncload",
            "options": o,
            "import_uvloop": True,
            "second": True,
        }
    names = list(contenders)
    # page cache warm before every child
    res = run_rounds(args, contenders, base, checks, lambda: raw_bound(files), "fresh")
    print(f"\n== first load in a fresh process ({args.rounds} interleaved rounds, medians) ==")
    print(
        "each in its own subprocess: imports and the torch.zeros destination before the clock, page cache warm;"
        "\n'2nd load' is the same call again in that process (warm, as in the section above)"
    )
    bound = C.median([float(x["seconds"]) for x in res[names[0]]])
    print(
        f"{'reader (first load, fresh process)':36s} {'seconds':>8s} {'GiB/s':>7s} {'x fresh bound':>13s} "
        f"{'peak RSS above dest':>20s} {'2nd load s':>10s} {'first - 2nd':>12s}"
    )
    for name in names:
        t = C.median([float(x["seconds"]) for x in res[name]])
        peak = max(int(x["peak"]) for x in res[name]) / (1 << 20)  # type: ignore[call-overload]
        second = ""
        if res[name] and "seconds2" in res[name][0]:
            t2 = C.median([float(x["seconds2"]) for x in res[name]])
            second = f"{t2:10.3f} {(t - t2) * 1e3:9.1f} ms"
        print(
            f"{name:36s} {t:8.3f} {total / t / (1 << 30):7.2f} {bound / t:13.2f} {peak:17.1f} MiB {second}"
        )
    al = C.median([float(x["seconds"]) for x in res["asyncload.load"]])
    print(
        f"asyncload first load above the fresh bound: {(al - bound) * 1e3:.1f} ms; "
        f"per round (s): " + ", ".join(f"{float(x['seconds']):.3f}" for x in res["asyncload.load"])
    )
    st = run_child({**base, "mode": "asyncload", "options": o, "stats": True}, env)
    print(f"asyncload stats (a fresh process's load after its first): {st['stats']}", flush=True)


def fixed_cost_section(args: argparse.Namespace, tmp: str, path: str, shapes_file: str) -> None:
    env = child_env()
    tiny = os.path.join(tmp, "tiny")
    dcp.save({"w": torch.arange(16, dtype=torch.float32)}, checkpoint_id=tiny, no_dist=True)
    tiny_shapes = os.path.join(tmp, "tiny-shapes.json")
    with open(tiny_shapes, "w") as f:
        json.dump({"w": [[16], "float32"]}, f)
    n = max(5, args.rounds)
    rows: dict[str, list[dict[str, object]]] = {
        "asyncload.load (default options)": [],
        "torch dcp.load FileSystemReader": [],
    }
    options: dict[str, dict[str, object]] = {}
    if args.uvloop:
        rows["asyncload.load, uvloop imported"] = []
        options["asyncload.load, uvloop imported"] = {"import_uvloop": True}
    for _ in range(n):
        for name in rows:
            mode = "asyncload" if name.startswith("asyncload") else "torch"
            cfg = {
                "mode": mode,
                "path": tiny,
                "shapes": tiny_shapes,
                "second": True,
                **options.get(name, {}),
            }
            rows[name].append(run_child(cfg, env))
    print(
        f"\n== fixed cost: a one-tensor checkpoint (16 float32), first load in a fresh process (median of {n}) =="
    )
    print(
        f"{'loader':36s} {'first load ms':>13s} {'2nd load ms':>11s} {'first - 2nd':>12s}   first loads (ms)"
    )
    for name, rs in rows.items():
        a = C.median([float(x["seconds"]) * 1e3 for x in rs])
        b = C.median([float(x["seconds2"]) * 1e3 for x in rs])
        each = " ".join(f"{float(x['seconds']) * 1e3:.1f}" for x in rs)
        print(f"{name:36s} {a:13.2f} {b:11.2f} {a - b:9.2f} ms   {each}")
    fixed = C.median([float(x["seconds"]) * 1e3 for x in rows["asyncload.load (default options)"]])
    tl = run_child({"mode": "timeline", "path": tiny, "shapes": tiny_shapes, "watch": [tiny]}, env)
    print_timeline(
        "timeline of a first asyncload.load of the one-tensor checkpoint, fresh process", tl
    )
    tl_big = run_child(
        {"mode": "timeline", "path": path, "shapes": shapes_file, "watch": [path]}, env
    )
    first_read = print_timeline(
        f"timeline of a first asyncload.load of the {args.size_mib} MiB checkpoint, fresh process",
        tl_big,
    )
    print(
        f"\nfixed cost of a first load: {fixed:.1f} ms (first asyncload.load of a one-tensor checkpoint in a "
        f"fresh process, median of {n}; issue's bar <= {BAR_MS:.0f} ms: {'met' if fixed <= BAR_MS else 'NOT met'})"
    )
    if first_read is not None:
        print(
            f"time to the first positional read, {args.size_mib} MiB checkpoint, fresh process: {first_read:.1f} ms "
            f"(one run, DEBUG logging on)",
            flush=True,
        )


def cold_section(
    args: argparse.Namespace, base: dict[str, object], total: int, o: dict[str, object]
) -> None:
    """``base``: the children's common config (checkpoint, files, shapes, checksums)."""
    checks: dict[str, float] = base["check"]  # type: ignore[assignment]
    base = {**base, "drop_caches": True}  # the child drops the page cache just before its clock
    contenders: dict[str, dict[str, object]] = {
        "raw preadv (cold)": {"mode": "raw", "how": "plain"},
        "raw preadv + fadvise SEQ/WILLNEED": {"mode": "raw", "how": "fadvise"},
        "raw O_DIRECT (aligned buffer)": {"mode": "raw", "how": "direct"},
        "torch dcp.load FileSystemReader": {"mode": "torch"},
        "asyncload.load": {"mode": "asyncload", "options": o},
    }
    names = list(contenders)
    if not C.drop_caches():
        raise SystemExit("--cold needs root: cannot write /proc/sys/vm/drop_caches")
    res = run_rounds(args, contenders, base, checks, os.sync, "cold")
    print(
        f"\n== cold page cache: first load in a fresh process ({args.rounds} interleaved rounds, medians) =="
    )
    print(
        "page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) in each child after its imports and its"
        "\ndestination, just before the clock; raw reads: 2 threads, 8 MiB blocks, touched destination-sized buffer"
    )
    med = {n: C.median([float(x["seconds"]) for x in res[n]]) for n in names}
    plain = med[names[0]]
    best_raw = min(med[n] for n in names[:3])
    print(
        f"{'reader (cold, fresh process)':36s} {'seconds':>8s} {'GiB/s':>7s} {'x plain raw':>11s} {'x best raw':>10s} "
        f"{'peak RSS above dest':>20s}   per round (s)"
    )
    for name in names:
        t = med[name]
        peak = max(int(x["peak"]) for x in res[name]) / (1 << 20)  # type: ignore[call-overload]
        each = ", ".join(f"{float(x['seconds']):.3f}" for x in res[name])
        print(
            f"{name:36s} {t:8.3f} {total / t / (1 << 30):7.2f} {plain / t:11.2f} {best_raw / t:10.2f} "
            f"{peak:17.1f} MiB   {each}"
        )
    print(
        f"(asyncload memory_budget {args.budget_mib} MiB; target: peak RSS above the destination <= budget + 64 MiB)"
    )


LAYOUTS = ("dcp", "dcp-many", "safetensors", "torchsave")
DESTS = ("touched", "untouched", "to_empty")


def model_state_dict(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Issue 45's model-shaped checkpoint: per layer a 2048x2048 and a 2048x4096 float32, a
    1024x4096 bfloat16 and 16 norms of 2048 floats (19 keys, 56.1 MiB); 16 layers (304 keys)
    per GiB asked for."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i in range(max(1, total_bytes // (64 << 20))):
        p = f"layers.{i}."
        sd[p + "attn.weight"] = torch.randn(2048, 2048, generator=g)
        sd[p + "mlp.weight"] = torch.randn(2048, 4096, generator=g)
        sd[p + "proj.weight"] = torch.randn(1024, 4096, generator=g).to(torch.bfloat16)
        for j in range(16):
            sd[p + f"norm{j}.weight"] = torch.randn(2048, generator=g)
    return sd


def save_layout(sd: dict[str, torch.Tensor], layout: str, folder: str) -> tuple[str, list[str]]:
    """``sd`` saved as ``layout`` under ``folder``: (the path to load, its data files)."""
    if layout == "dcp":
        dcp.save(sd, checkpoint_id=folder, no_dist=True)
    elif layout == "dcp-many":
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(folder, thread_count=8), no_dist=True)
    elif layout == "safetensors":  # 4 shards and their index, as a hub model
        from safetensors.torch import save_file

        os.makedirs(folder)
        names = list(sd)
        shards = [names[i::4] for i in range(4)]
        weight_map: dict[str, str] = {}
        for j, keys in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: sd[k] for k in keys}, os.path.join(folder, fname))
            weight_map.update(dict.fromkeys(keys, fname))
        index = {"metadata": {"total_size": C.nbytes(sd)}, "weight_map": weight_map}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    elif layout == "torchsave":
        os.makedirs(folder)
        pt = os.path.join(folder, "model.pt")
        torch.save(sd, pt)
        return pt, [pt]
    else:
        raise SystemExit(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    data = (".distcp", ".safetensors")
    return folder, [
        os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(data)
    ]


def matrix_section(args: argparse.Namespace, tmp: str, o: dict[str, object]) -> None:
    """First loads in fresh processes for each (layout, destination) of ``--shape``'s
    checkpoint, each beside the bound of its own files, interleaved round by round."""
    layouts = [x for x in args.layout.split(",") if x]
    dests = [x for x in args.dest.split(",") if x]
    for d in dests:
        if d not in DESTS:
            raise SystemExit(f"unknown --dest {d!r}: one of {', '.join(DESTS)}")
    sd = (
        model_state_dict(args.size_mib << 20)
        if args.shape == "model"
        else C.transformer_state_dict(args.size_mib << 20)
    )
    total = C.nbytes(sd)
    shapes = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
    shapes_file = os.path.join(tmp, "matrix-shapes.json")
    with open(shapes_file, "w") as f:
        json.dump(shapes, f)
    check_keys = [next(iter(sd)), list(sd)[len(sd) // 2], list(sd)[-1]]
    checks = {k: float(sd[k].double().sum()) for k in check_keys}
    saved = {lay: save_layout(sd, lay, os.path.join(tmp, "m-" + lay)) for lay in layouts}
    del sd
    contenders: dict[str, dict[str, object]] = {}
    for lay in layouts:
        path, files = saved[lay]
        base = {"path": path, "files": files, "shapes": shapes_file, "check": checks}
        contenders[f"{lay}: bound"] = {**base, "mode": "bound"}
        if args.untouched_bound:
            contenders[f"{lay}: bound untouched"] = {**base, "mode": "bound", "dest": "untouched"}
        for d in dests:
            contenders[f"{lay}: asyncload {d}"] = {
                **base,
                "mode": "asyncload",
                "options": o,
                "dest": d,
                "preimport": True,  # imports outside the clock, as the figures
            }
    every = sorted({f for _, files in saved.values() for f in files})
    res = run_rounds(args, contenders, {}, checks, lambda: raw_bound(every), "matrix")
    print(
        f"\n== first load in a fresh process, per layout and destination (shape {args.shape!r}: "
        f"{C.gib(total)} GiB, {len(shapes)} keys; {args.rounds} interleaved rounds, medians) =="
    )
    print(
        "bound: preadv of the layout's files into a touched destination-sized buffer, fresh process;"
        "\ntouched: torch.zeros destinations; untouched: torch.empty; to_empty: module.to_empty"
    )
    print(
        f"{'layout: reader':32s} {'files':>5s} {'seconds':>8s} {'GiB/s':>7s} {'x bound':>8s} "
        f"{'peak MiB above dest':>19s} {'CPU s/GiB':>9s} {'faults/GiB':>10s}   per round (s)"
    )

    def num(x: dict[str, object], key: str) -> float:
        v = x[key]
        assert isinstance(v, (int, float)), (key, v)
        return float(v)

    gib = total / (1 << 30)
    for lay in layouts:
        bound = C.median([num(x, "seconds") for x in res[f"{lay}: bound"]])
        for name in [n for n in contenders if n.startswith(lay + ":")]:
            rs = res[name]
            t = C.median([num(x, "seconds") for x in rs])
            peak = max(max(0.0, num(x, "peak")) for x in rs) / (1 << 20)
            each = ", ".join(f"{num(x, 'seconds'):.3f}" for x in rs)
            cpu = C.median([num(x, "utime") + num(x, "stime") for x in rs]) / gib
            faults = C.median([num(x, "minflt") for x in rs]) / gib
            print(
                f"{name:32s} {len(saved[lay][1]):5d} {t:8.3f} {gib / t:7.2f} "
                f"{bound / t:8.2f} {peak:19.1f} {cpu:9.3f} {faults:10.0f}   {each}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--budget-mib", type=int, default=512)
    ap.add_argument(
        "--verify",
        action="store_true",
        help="also time asyncload with verify=True, on the DCP checkpoint and on the same "
        "tensors in one torch.save file, and print verify's cost (per-round ratios)",
    )
    ap.add_argument(
        "--uvloop",
        action="store_true",
        help="also time asyncload with uvloop imported by the program (local loads then run on it)",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="also time each contender's first load in a fresh process, and asyncload's fixed cost",
    )
    ap.add_argument("--fresh-only", action="store_true", help="only the fresh-process sections")
    ap.add_argument(
        "--cold", action="store_true", help="also time cold page cache loads (root: drops caches)"
    )
    ap.add_argument("--cold-only", action="store_true", help="only the cold page cache section")
    ap.add_argument(
        "--matrix",
        action="store_true",
        help="only first loads in fresh processes per --layout and --dest, each beside its bound",
    )
    ap.add_argument(
        "--shape",
        choices=("bench", "model"),
        default="bench",
        help="--matrix's checkpoint: this script's own (67 keys per GiB) or issue 45's model "
        "shape (16 layers of 19 keys per GiB)",
    )
    ap.add_argument(
        "--layout",
        default="dcp",
        help=f"--matrix's layouts, comma-separated: {', '.join(LAYOUTS)} (dcp-many: "
        "FileSystemWriter(thread_count=8); safetensors: 4 shards and an index)",
    )
    ap.add_argument(
        "--untouched-bound",
        action="store_true",
        help="--matrix: also the bound's reads into an untouched (torch.empty) buffer",
    )
    ap.add_argument(
        "--dest",
        default="touched",
        help=f"--matrix's destinations, comma-separated: {', '.join(DESTS)}",
    )
    args = ap.parse_args()

    print(
        f"asyncload: {asyncload.__file__} (version {getattr(asyncload, '__version__', '?')}); python "
        f"{sys.executable}; PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}"
    )
    loadavg("start")
    C.ensure_bytecode()  # fresh processes import asyncload's bytecode, as torch's
    tmp = tempfile.mkdtemp(prefix="asyncload-bench-", dir=args.dir)
    try:
        if args.matrix:
            matrix_section(
                args,
                tmp,
                {
                    "concurrency": args.concurrency,
                    "chunk_size": args.chunk_mib << 20,
                    "memory_budget": args.budget_mib << 20,
                },
            )
            loadavg("end")
            return
        sd = C.transformer_state_dict(args.size_mib << 20)
        total = C.nbytes(sd)
        path = os.path.join(tmp, "ckpt")
        dcp.save(sd, checkpoint_id=path)
        shapes = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
        check_keys = [next(iter(sd)), list(sd)[len(sd) // 2], list(sd)[-1]]
        checks = {k: float(sd[k].double().sum()) for k in check_keys}
        pt_path = None
        if args.verify and not (args.fresh_only or args.cold_only):
            pt_path = os.path.join(tmp, "ckpt.pt")
            torch.save(sd, pt_path)
        del sd
        shapes_file = os.path.join(tmp, "shapes.json")
        with open(shapes_file, "w") as f:
            json.dump(shapes, f)
        files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".distcp")]
        file_bytes = sum(os.path.getsize(f) for f in files)
        opts = asyncload.LoadOptions(
            concurrency=args.concurrency,
            chunk_size=args.chunk_mib << 20,
            memory_budget=args.budget_mib << 20,
        )
        o = {
            "concurrency": args.concurrency,
            "chunk_size": args.chunk_mib << 20,
            "memory_budget": args.budget_mib << 20,
        }
        if not (args.fresh_only or args.cold_only):
            warm_section(args, path, files, total, file_bytes, shapes, opts, pt_path)
            loadavg("after the warmed-process section")
        if args.cold or args.cold_only:
            os.sync()
            cold_section(
                args,
                {"path": path, "files": files, "shapes": shapes_file, "check": checks},
                total,
                o,
            )
            loadavg("after the cold page cache section")
        if (args.fresh or args.fresh_only) and not args.cold_only:
            fresh_section(args, tmp, path, files, total, shapes_file, checks, o)
            loadavg("after the fresh-process section")
            fixed_cost_section(args, tmp, path, shapes_file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nasyncload: {asyncload.__file__}")
    loadavg("end")


if __name__ == "__main__":
    from _parts import run_part  # --part NAME: a folded-in part (benchmarks/README.md)

    run_part(__file__, {"copy-paths": "_local_copy_paths.py"})
    main()
