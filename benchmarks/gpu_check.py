"""Everything asyncload's CUDA path needs checked on a real GPU, in one short run.

1. Makes a ~1 GiB (``--size-gib``) bf16 transformer-like checkpoint in three formats: a DCP
   directory (``dcp.save``), ``model.safetensors`` and ``model.pt`` (``torch.save``).
2. Correctness, bit for bit: each format loaded by asyncload into CUDA destinations equals
   the same format loaded into CPU destinations and the saved tensors; also with a small
   memory budget (the pinned ring's slots reused many times), a transposed destination view,
   a bf16 -> fp32 cast on load, a mixed CPU/GPU state dict, and CUDA work queued on the
   destinations just before the load (the side stream must wait for it).
3. Throughput (warm page cache, best of ``--rounds``, every timing ends with
   ``torch.cuda.synchronize()``): asyncload straight to the GPU, against asyncload to the CPU
   + ``copy_`` to the GPU, plain ``torch.load`` + ``.cuda()``, ``torch.load(mmap=True)`` +
   ``.cuda()``, ``safetensors.torch.load_file(device="cuda:0")`` and ``dcp.load`` with torch's
   ``FileSystemReader``. Prints a table with GiB/s and ratios.

Designed to finish in well under 4 minutes on one H200 (16 cores) for 1 GiB; exit status 0
when every check passed, 1 when one failed, 2 when there is no CUDA device.

    PYTHONPATH=. python3 benchmarks/gpu_check.py               # ~1 GiB
    PYTHONPATH=. python3 benchmarks/gpu_check.py --size-gib 2  # larger
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["device"] = torch.cuda.get_device_name(0)
            info["cuda_version"] = torch.version.cuda
    except Exception as exc:
        info["torch"] = f"unavailable: {exc!r}"
        info["cuda"] = False
    for mod in ("numpy", "safetensors", "fsspec", "uvloop"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "yes")
        except Exception:
            info[mod] = None
    try:
        import asyncload

        info["asyncload"] = asyncload.__version__
    except Exception as exc:
        info["asyncload"] = f"unavailable: {exc!r}"
    return info


# --- the checkpoint -------------------------------------------------------------------------


def make_state(total_bytes: int, hidden: int) -> dict[str, Any]:
    """bf16 layers (attention, MLP: a few big matrices) and many small norms, random bits made on the GPU."""
    import torch

    where = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=where).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (
            torch.randn(*shape, generator=g, device=where, dtype=torch.float32)
            .to(torch.bfloat16)
            .cpu()
        )

    per_layer = 12 * hidden * hidden * 2
    layers = max(1, total_bytes // per_layer)
    sd: dict[str, Any] = {"embed.weight": rnd(4096, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = rnd(3 * hidden, hidden)
        sd[p + "attn.o.weight"] = rnd(hidden, hidden)
        sd[p + "mlp.up.weight"] = rnd(4 * hidden, hidden)
        sd[p + "mlp.down.weight"] = rnd(hidden, 4 * hidden)
        for n in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"):
            sd[p + n] = rnd(hidden)
    sd["norm.weight"] = rnd(hidden)
    sd["lm_head.weight"] = rnd(4096, hidden)
    return sd


_ST = {
    "torch.bfloat16": "BF16",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.int64": "I64",
}


def write_safetensors(sd: dict[str, Any], path: Path) -> None:
    """With the safetensors package when installed, else by hand (the format is 8 + JSON + bytes)."""
    try:
        from safetensors.torch import save_file

        save_file(sd, str(path))
        return
    except ImportError:
        pass
    header: dict[str, Any] = {}
    off = 0
    for k, t in sd.items():
        n = t.numel() * t.element_size()
        header[k] = {
            "dtype": _ST[str(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [off, off + n],
        }
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in sd.values():
            f.write(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())


def warm(paths: list[Path]) -> None:
    for p in paths:
        files = [p] if p.is_file() else [q for q in p.iterdir() if q.is_file()]
        for q in files:
            with open(q, "rb") as f:
                while f.read(64 << 20):
                    pass


# --- checks -----------------------------------------------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

    def run(self, name: str, fn: Callable[[], None]) -> None:
        t = time.monotonic()
        try:
            fn()
        except Exception:
            self.failed.append(name)
            say(f"FAIL {name}\n{traceback.format_exc()}")
            return
        self.passed += 1
        say(f"ok   {name} ({time.monotonic() - t:.2f} s)")


def same_bits(a: Any, b: Any, what: str) -> None:
    import torch

    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
    if a.numel() and not torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    ):
        raise AssertionError(f"{what}: bits differ")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="no GPU: run the script's logic with CPU 'device' tensors through asyncload's fake device",
    )
    args = ap.parse_args()

    env = environment()
    print("environment: " + json.dumps(env), flush=True)
    if args.dry_run_cpu:
        return dry_run(args)
    if not env.get("cuda"):
        print("no CUDA device (or no torch with CUDA): nothing to check here", flush=True)
        return 2
    if not isinstance(env.get("asyncload"), str) or env["asyncload"].startswith("unavailable"):
        print(
            "asyncload does not import: run from the repository root with PYTHONPATH=. "
            "(it needs numpy; see docs/gpu.md)",
            flush=True,
        )
        return 1

    import torch

    return run(args, env, torch.device("cuda:0"))


def dry_run(args: argparse.Namespace) -> int:
    """The whole script on CPU: destinations on "cuda" are CPU tensors the fake device claims."""
    import torch

    from asyncload.testing import fake_device

    env = environment()
    env.update(device="CPU (dry run, fake device)", cuda_version=None)
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda._sleep = lambda *a, **k: None  # type: ignore[assignment]
    with fake_device() as fake:  # every destination is "on the device"
        rc = run(args, env, torch.device("cpu"))
        print(
            f"fake device: {fake.copies} copies, {fake.bytes_copied} bytes, {fake.pageable_sources} from pageable "
            f"memory, {fake.pinned_bytes} bytes still pinned",
            flush=True,
        )
        if fake.pageable_sources or fake.pinned_bytes:
            rc = 1
    return rc


def run(args: argparse.Namespace, env: dict[str, Any], dev: Any) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    import asyncload
    from asyncload import LoadOptions

    warnings.filterwarnings("ignore")
    on_gpu = dev.type == "cuda"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="asyncload-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    checks = Checks()
    try:
        say(f"making a ~{args.size_gib:g} GiB bf16 state dict")
        sd = make_state(int(args.size_gib * (1 << 30)), args.hidden)
        total = sum(t.numel() * t.element_size() for t in sd.values())
        paths = {
            "dcp": work / "dcp",
            "safetensors": work / "model.safetensors",
            "torch.save": work / "model.pt",
        }
        dcp.save(sd, checkpoint_id=paths["dcp"], no_dist=True)
        write_safetensors(sd, paths["safetensors"])
        torch.save(sd, paths["torch.save"])
        warm(list(paths.values()))
        say(f"{len(sd)} tensors, {total / (1 << 30):.2f} GiB, written to {work} in 3 formats")

        def zeros(device: torch.device | str) -> dict[str, torch.Tensor]:
            return {k: torch.zeros(v.shape, dtype=v.dtype, device=device) for k, v in sd.items()}

        # --- correctness ---------------------------------------------------------------
        small = LoadOptions(memory_budget=64 << 20, chunk_size=8 << 20, min_chunk_size=1 << 20)
        for fmt, path in paths.items():

            def gpu_equals_cpu(path: Path = path, fmt: str = fmt) -> None:
                cpu = zeros("cpu")
                asyncload.load(cpu, path)
                gpu = zeros(dev)
                stats = asyncload.load(gpu, path)
                for k in sd:
                    same_bits(gpu[k], cpu[k], f"{fmt} {k} gpu vs cpu load")
                    same_bits(gpu[k], sd[k], f"{fmt} {k} gpu vs saved")
                assert stats.bytes_assembled >= total

            checks.run(f"{fmt}: CUDA load == CPU load == saved, bit for bit", gpu_equals_cpu)

            def small_budget(path: Path = path, fmt: str = fmt) -> None:
                gpu = zeros(dev)
                stats = asyncload.load(gpu, path, options=small)
                for k in sd:
                    same_bits(gpu[k], sd[k], f"{fmt} {k} (64 MiB budget)")
                assert stats.peak_buffered_bytes <= small.memory_budget, stats.peak_buffered_bytes

            checks.run(
                f"{fmt}: 64 MiB budget, 8 MiB chunks (ring reused), bit for bit", small_budget
            )

        keys = list(sd)
        big = next(k for k in keys if k.endswith("mlp.up.weight"))
        other = next(k for k in keys if k.endswith("attn.o.weight"))
        norm = next(k for k in keys if k.endswith("ln1.weight"))

        def odd_destinations() -> None:
            for fmt, path in paths.items():
                dest: dict[str, Any] = {
                    k: torch.zeros(v.shape, dtype=v.dtype, device=dev) for k, v in sd.items()
                }
                dest[big] = torch.zeros(
                    sd[big].shape[::-1], dtype=torch.bfloat16, device=dev
                ).t()  # strided view
                dest[other] = torch.zeros(
                    sd[other].shape, dtype=torch.float32, device=dev
                )  # cast on load
                dest[norm] = torch.zeros(sd[norm].shape, dtype=torch.bfloat16)  # stays on CPU
                asyncload.load(dest, path, options=LoadOptions(allow_dtype_cast=True))
                assert not on_gpu or dest[norm].device.type == "cpu"
                same_bits(dest[big].contiguous(), sd[big], f"{fmt} transposed destination")
                same_bits(dest[other], sd[other].float(), f"{fmt} bf16 -> fp32 on load")
                same_bits(dest[norm], sd[norm], f"{fmt} CPU destination in a GPU state dict")

        checks.run("strided, cast and mixed CPU/GPU destinations (3 formats)", odd_destinations)

        def queued_work_first() -> None:
            # work queued on the caller's stream for the destinations must finish before our copies land
            gpu = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in sd.items()}
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued on the current stream
            for t in gpu.values():
                t.fill_(1.0)
            asyncload.load(gpu, paths["safetensors"])
            for k in sd:
                same_bits(gpu[k], sd[k], f"{k} after queued fill_")

        checks.run(
            "destinations with CUDA work still queued on the caller's stream", queued_work_first
        )

        # --- throughput ------------------------------------------------------------------
        from torch.distributed.checkpoint import FileSystemReader

        gpu = zeros(dev)
        cpu = zeros("cpu")

        def sync_copy(src: dict[str, torch.Tensor]) -> None:
            for k, t in gpu.items():
                t.copy_(src[k])
            torch.cuda.synchronize()

        methods: list[tuple[str, Callable[[], Any]]] = []
        for fmt, path in paths.items():
            methods.append(
                (
                    f"asyncload -> cuda ({fmt})",
                    lambda p=path: (asyncload.load(gpu, p), torch.cuda.synchronize()),
                )
            )
            methods.append(
                (
                    f"asyncload -> cpu + copy_ ({fmt})",
                    lambda p=path: (asyncload.load(cpu, p), sync_copy(cpu)),
                )
            )
        methods.append(
            (
                "torch.load + .cuda() (model.pt)",
                lambda: sync_copy(
                    {
                        k: v.to(dev)
                        for k, v in torch.load(paths["torch.save"], weights_only=True).items()
                    }
                ),
            )
        )
        methods.append(
            (
                "torch.load(mmap=True) + .cuda() (model.pt)",
                lambda: sync_copy(
                    {
                        k: v.to(dev)
                        for k, v in torch.load(
                            paths["torch.save"], mmap=True, weights_only=True
                        ).items()
                    }
                ),
            )
        )
        if env.get("safetensors"):
            from safetensors.torch import load_file

            methods.append(
                (
                    "safetensors load_file(device=cuda)",
                    lambda: sync_copy(load_file(str(paths["safetensors"]), device=str(dev))),
                )
            )
        methods.append(
            (
                "dcp.load + FileSystemReader -> cuda",
                lambda: (
                    dcp.load(gpu, storage_reader=FileSystemReader(paths["dcp"]), no_dist=True),
                    torch.cuda.synchronize(),
                ),
            )
        )
        times: dict[str, list[float]] = {name: [] for name, _ in methods}
        say(f"throughput: {len(methods)} methods x {args.rounds} rounds, interleaved")
        for r in range(args.rounds):
            for name, fn in methods:
                torch.cuda.synchronize()
                t = time.perf_counter()
                try:
                    fn()
                except Exception:
                    say(f"method {name} failed:\n{traceback.format_exc()}")
                    times[name].append(float("inf"))
                    continue
                times[name].append(time.perf_counter() - t)
                say(f"round {r + 1}: {name:<44} {times[name][-1]:.3f} s")
        ref = min(times["asyncload -> cuda (safetensors)"])
        lines = [
            (
                f"\n{env.get('device')} | torch {env.get('torch')} | CUDA {env.get('cuda_version')} | "
                f"{env.get('cpus')} CPUs | {total / (1 << 30):.2f} GiB bf16, {len(sd)} tensors, warm page cache"
            ),
            f"{'method':<46} {'best s':>8} {'GiB/s':>7} {'vs asyncload->cuda (st)':>24}",
        ]
        for name, ts in times.items():
            best = min(ts)
            rate = total / best / (1 << 30) if best != float("inf") else 0.0
            lines.append(f"{name:<46} {best:8.3f} {rate:7.2f} {best / ref:23.2f}x")
        print("\n".join(lines), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"{checks.passed} checks passed, {len(checks.failed)} failed: {checks.failed}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
