"""The demo: torch's readers against asyncload, on local disk and from an S3-protocol server.

    bash scripts/demo.sh                    # set-up, then this script with a ~1 GiB checkpoint
    python examples/demo.py [--size-mib 1024] [--server auto|s3rver|moto] [--no-remote]

1. makes a transformer-like state dict (a few large bf16 matrices per layer, many small
   fp32 norms, an fp32 output head, a couple of objects) and saves it with torch's own
   ``dcp.save`` in a temporary directory, as several files (like several ranks' worth);
2. loads it from local disk with torch's ``dcp.load`` + ``FileSystemReader`` and with
   ``asyncload.load`` (warm page cache: the files were just written);
3. starts an S3-protocol server on 127.0.0.1 (Node's s3rver when installed, which serves
   ranged reads fast; otherwise moto), uploads the checkpoint, and loads it with torch's
   ``FsspecReader`` (s3fs) and with ``asyncload.load``;
4. checks every load gave the same bytes, prints a table: seconds, GiB/s, speed-up over
   torch's reader, peak RSS above the destination tensors.

It ends by itself and removes everything it made (server stopped, temporary files deleted),
also on Ctrl-C. Progress bars appear when stderr is a terminal.

Needs: the ``s3`` extra and moto (``pip install "moto[server]"``, in the ``test`` extra) or
Node's npm: with ``node`` and ``npm`` on PATH, the first run installs ``s3rver@3.7.1`` into
``~/.cache/asyncload-s3rver`` (about 14 MB; npm's own download cache goes to ``~/.npm``) and
later runs reuse it; ``--no-install`` never installs, ``--server moto`` uses moto.
"""

from __future__ import annotations

import os
import sys
import warnings

if (
    __name__ == "__main__"
    and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    and sys.platform.startswith("linux")
):
    # glibc raises its mmap threshold after large frees, and then keeps freed buffers in the
    # heap: one loader's garbage would hide the next one's peak RSS. A fixed threshold makes
    # every large buffer go back to the system when freed, so the peaks compare fairly.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

import argparse
import math
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import asyncload
from asyncload.common.stats import _fmt_bytes, _plural
from asyncload.faces.progress import ByteProgress, follow_handle

# torch warns on every single-process dcp.save / dcp.load; this script calls them on purpose
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

GiB = 1 << 30
MiB = 1 << 20


# --- the checkpoint ------------------------------------------------------------------------


def model_shape(size_bytes: int) -> dict[str, int]:
    """Hidden size, MLP width, vocabulary and layer count for a checkpoint of about ``size_bytes``."""
    size_mib = size_bytes / MiB
    hidden = (
        2048 if size_mib >= 512 else 1024 if size_mib >= 128 else 512 if size_mib >= 32 else 256
    )
    ffn = (hidden * 11 // 4) // 64 * 64  # 5632 for 2048, as in a Llama-style MLP
    vocab = 4 * hidden
    per_layer = 8 * hidden * hidden + 6 * hidden * ffn  # q, k, v, o and gate, up, down in bf16
    fixed = 2 * vocab * hidden + 4 * vocab * hidden  # bf16 embedding, fp32 output head
    layers = max(1, round((size_bytes - fixed) / per_layer))
    return {
        "hidden": hidden,
        "ffn": ffn,
        "vocab": vocab,
        "layers": layers,
        "head_dim": 128 if hidden >= 1024 else 64,
    }


def make_state_dict(shape: dict[str, int], seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    h, f, v, hd = shape["hidden"], shape["ffn"], shape["vocab"], shape["head_dim"]
    bf16, fp32 = torch.bfloat16, torch.float32

    def rand(*size: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).to(dtype)

    model: dict[str, Any] = {"embed_tokens.weight": rand(v, h)}
    for i in range(shape["layers"]):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            model[p + f"self_attn.{name}.weight"] = rand(h, h)
            model[p + f"self_attn.{name}.bias"] = rand(h)
        model[p + "self_attn.o_proj.weight"] = rand(h, h)
        model[p + "self_attn.q_norm.weight"] = torch.ones(hd, dtype=fp32)
        model[p + "self_attn.k_norm.weight"] = torch.ones(hd, dtype=fp32)
        model[p + "mlp.gate_proj.weight"] = rand(f, h)
        model[p + "mlp.up_proj.weight"] = rand(f, h)
        model[p + "mlp.down_proj.weight"] = rand(h, f)
        model[p + "input_layernorm.weight"] = 1 + rand(h, dtype=fp32)
        model[p + "post_attention_layernorm.weight"] = 1 + rand(h, dtype=fp32)
    model["norm.weight"] = 1 + rand(h, dtype=fp32)
    model["rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=fp32) / hd))
    model["lm_head.weight"] = rand(v, h, dtype=fp32)
    return {"model": model, "step": 4000, "config": dict(shape)}


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    return sd.numel() * sd.element_size() if isinstance(sd, torch.Tensor) else 0


def differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Keys where ``a`` and ``b`` differ, tensors compared bit for bit."""
    if isinstance(a, dict):
        return [
            d
            for k in a
            for d in differences(a[k], b.get(k) if isinstance(b, dict) else None, f"{prefix}{k}.")
        ]
    if isinstance(a, torch.Tensor):
        same = (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    else:
        same = a == b
    return [] if same else [prefix.rstrip(".")]


def save_checkpoint(sd: dict[str, Any], path: Path, file_size: int) -> list[Path]:
    """``dcp.save`` into files of about ``file_size`` bytes (torch's writer splits by size)."""
    files = max(1, math.ceil(tensor_bytes(sd) / file_size))
    writer = dcp.FileSystemWriter(str(path), thread_count=files)
    dcp.save(sd, storage_writer=writer)
    return sorted(path.iterdir())


# --- measuring ----------------------------------------------------------------------------


class PeakRSS:
    """Peak resident memory of this process during a block, above what it was at the start."""

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self._hwm = _reset_hwm()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        self._hwm = _reset_hwm()
        self.base = _rss()
        self.peak = self.base
        if not self._hwm:  # no resettable high-water mark: sample
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, _rss(), _status("VmHWM") if self._hwm else 0)

    @property
    def above(self) -> int:
        return max(0, self.peak - self.base)


def _status(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss() -> int:
    rss = _status("VmRSS")
    if rss:
        return rss
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return 0


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmHWM") > 0
    except OSError:
        return False


class Row:
    def __init__(
        self, where: str, reader: str, seconds: float, nbytes: int, rss_above: int
    ) -> None:
        self.where, self.reader, self.seconds, self.nbytes, self.rss_above = (
            where,
            reader,
            seconds,
            nbytes,
            rss_above,
        )

    @property
    def rate(self) -> str:
        """Bytes per second in the units of LoadStats' line (KiB, MiB, GiB: binary)."""
        return _fmt_bytes(self.nbytes / self.seconds) + "/s" if self.seconds > 0 else "-"


def run_torch(where: str, reader: Any, dest: dict[str, Any], total: int, name: str) -> Row:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    with ByteProgress(f"{where:<6} {name}", total=total) as bar:
        done = [0]

        class Planner(DefaultLoadPlanner):  # torch's own planner, reporting each tensor it commits
            def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
                done[0] += tensor.numel() * tensor.element_size()
                bar.update(done[0], total)

        with PeakRSS() as rss, Still(f"loading with {name}", bar=True):
            t0 = time.perf_counter()
            dcp.load(dest, storage_reader=reader, planner=Planner(), no_dist=True)
            seconds = time.perf_counter() - t0
    row = Row(where, name, seconds, total, rss.above)
    say(f"  {where:<6} {name:<28} {seconds:7.3f} s  {row.rate}")
    return row


def run_asyncload(
    where: str,
    url: str,
    dest: dict[str, Any],
    total: int,
    storage_options: dict[str, Any] | None = None,
) -> Row:
    with (
        ByteProgress(f"{where:<6} asyncload", total=total) as bar,
        PeakRSS() as rss,
        Still("loading with asyncload", bar=True),
    ):
        handle = asyncload.start_load(dest, url, storage_options=storage_options)
        stats = follow_handle(handle, bar)
    # one time per load: the load's own clock (LoadStats.seconds, from the call to the end of
    # the load), which its line below prints too; timing the wait from here would add up to
    # one polling interval of follow_handle
    row = Row(where, "asyncload", stats.seconds, stats.bytes_assembled, rss.above)
    say(f"  {where:<6} {'asyncload':<28} {stats.seconds:7.3f} s  {row.rate}")
    say(f"         {stats}")
    return row


def say(text: str = "") -> None:
    print(text, flush=True)


class Still:
    """``with Still("saving"):`` says every ``every`` seconds that a step is still running, so
    that no step is silent for long. Steps with a progress bar (``bar=True``) need it only
    where no bar is drawn (stderr not a terminal)."""

    def __init__(self, what: str, *, bar: bool = False, every: float = 10.0) -> None:
        self.what, self.every = what, every
        self.quiet = bar and sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.every):
            say(f"   ... still {self.what} ({time.monotonic() - t0:.0f} s)")

    def __enter__(self) -> Still:
        if not self.quiet:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def machine() -> str:
    """The cores this process may use and the load average: the figures depend on both (a
    busy or shared machine is slower, and its ratios move)."""
    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = cores
    try:
        one, five, fifteen = os.getloadavg()
        load = f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} (1, 5, 15 min)"
    except OSError:
        load = "load average unknown"
    return f"{usable} cores" + (f" (of {cores})" if usable != cores else "") + f", {load}"


def fmt_size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def table(rows: list[Row]) -> str:
    lines = [
        f"{'where':<7}{'reader':<30}{'seconds':>9}{'rate':>14}{'vs torch':>10}{'peak RSS above destination':>29}"
    ]
    base: dict[str, float] = {}
    for r in rows:
        if r.reader.startswith("torch"):
            base[r.where] = r.seconds
        ratio = base[r.where] / r.seconds if r.where in base and r.seconds > 0 else float("nan")
        lines.append(
            f"{r.where:<7}{r.reader:<30}{r.seconds:>9.3f}{r.rate:>14}{ratio:>9.2f}x{fmt_size(r.rss_above):>29}"
        )
    return "\n".join(lines)


# --- the S3 server -------------------------------------------------------------------------


S3RVER_PREFIX = Path.home() / ".cache" / "asyncload-s3rver"


def choose_server(kind: str, install: bool) -> str:
    """``"s3rver"`` or ``"moto"``. For ``auto``: s3rver when installed, or installed now with
    npm into ~/.cache/asyncload-s3rver (``install``); moto otherwise."""
    from asyncload.testing import S3rverServer

    if kind == "moto":
        return "moto"
    found = S3rverServer.find_executable()  # S3RVER_PREFIX is one of the places it looks in
    if found is None and install and shutil.which("npm") and shutil.which("node"):
        say(
            f"   installing s3rver 3.7.1 with npm into {S3RVER_PREFIX} (once; --no-install to skip) ..."
        )
        try:
            with Still("installing s3rver"):
                subprocess.run(
                    [
                        "npm",
                        "install",
                        "--silent",
                        "--no-audit",
                        "--no-fund",
                        "--prefix",
                        str(S3RVER_PREFIX),
                        "s3rver@3.7.1",
                    ],
                    check=True,
                    timeout=600,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            found = str(S3RVER_PREFIX / "node_modules" / ".bin" / "s3rver")
        except (OSError, subprocess.SubprocessError) as exc:
            say(f"   (npm could not install s3rver: {exc}; using moto)")
    if found is not None and shutil.which("node"):
        os.environ.setdefault("ASYNCLOAD_S3RVER", found)
        return "s3rver"
    if kind == "s3rver":
        raise SystemExit(
            "s3rver is not installed and could not be installed (needs Node.js and npm)"
        )
    return "moto"


def start_server(kind: str) -> Any:
    from asyncload.testing import S3rverServer, S3Server, configure_env

    configure_env()  # fake credentials for the loopback server; set before s3fs is imported
    return S3rverServer().start() if kind == "s3rver" else S3Server().start()


def upload(server: Any, files: list[Path], root: Path, bucket: str, prefix: str) -> str:
    total = sum(f.stat().st_size for f in files)
    with ByteProgress("upload", total=total) as bar:
        done = 0
        for f in files:
            server.put_object(bucket, f"{prefix}/{f.relative_to(root).as_posix()}", f.read_bytes())
            done += f.stat().st_size
            bar.update(done, total)
    return server.url(bucket, prefix)


# --- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size-mib", type=int, default=1024, help="checkpoint size, MiB (default 1024)"
    )
    parser.add_argument(
        "--server",
        choices=("auto", "s3rver", "moto"),
        default="auto",
        help="S3-protocol server on loopback (auto: s3rver when installed, else moto)",
    )
    parser.add_argument(
        "--file-mib",
        type=int,
        default=None,
        help="about this many MiB per checkpoint file (default: 64, or 16 with moto, which "
        "reads the whole object for every ranged GET)",
    )
    parser.add_argument("--no-remote", action="store_true", help="only the local comparison")
    parser.add_argument("--no-install", action="store_true", help="never install s3rver with npm")
    args = parser.parse_args(argv)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    before = machine()
    say(f"machine: {before}")
    tmp = Path(tempfile.mkdtemp(prefix="asyncload-demo-"))
    server: Any = None
    rows: list[Row] = []
    try:
        kind = None if args.no_remote else choose_server(args.server, not args.no_install)
        file_mib = args.file_mib or (16 if kind == "moto" else 64)
        shape = model_shape(args.size_mib * MiB)
        say(
            f"1. A transformer-like checkpoint: {shape['layers']} layers, hidden {shape['hidden']}, MLP {shape['ffn']}, "
            f"vocabulary {shape['vocab']} (bf16 matrices, fp32 norms and output head)"
        )
        t0 = time.perf_counter()
        with Still("making tensors"):
            source = make_state_dict(shape)
        total = tensor_bytes(source)
        ckpt = tmp / "step-4000"
        say(
            f"   made {fmt_size(total)} of tensors in {time.perf_counter() - t0:.1f} s; saving ..."
        )
        with Still("saving with dcp.save"):
            files = save_checkpoint(source, ckpt, file_mib * MiB)
        stored = sum(f.stat().st_size for f in files)
        say(
            f"   saved {fmt_size(total)} of tensors with dcp.save into {_plural(len(files) - 1, '.distcp file')} "
            f"({fmt_size(stored)}) in {time.perf_counter() - t0:.1f} s: {ckpt}"
        )
        del source  # every load below is checked against the first one instead

        say("\n2. Local disk (warm page cache), into fresh zero-filled tensors")
        reference = zeros_like_checkpoint(ckpt)
        rows.append(
            run_torch(
                "local",
                dcp.FileSystemReader(str(ckpt)),
                reference,
                total,
                "torch FileSystemReader",
            )
        )
        dest = zeros_like_checkpoint(ckpt)
        rows.append(run_asyncload("local", str(ckpt), dest, total))
        check(reference, dest, "local asyncload")

        if not args.no_remote:
            say("\n3. An S3-protocol server on 127.0.0.1")
            with Still("starting the server"):
                server = start_server(kind)
            say(f"   {type(server).__name__} (pid {server.pid}) at {server.endpoint_url}")
            t0 = time.perf_counter()
            with Still("uploading", bar=True):
                url = upload(server, files, ckpt, "demo", "run7/step-4000")
            say(f"   uploaded to {url} in {time.perf_counter() - t0:.1f} s")
            opts = server.storage_options()
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            zero(dest)
            rows.append(
                run_torch(
                    "s3", FsspecReader(url, **opts), dest, total, "torch FsspecReader (s3fs)"
                )
            )
            check(reference, dest, "s3 torch")
            zero(dest)
            rows.append(run_asyncload("s3", url, dest, total, opts))
            check(reference, dest, "s3 asyncload")
            server.stop()
            server = None

        say("\n4. Results (every load checked bit for bit against the first)")
        say(table(rows))
        say(f"machine: {before} before the run; now {machine().split(', ', 1)[1]}")
        say(
            f"\n{fmt_size(total)} of tensors, {_plural(len(files) - 1, 'file')}; peak RSS is measured above the destination "
            "tensors, which were allocated (and zero-filled) before each load. Seconds: torch's "
            "dcp.load timed around the call; asyncload's LoadStats.seconds (the call to the end "
            "of the load), as its line above says."
        )
        return 0
    except KeyboardInterrupt:
        say("\ninterrupted: cleaning up")
        return 130
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def zeros_like_checkpoint(ckpt: Path) -> dict[str, Any]:
    """The destination a job would have: its model's tensors. Here: zeros shaped like the checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = asyncload.PipelinedReader(ckpt)
    try:
        md = reader.read_metadata()
    finally:
        reader.close()
    return {
        k: torch.zeros(tuple(m.size), dtype=m.properties.dtype)
        if isinstance(m, TensorStorageMetadata)
        else None
        for k, m in md.state_dict_metadata.items()
    }


def zero(sd: dict[str, Any]) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            v.zero_()
        else:
            sd[k] = None


def check(reference: dict[str, Any], got: dict[str, Any], what: str) -> None:
    bad = differences(reference, got)
    if bad:
        raise SystemExit(f"{what}: {len(bad)} keys differ from torch's local load: {bad[:5]}")


if __name__ == "__main__":
    sys.exit(main())
