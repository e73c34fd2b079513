"""A/B of two asyncload trees on one local load: the same checkpoint, the trees alternated
round by round (order flipped each round) with the destination-sized bound beside them,
each load the first in a fresh child process (``_fresh_child.py``: imports and the touched
destination before the clock, page cache warm), and the same call again in that process.

    python benchmarks/ab_local.py --a /path/to/old/tree --b /path/to/new/tree --rounds 15
    python benchmarks/ab_local.py --a OLD --b NEW --size-mib 0      # the one-tensor checkpoint

A tree is a directory that holds the ``asyncload`` package (a checkout or a ``git worktree``).
Prints, per contender, the medians of the first load and of the second, their ratio to the
bound of the same rounds, and in how many rounds B's first load was faster than A's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C
import torch
import torch.distributed.checkpoint as dcp

CHILD = os.path.join(HERE, "_fresh_child.py")


def run_child(cfg: dict[str, object], tree: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, CHILD, json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        raise SystemExit(
            f"child failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    res: dict[str, object] = json.loads(lines[-1][len("RESULT ") :])
    got = res.get("asyncload_file")
    if tree is not None and not os.path.realpath(str(got)).startswith(
        os.path.realpath(tree) + os.sep
    ):
        raise SystemExit(f"child imported {got}, not the tree {tree}")
    return {k: float(v) for k, v in res.items() if k in ("seconds", "seconds2")}  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--a", required=True, help="tree A (holds the asyncload package)")
    ap.add_argument("--b", required=True, help="tree B")
    ap.add_argument("--size-mib", type=int, default=1024, help="0: a one-tensor checkpoint")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    args = ap.parse_args()
    for tree in (args.a, args.b):
        if not os.path.isfile(os.path.join(tree, "asyncload", "__init__.py")):
            raise SystemExit(f"{tree} holds no asyncload package")
        C.ensure_bytecode(os.path.join(tree, "asyncload"))
    print(f"A: {args.a}\nB: {args.b}\nload average (start): {C.loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "ckpt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if args.size_mib:
                sd = C.transformer_state_dict(args.size_mib << 20)
            else:
                sd = {"w": torch.arange(16, dtype=torch.float32)}
            dcp.save(sd, checkpoint_id=path, no_dist=True)
        shapes = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
        shapes_file = os.path.join(tmp, "shapes.json")
        with open(shapes_file, "w") as f:
            json.dump(shapes, f)
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))
        nbytes = C.nbytes(sd)
        del sd
        base = {"path": path, "files": files, "shapes": shapes_file, "second": True}
        res: dict[str, list[dict[str, float]]] = {"bound": [], "A": [], "B": []}
        for r in range(args.rounds):
            order = ["bound", "A", "B"] if r % 2 == 0 else ["bound", "B", "A"]
            for name in order:
                for f in [*files, os.path.join(path, ".metadata")]:  # the page cache warm for each
                    with open(f, "rb") as fh:
                        while fh.read(64 << 20):
                            pass
                tree = None if name == "bound" else (args.a if name == "A" else args.b)
                mode = "bound" if name == "bound" else "asyncload"
                res[name].append(run_child({**base, "mode": mode}, tree))
        bound = statistics.median(x["seconds"] for x in res["bound"])
        print(
            f"{C.gib(nbytes)} GiB in {len(files)} file(s), {len(shapes)} keys, warm page cache; "
            f"medians of {args.rounds} interleaved rounds; each load the first in a fresh process"
        )
        print(f"{'':10s} {'first s':>9s} {'x bound':>8s} {'2nd s':>9s}")
        for name in ("bound", "A", "B"):
            first = statistics.median(x["seconds"] for x in res[name])
            second = statistics.median(x["seconds2"] for x in res[name])
            print(f"{name:10s} {first:9.4f} {bound / first:8.3f} {second:9.4f}")
        wins = sum(b["seconds"] < a["seconds"] for a, b in zip(res["A"], res["B"]))
        wins2 = sum(b["seconds2"] < a["seconds2"] for a, b in zip(res["A"], res["B"]))
        print(
            f"B faster than A: first load in {wins} of {args.rounds} rounds, 2nd load in {wins2}"
        )
    print(f"load average (end): {C.loadavg()}")


if __name__ == "__main__":
    main()
