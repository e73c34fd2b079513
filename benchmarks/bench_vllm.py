"""vLLM's time to first token of a fresh ``LLM()``: ``load_format="safetensors"`` against
``load_format="asyncload"``, local and from S3 behind latency.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--size tiny|medium] [--rounds 3]
        [--latency 0.01] [--no-s3]

Needs vLLM (``bash scripts/setup_vllm.sh`` builds ``.venv-vllm``). Models: ``tiny`` (4 layers,
hidden 256, ~10 MiB) and ``medium`` (8 layers, hidden 1024, vocab 8192, ~460 MiB), random
Llamas with a tokenizer trained on the spot (asyncload/testing/tiny_llama.py), saved by
``save_pretrained`` in shards of at most 64 MB. Contenders, each in a fresh process per round,
interleaved:

* ``safetensors-local`` / ``asyncload-local``: the model directory on local disk (page cache
  warmed once before the rounds);
* ``download+safetensors`` / ``asyncload-s3``: the weights on a moto S3 server on 127.0.0.1
  behind asyncload's FaultProxy adding ``--latency`` seconds per request: s3fs downloads them
  first, then vLLM's own loader; or asyncload reads them through
  ``model_loader_extra_config={"url": "s3://...", "storage_options": ...}``.

The clock runs from before ``LLM(...)`` to the first generated token (imports outside it); the
child also reports vLLM's own "Loading weights took" seconds. Prints medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
SIZES = {
    "tiny": {"hidden_size": 256, "layers": 4},
    "medium": {"hidden_size": 1024, "layers": 8, "vocab_size": 8192, "intermediate_size": 2816},
}


def _child(spec: dict[str, Any]) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    model = spec["model"]
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
    llm = LLM(
        model=model,
        load_format=spec["load_format"],
        model_loader_extra_config=spec.get("extra") or {},
        enforce_eager=True,
        max_model_len=256,
    )
    llm.generate(["the quick brown fox"], SamplingParams(max_tokens=1), use_tqdm=False)
    seconds = time.perf_counter() - t0
    if spec.get("download"):
        shutil.rmtree(model)
    return {"seconds": seconds}


def _run(spec: dict[str, Any]) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT ") :])
    took = re.findall(r"Loading weights took ([0-9.]+) seconds", proc.stdout + proc.stderr)
    out["weights"] = float(took[-1]) if took else float("nan")
    return out


def _report(title: str, results: dict[str, list[dict[str, float]]]) -> None:
    print(title)
    base = next(iter(results))
    med = {c: statistics.median(r["seconds"] for r in rs) for c, rs in results.items()}
    for c, rs in results.items():
        w = statistics.median(r["weights"] for r in rs)
        print(
            f"  {c:22s} first token {med[c]:7.2f} s  (weights {w:6.2f} s, median of {len(rs)})"
            f"  {med[base] / med[c]:5.2f}x vs {base}"
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(_child(json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency", type=float, default=0.01)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    from asyncload.testing.tiny_llama import save_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_llama(Path(tmp) / "model", max_shard_size="64MB", **SIZES[args.size])
        size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        print(f"model: {args.size}, {size / 2**20:.0f} MiB of safetensors")
        for p in model.glob("*.safetensors"):
            p.read_bytes()  # warm page cache
        local = {
            "safetensors-local": {"model": str(model), "load_format": "safetensors"},
            "asyncload-local": {"model": str(model), "load_format": "asyncload"},
        }
        results: dict[str, list[dict[str, float]]] = {c: [] for c in local}
        for _ in range(args.rounds):
            for c, spec in local.items():
                results[c].append(_run(spec))
        _report("local disk:", results)
        if args.no_s3:
            return
        from asyncload.testing import FaultProxy, S3Server, configure_env

        os.environ.update(configure_env())
        server = S3Server()
        server.start()
        proxy = FaultProxy(server, latency=args.latency).start()
        try:
            url = server.upload_dir(model, "bench", "model")
            opts = server.storage_options(proxy.endpoint_url)
            remote = {
                "download+safetensors": {
                    "model": str(model),
                    "load_format": "safetensors",
                    "download": url,
                    "storage_options": opts,
                },
                "asyncload-s3": {
                    "model": str(model),
                    "load_format": "asyncload",
                    "extra": {"url": url, "storage_options": opts},
                },
            }
            results = {c: [] for c in remote}
            for _ in range(args.rounds):
                for c, spec in remote.items():
                    results[c].append(_run(spec))
            _report(f"S3 on loopback (moto, +{args.latency * 1000:.0f} ms per request):", results)
        finally:
            proxy.stop()
            server.stop()


if __name__ == "__main__":
    main()
