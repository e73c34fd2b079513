"""vLLM's weights side by side (issue 45): ``load_format="asyncload"`` against vLLM's own
``load_format="runai_streamer"``, the default loader (``"safetensors"``, after a download from
S3) and ``curl --parallel`` fetching the same shards' bytes; local disk and S3 behind latency.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--size tiny|small|medium] [--rounds 3]
        [--latency 0.01] [--no-s3] [--no-local] [--contenders asyncload,runai_streamer,...]

Needs vLLM (``bash scripts/setup_vllm.sh`` builds ``.venv-vllm``, runai-model-streamer
included), s3rver (``npm install --prefix .s3rver s3rver@3.7.1``) and curl. Models: random
Llamas (float32) with a tokenizer trained on the spot (asyncload/testing/tiny_llama.py), saved
by ``save_pretrained`` in shards of at most 64 MB: ``tiny`` (4 layers, hidden 256, ~10 MiB),
``small`` (8 layers, hidden 1024, ~292 MiB in 5 shards), ``medium`` (~460 MiB).

Contenders, each in a fresh process per round, rounds interleaved:

* local disk (page cache warmed once before the rounds): ``safetensors`` (vLLM's default
  loader), ``asyncload``, ``runai_streamer``, and ``curl`` reading the shards' bytes through
  ``file://`` ranged reads (8 MiB, 32 in flight; data discarded);
* S3: s3rver on 127.0.0.1 behind a FaultProxy (its own process, fresh for every run, as
  bench_peers.py) adding ``--latency`` seconds each way: ``download+safetensors`` (s3fs
  downloads the shards into a temporary directory, then vLLM's default loader reads them),
  ``asyncload`` (``model_loader_extra_config={"url": "s3://...", "storage_options": ...}``),
  ``runai_streamer`` (``model_weights="s3://..."``; ``RUNAI_STREAMER_S3_ENDPOINT``,
  ``AWS_ENDPOINT_URL``, ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``, s3rver's credentials),
  and ``curl`` (ranged GETs of the same bytes, 8 MiB, 32 in flight, as bench_peers.py's curl).

Config and tokenizer come from the local model directory for every contender. Per contender:
``weights``: seconds of the loader's ``load_weights`` (timed in the child around vLLM's own
method, the same for every loader; the download's seconds added for ``download+safetensors``;
the whole fetch for curl); ``first token``: from before ``LLM(...)`` (and before the download)
to the first generated token, imports outside the clock; ``peak``: the most RSS the
``load_weights`` call added above the RSS it started at (``VmHWM`` reset just before; the
model's parameters are allocated before), and the process's peak RSS; ``CPU s``: the process's
CPU seconds (user + system) during ``load_weights``, then split by thread name. After the clock each
vLLM child generates 8 greedy tokens; the run prints whether every run of every contender
produced the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the child: its load is timed
    "AWS_EC2_METADATA_DISABLED": "true",
}
SIZES = {
    "tiny": {"hidden_size": 256, "layers": 4},
    "small": {"hidden_size": 1024, "layers": 8},
    "medium": {"hidden_size": 1024, "layers": 8, "vocab_size": 8192, "intermediate_size": 2816},
}
LOCAL = ("safetensors", "asyncload", "runai_streamer", "curl")
REMOTE = ("download+safetensors", "asyncload", "runai_streamer", "curl")
MiB = 1 << 20
RANGE = 8 * MiB  # curl's ranged reads, as bench_peers.py's curl contender
PROMPT = "the quick brown fox"


# --- the child: one contender's run, in a fresh process ------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":")), 0)


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _curl(spec: dict[str, Any]) -> dict[str, Any]:
    """``curl --parallel`` with ranged reads of every shard's bytes, each transfer its own
    ``--next`` group (curl applies a later ``-r`` to every URL otherwise); the bytes each one
    got are counted and checked."""
    args = ["curl", "--parallel", "--parallel-max", "32"]
    want = 0
    for i, (url, n) in enumerate(spec["files"]):
        for lo in range(0, n, RANGE):
            hi = min(n, lo + RANGE)
            want += hi - lo
            args += ["--next"] if (i or lo) else []
            args += ["-sS", "--fail", "-r", f"{lo}-{hi - 1}", "-o", "/dev/null"]
            args += ["-w", "%{size_download}\n", url]
    t0 = time.perf_counter()
    out = subprocess.run(args, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    got = sum(int(x) for x in out.stdout.split())
    if got != want:
        raise SystemExit(f"curl got {got} bytes, wanted {want}")
    return {"weights": seconds, "seconds": float("nan"), "peak": 0, "peak_process": 0}


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each of this process's live threads, by thread id, with
    the thread's name (Python's for its threads, else the kernel's: ``/proc/self/task/*/stat``)."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    named = {t.native_id: t.name for t in threading.enumerate()}  # Python's names
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # ended since the listing
            continue
        name = named.get(int(tid)) or stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _cpu_by_thread(before: dict[int, tuple[str, float]], cpu_before: float) -> dict[str, float]:
    """CPU seconds spent since ``before`` by thread name (digits dropped, so a pool is one
    row), with ``(all)``: the whole process's, ended threads included."""
    rows: dict[str, float] = {}
    for tid, (name, cpu) in _thread_cpu().items():
        spent = cpu - before.get(tid, (name, 0.0))[1]
        if spent > 0:
            key = name.rstrip("0123456789_-") or name
            rows[key] = rows.get(key, 0.0) + spent
    t = os.times()
    rows["(all)"] = t.user + t.system - cpu_before
    return rows


def _timed_load_weights() -> dict[str, Any]:
    """Time every loader's ``load_weights`` (vLLM's method, wrapped on each loader class: the
    default loader, asyncload's, which inherits it, and runai_streamer's) and the RSS it adds."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.runai_streamer_loader import (
        RunaiModelStreamerLoader,
    )

    got: dict[str, Any] = {}
    for cls in (DefaultModelLoader, RunaiModelStreamerLoader):
        orig = cls.__dict__["load_weights"]

        def load_weights(self: Any, model: Any, model_config: Any, _orig: Any = orig) -> None:
            got["hwm_before"] = max(got.get("hwm_before", 0), _status("VmHWM"))
            base = _status("VmRSS")
            _reset_peak()
            threads, t = _thread_cpu(), os.times()
            t0 = time.perf_counter()
            _orig(self, model, model_config)
            got["weights"] = got.get("weights", 0.0) + time.perf_counter() - t0
            got["peak"] = max(got.get("peak", 0), _status("VmHWM") - base)
            got["cpu"] = _cpu_by_thread(threads, t.user + t.system)

        cls.load_weights = load_weights  # type: ignore[method-assign]
    return got


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(spec.get("env") or {})
    if spec["contender"] == "curl":
        return _child_curl(spec)
    from vllm import LLM, SamplingParams

    got = _timed_load_weights()
    t0 = time.perf_counter()
    model = spec["model"]
    download = 0.0
    if spec.get("download"):
        import s3fs

        fs = s3fs.S3FileSystem(**spec["storage_options"])
        local = tempfile.mkdtemp()
        for name in os.listdir(model):  # config and tokenizer from the model directory
            if not name.endswith(".safetensors"):
                shutil.copy(os.path.join(model, name), local)
        for path in fs.ls(spec["download"]):
            if path.endswith(".safetensors"):
                fs.get_file(path, os.path.join(local, os.path.basename(path)))
        model = local
        download = time.perf_counter() - t0
    kwargs = {"model_weights": spec["model_weights"]} if spec.get("model_weights") else {}
    llm = LLM(
        model=model,
        load_format=spec["load_format"],
        model_loader_extra_config=spec.get("extra") or {},
        enforce_eager=True,
        max_model_len=256,
        **kwargs,
    )
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    seconds = time.perf_counter() - t0
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    if spec.get("download"):
        shutil.rmtree(model)
    return {
        "seconds": seconds,
        "weights": download + got.get("weights", float("nan")),
        "download": download,
        "peak": got.get("peak", 0),
        "peak_process": max(got.get("hwm_before", 0), _status("VmHWM")),
        "cpu": got.get("cpu", {}),
        "tokens": list(out[0].outputs[0].token_ids),
    }


def _child_curl(spec: dict[str, Any]) -> dict[str, Any]:
    return _curl(spec)


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise RuntimeError(f"{spec['contender']} failed ({proc.returncode}):\n{tail}")
    return dict(json.loads(lines[-1][len("RESULT ") :]))


# --- the parent ----------------------------------------------------------------------------


def _report(title: str, results: dict[str, list[dict[str, Any]]], nbytes: int) -> None:
    print(title)
    print(
        f"  {'contender':22s} {'weights s':>9s} {'MiB/s':>7s} {'first token s':>13s} "
        f"{'peak +MiB':>9s} {'process MiB':>11s} {'CPU s':>6s}  asyncload's weights vs it"
    )
    med = {c: statistics.median(r["weights"] for r in rs) for c, rs in results.items()}
    for c, rs in results.items():
        ttft = statistics.median(r["seconds"] for r in rs)
        peak = max(r["peak"] for r in rs) / MiB
        proc = max(r["peak_process"] for r in rs) / MiB
        cpus = [r["cpu"]["(all)"] for r in rs if r.get("cpu")]
        cpu = f"{statistics.median(cpus):6.2f}" if cpus else f"{'-':>6s}"
        ratio = f"{med[c] / med['asyncload']:5.2f}x" if "asyncload" in med else "-"
        print(
            f"  {c:22s} {med[c]:9.2f} {nbytes / MiB / med[c]:7.0f} {ttft:13.2f} "
            f"{peak:9.0f} {proc:11.0f} {cpu}  {ratio}"
        )
    print("  CPU s of the weights by thread (the median run's; a pool's threads summed):")
    for c, rs in results.items():
        runs = sorted((r for r in rs if r.get("cpu")), key=lambda r: r["weights"])
        if runs:
            rows = runs[len(runs) // 2]["cpu"]
            top = sorted(rows.items(), key=lambda kv: -kv[1])
            print(f"    {c}: " + ", ".join(f"{k} {v:.2f}" for k, v in top if v >= 0.01))


def _tokens(results: dict[str, list[dict[str, Any]]]) -> None:
    seen = {tuple(r["tokens"]) for rs in results.values() for r in rs if "tokens" in r}
    runs = sum(1 for rs in results.values() for r in rs if "tokens" in r)
    if len(seen) == 1:
        print(f"  tokens equal in all {runs} vLLM runs: {list(next(iter(seen)))}")
    else:
        print(f"  TOKENS DIFFER across {runs} vLLM runs:")
        for c, rs in results.items():
            for r in rs:
                if "tokens" in r:
                    print(f"    {c}: {r['tokens']}")


def _rounds(
    specs: dict[str, dict[str, Any]], rounds: int, proxy: Any = None
) -> dict[str, list[dict[str, Any]]]:
    """Each contender once per round, in order; ``proxy()``: a fresh proxy for each run,
    its URL put into the spec where it says ``{endpoint}``."""
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in specs}
    for _ in range(rounds):
        for c, spec in specs.items():
            if proxy is None:
                results[c].append(_run(spec))
                continue
            p = proxy()
            try:
                text = json.dumps(spec).replace("{endpoint}", p.url)
                results[c].append(_run(json.loads(text)))
            finally:
                p.close()
    return results


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(_child(json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency", type=float, default=0.01, help="one-way delay, seconds")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--no-local", action="store_true")
    ap.add_argument("--contenders", default=",".join(dict.fromkeys(LOCAL + REMOTE)))
    args = ap.parse_args()
    wanted = set(args.contenders.split(","))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import ensure_bytecode

    from asyncload.testing.tiny_llama import save_tiny_llama

    ensure_bytecode()  # each fresh process imports installed-like bytecode
    print(f"load average before: {_loadavg()}; {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_llama(Path(tmp) / "model", max_shard_size="64MB", **SIZES[args.size])
        shards = sorted(model.glob("*.safetensors"))
        nbytes = sum(p.stat().st_size for p in shards)
        print(
            f"model: {args.size}, {nbytes / MiB:.0f} MiB of safetensors in {len(shards)} "
            f"shard(s); {args.rounds} rounds interleaved, each run a fresh process"
        )
        for p in shards:
            p.read_bytes()  # warm page cache
        if not args.no_local:
            base = {"model": str(model)}
            local = {
                "safetensors": {**base, "load_format": "safetensors"},
                "asyncload": {**base, "load_format": "asyncload"},
                "runai_streamer": {**base, "load_format": "runai_streamer"},
                "curl": {"files": [[p.as_uri(), p.stat().st_size] for p in shards]},
            }
            local = {c: {**s, "contender": c} for c, s in local.items() if c in wanted}
            results = _rounds(local, args.rounds)
            _report("local disk (page cache):", results, nbytes)
            _tokens(results)
        if not args.no_s3:
            _remote(args, wanted, model, shards, nbytes)
    print(f"load average after: {_loadavg()}")


def _remote(
    args: argparse.Namespace, wanted: set[str], model: Path, shards: list[Path], nbytes: int
) -> None:
    from bench_remote import Proxy, find_s3rver

    from asyncload.testing import S3rverServer, configure_env

    os.environ.update(configure_env())
    exe = find_s3rver()
    if exe is None:
        sys.exit("s3rver is not installed (npm install --prefix .s3rver s3rver@3.7.1)")
    with S3rverServer(executable=exe) as server:
        weights = Path(tempfile.mkdtemp(dir=model.parent)) / "model"
        weights.mkdir()
        for p in shards:  # only the weights on S3: config and tokenizer are read locally
            os.link(p, weights / p.name)
        url = server.upload_dir(weights, "bench", "model")
        opts = server.storage_options("{endpoint}")
        env = {
            "AWS_ENDPOINT_URL": "{endpoint}",
            "RUNAI_STREAMER_S3_ENDPOINT": "{endpoint}",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }
        base = {"model": str(model), "env": env}
        remote = {
            "download+safetensors": {
                **base,
                "load_format": "safetensors",
                "download": url,
                "storage_options": opts,
            },
            "asyncload": {
                **base,
                "load_format": "asyncload",
                "extra": {"url": url, "storage_options": opts},
            },
            "runai_streamer": {**base, "load_format": "runai_streamer", "model_weights": url},
            "curl": {
                "files": [
                    ["{endpoint}/" + url.removeprefix("s3://") + "/" + p.name, p.stat().st_size]
                    for p in shards
                ]
            },
        }
        remote = {c: {**s, "contender": c} for c, s in remote.items() if c in wanted}
        results = _rounds(
            remote, args.rounds, lambda: Proxy(server.endpoint_url, args.latency, None)
        )
        _report(
            f"S3 on loopback (s3rver, +{args.latency * 1000:.0f} ms each way per request):",
            results,
            nbytes,
        )
        _tokens(results)


if __name__ == "__main__":
    main()
