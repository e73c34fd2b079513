"""The long fuzz campaign and the hostile-corpus table (docs/integrity.md).

Part 1 decodes every pickle of the hostile corpus (tests/_hostile.py) with asyncload's
metadata and record policies and prints the error each gave, the time and the peak RSS
growth (Linux: VmHWM reset before each). Part 2 runs random mutations of real DCP
records, data.pkl pickles and .metadata files (tests/_fuzzing.py) through the record
parser and the metadata decoder for ``--minutes`` on ``--workers`` processes and prints
examples tried and findings (any exception other than CheckpointFormatError and
UnsafeCheckpointError, a worker that died, or an example slower than ``--slow`` s).
Part 3 (``--structural-minutes``) loads real checkpoints whose ``.metadata`` was mutated
structurally (tests/_forging.py: chunk lists, offsets, sizes, dtypes, properties, storage
entries; one to three mutations each): every load must end in an ``AsyncLoadError`` or be
bit-exact with every destination byte written; anything else is a finding.
Part 4 (``--forged-minutes``) reads, with ``read_state_dict``, real checkpoints whose
``planner_data`` paths were forged, and zstd-saved ones whose tensors claim other sizes
(tests/_forging.py): each read must end in an ``AsyncLoadError`` or give every key at its
path, bit-exact; a raw exception, a dead worker or a slow example is a finding.

    python benchmarks/fuzz_long.py --minutes 5 --workers 2 --structural-minutes 3 --forged-minutes 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def corpus_table() -> list[tuple[str, str, str, str, float, float]]:
    from _hostile import corpus
    from torch.distributed.checkpoint.metadata import Metadata

    from asyncload import AsyncLoadError
    from asyncload.decoding import (
        check_metadata,
        record_globals,
        safe_loads,
        storage_persistent_load,
    )

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for h in corpus(d):
            for policy in ("metadata", "record"):
                try:
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")
                    before = _status("VmRSS:")
                except OSError:
                    before = 0
                t0 = time.perf_counter()
                try:
                    if policy == "metadata":
                        md = safe_loads(h.data, what="x", check_structure=False, expect=Metadata)
                        check_metadata(md, "x")
                    else:
                        safe_loads(
                            h.data,
                            what="x",
                            allowed=record_globals(),
                            persistent_load=storage_persistent_load,
                        )
                    got = "(decoded)"
                except AsyncLoadError as exc:
                    got = type(exc).__name__
                dt = time.perf_counter() - t0
                grew = (_status("VmHWM:") - before) / 2**20 if before else float("nan")
                rows.append((h.kind, h.name, policy, got, dt, grew))
            assert not any(p.name.startswith("executed") for p in Path(d).iterdir()), (
                "a payload ran"
            )
    return rows


def _worker(wid: int, seed: int, seconds: float, slow: float, progress: Any, queue: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from _fuzzing import TARGETS, make_seeds, mutate

    from asyncload import CheckpointFormatError, UnsafeCheckpointError

    seeds = make_seeds()
    names = list(TARGETS)
    tried: Counter[str] = Counter()
    outcome: Counter[str] = Counter()
    findings: list[dict[str, Any]] = []
    slowest = (0.0, "")
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        for _ in range(64):
            name = names[i % len(names)]
            fn, seed_attr, pickle_aware = TARGETS[name]
            pool = getattr(seeds, seed_attr)
            rng = random.Random(f"{seed}/{wid}/{i}")
            data = mutate(rng, pool[rng.randrange(len(pool))], pickle_aware=pickle_aware)
            progress[wid] = i  # a worker that dies leaves its example's index behind
            t0 = time.perf_counter()
            try:
                fn(data)
                outcome["decoded"] += 1
            except CheckpointFormatError:
                outcome["CheckpointFormatError"] += 1
            except UnsafeCheckpointError:
                outcome["UnsafeCheckpointError"] += 1
            except BaseException as exc:
                findings.append(
                    {
                        "target": name,
                        "example": i,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                        "trace": traceback.format_exc()[-1500:],
                        "input": data[:256].hex(),
                    }
                )
            dt = time.perf_counter() - t0
            if dt > slowest[0]:
                slowest = (dt, name)
            if dt > slow:
                findings.append(
                    {
                        "target": name,
                        "example": i,
                        "error": f"slow: {dt:.2f} s",
                        "input": data[:256].hex(),
                    }
                )
            tried[name] += 1
            i += 1
    queue.put(
        {
            "wid": wid,
            "tried": dict(tried),
            "outcome": dict(outcome),
            "findings": findings,
            "slowest": slowest,
        }
    )


def _structural_worker(
    wid: int, seed: int, seconds: float, slow: float, progress: Any, queue: Any
) -> None:
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    from _ckpt import make_checkpoint
    from _corrupt import read_metadata
    from _forging import forge_state_dict, load_forged, random_mutation

    tried: Counter[str] = Counter()
    outcome: Counter[str] = Counter()
    findings: list[dict[str, Any]] = []
    slowest = (0.0, "")
    with tempfile.TemporaryDirectory() as d:
        sd = forge_state_dict()
        base = make_checkpoint(Path(d) / "ckpt", forge_state_dict())
        original = read_metadata(base)
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            rng = random.Random(f"{seed}/structural/{wid}/{i}")
            mutations = [random_mutation(rng) for _ in range(rng.randint(1, 3))]
            progress[wid] = i
            t0 = time.perf_counter()
            try:
                outcome[load_forged(base, original, sd, mutations)] += 1
            except BaseException as exc:
                findings.append(
                    {
                        "target": "structural",
                        "example": i,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                        "trace": traceback.format_exc()[-1500:],
                        "input": repr(mutations)[:256],
                    }
                )
            dt = time.perf_counter() - t0
            slowest = max(slowest, (dt, "structural"))
            if dt > slow:
                findings.append(
                    {
                        "target": "structural",
                        "example": i,
                        "error": f"slow: {dt:.2f} s",
                        "input": repr(mutations),
                    }
                )
            tried["structural metadata load"] += 1
            i += 1
    queue.put(
        {
            "wid": wid,
            "tried": dict(tried),
            "outcome": dict(outcome),
            "findings": findings,
            "slowest": slowest,
        }
    )


def _forged_worker(
    wid: int, seed: int, seconds: float, slow: float, progress: Any, queue: Any
) -> None:
    """Issue 25's surfaces, alternately: forged ``planner_data`` paths and forged claimed sizes
    of zstd-transformed records, each read by ``read_state_dict`` (tests/_forging.py)."""
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    import torch.distributed.checkpoint as dcp
    from _ckpt import make_checkpoint
    from _corrupt import read_metadata
    from _forging import (
        forge_state_dict,
        random_claim,
        random_path_mutation,
        read_forged_claim,
        read_forged_paths,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    tried: Counter[str] = Counter()
    outcome: Counter[str] = Counter()
    findings: list[dict[str, Any]] = []
    slowest = (0.0, "")
    with tempfile.TemporaryDirectory() as d:
        sd = forge_state_dict()
        plain = make_checkpoint(Path(d) / "ckpt", forge_state_dict())
        plain_md = read_metadata(plain)
        zstd = Path(d) / "zstd"
        dcp.save(
            forge_state_dict(),
            storage_writer=FileSystemWriter(zstd, _extensions=[ZStandard()]),
            no_dist=True,
        )
        zstd_md = read_metadata(zstd)
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            rng = random.Random(f"{seed}/forged/{wid}/{i}")
            name = "planner_data read" if i % 2 == 0 else "transformed claim read"
            if i % 2 == 0:
                mutations: list[Any] = [
                    random_path_mutation(rng) for _ in range(rng.randint(1, 3))
                ]
            else:
                mutations = [random_claim(rng) for _ in range(rng.randint(1, 2))]
            progress[wid] = i
            t0 = time.perf_counter()
            try:
                if i % 2 == 0:
                    got = read_forged_paths(plain, plain_md, sd, mutations)
                else:
                    got = read_forged_claim(zstd, zstd_md, sd, mutations)
                outcome[got] += 1
            except BaseException as exc:
                findings.append(
                    {
                        "target": name,
                        "example": i,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                        "trace": traceback.format_exc()[-1500:],
                        "input": repr(mutations)[:256],
                    }
                )
            dt = time.perf_counter() - t0
            slowest = max(slowest, (dt, name))
            if dt > slow:
                findings.append(
                    {
                        "target": name,
                        "example": i,
                        "error": f"slow: {dt:.2f} s",
                        "input": repr(mutations),
                    }
                )
            tried[name] += 1
            i += 1
    queue.put(
        {
            "wid": wid,
            "tried": dict(tried),
            "outcome": dict(outcome),
            "findings": findings,
            "slowest": slowest,
        }
    )


def campaign(
    minutes: float, workers: int, seed: int, slow: float, *, target: Any = None
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    progress = ctx.Array("q", workers)
    target = target or _worker
    procs = [
        ctx.Process(target=target, args=(w, seed, minutes * 60, slow, progress, queue))
        for w in range(workers)
    ]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + minutes * 60 + 300
    while len(results) < workers and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=5))
        except Exception:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if len(dead) + len(results) >= workers:
                break
    for p in procs:
        p.join(timeout=30)
    died = [
        {"worker": w, "exitcode": p.exitcode, "last_example": progress[w]}
        for w, p in enumerate(procs)
        if p.exitcode not in (0, None)
    ]
    tried: Counter[str] = Counter()
    outcome: Counter[str] = Counter()
    findings: list[dict[str, Any]] = []
    slowest = (0.0, "")
    for r in results:
        tried.update(r["tried"])
        outcome.update(r["outcome"])
        findings.extend(r["findings"])
        slowest = max(slowest, tuple(r["slowest"]))  # type: ignore[arg-type]
    return {
        "seconds": time.monotonic() - t0,
        "tried": tried,
        "outcome": outcome,
        "findings": findings,
        "died": died,
        "slowest": slowest,
        "workers": workers,
        "seed": seed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument(
        "--slow", type=float, default=5.0, help="an example slower than this (s) is a finding"
    )
    ap.add_argument("--skip-corpus", action="store_true")
    ap.add_argument(
        "--structural-minutes",
        type=float,
        default=0.0,
        help="also run the structural .metadata campaign this long",
    )
    ap.add_argument(
        "--forged-minutes",
        type=float,
        default=0.0,
        help="also run the forged planner_data / transformed-claim campaign (read_state_dict) this long",
    )
    args = ap.parse_args()

    if not args.skip_corpus:
        print("Hostile corpus (tests/_hostile.py), decoded directly with each policy")
        print(
            f"{'kind':34s} {'pickle':48s} {'policy':8s} {'error':24s} {'ms':>9s} {'peak RSS +MiB':>13s}"
        )
        for kind, name, policy, got, dt, grew in corpus_table():
            print(f"{kind:34s} {name:48s} {policy:8s} {got:24s} {dt * 1e3:9.1f} {grew:13.1f}")
        print()

    failed = False
    if args.minutes > 0:
        print(f"Fuzz campaign: {args.minutes} min on {args.workers} workers, seed {args.seed}")
        failed |= _report(campaign(args.minutes, args.workers, args.seed, args.slow))
    if args.structural_minutes > 0:
        print()
        print(
            f"Structural metadata campaign: {args.structural_minutes} min on {args.workers} workers, seed {args.seed}"
        )
        failed |= _report(
            campaign(
                args.structural_minutes,
                args.workers,
                args.seed,
                args.slow,
                target=_structural_worker,
            )
        )
    if args.forged_minutes > 0:
        print()
        print(
            f"Forged planner_data and transformed claims: {args.forged_minutes} min on {args.workers} workers, seed {args.seed}"
        )
        failed |= _report(
            campaign(
                args.forged_minutes, args.workers, args.seed, args.slow, target=_forged_worker
            )
        )
    sys.exit(1 if failed else 0)


def _report(res: dict[str, Any]) -> bool:
    """Print one campaign's counts; whether it had findings."""
    total = sum(res["tried"].values())
    print(f"ran {res['seconds']:.0f} s")
    for name, n in sorted(res["tried"].items()):
        print(f"  {n:10d}  {name}")
    print(f"  {total:10d}  examples in all ({total / max(res['seconds'], 1e-9):.0f}/s)")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(res["outcome"].items())))
    print(f"slowest example: {res['slowest'][0] * 1e3:.1f} ms ({res['slowest'][1]})")
    print(f"workers that died: {len(res['died'])} {res['died'] if res['died'] else ''}")
    print(f"findings (exceptions other than ours, slow examples): {len(res['findings'])}")
    for f in res["findings"][:20]:
        print(f"  - {f['target']} #{f['example']}: {f['error']}\n    input[:256] {f['input']}")
        if "trace" in f:
            print("    " + f["trace"].replace("\n", "\n    "))
    return bool(res["findings"] or res["died"])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
