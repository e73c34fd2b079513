"""The ``asyncload`` command: inspect, load, verify; sizes, storage options, exit codes."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

from asyncload import cli
from asyncload.cli import main, parse_size, parse_storage_options
from asyncload.testing import TEST_ENV, stall

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict:
    """What this module's ``ckpt_path`` holds (the fixture of tests/conftest.py)."""
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "embed": torch.randn(256, 128, generator=g).to(torch.bfloat16),
            "layers": {"0": {"w": torch.randn(128, 512, generator=g), "norm": torch.ones(128)}},
        },
        "ids": torch.arange(10, dtype=torch.int16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "step": 7,
        "tag": "run-7",
    }


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(TEST_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value",
    [
        ("4096", 4096),
        ("16MiB", 16 << 20),
        ("1GiB", 1 << 30),
        ("512KiB", 512 << 10),
        ("1.5GiB", 3 << 29),
        ("16m", 16 << 20),
        ("2G", 2 << 30),
        ("1MB", 1_000_000),
        ("3 kb", 3000),
        ("1TiB", 1 << 40),
        ("7B", 7),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text", ["", "MiB", "16XiB", "-1", "0", "1.5", "0.1KiB", "16 MiB extra", "1e3"]
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_storage_options() -> None:
    got = parse_storage_options(
        [
            "endpoint_url=http://127.0.0.1:9000",
            "anon=true",
            "key=abc",
            "config_kwargs.max_pool_connections=64",
            'client_kwargs={"region_name": "x"}',
            "token=null",
            "name=a=b",
        ]
    )
    assert got == {
        "endpoint_url": "http://127.0.0.1:9000",
        "anon": True,
        "key": "abc",
        "config_kwargs": {"max_pool_connections": 64},
        "client_kwargs": {"region_name": "x"},
        "token": None,
        "name": "a=b",
    }
    for bad in (["novalue"], ["=x"], ["a..b=1"], ["a=1", "a.b=2"]):
        with pytest.raises(ValueError):
            parse_storage_options(bad)


# --- inspect -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_inspect_json(ckpt_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["inspect", str(ckpt_path), "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    keys = {k["key"]: k for k in info["keys"]}
    assert set(keys) == {
        "model.embed",
        "model.layers.0.w",
        "model.layers.0.norm",
        "ids",
        "scalar",
        "step",
        "tag",
    }
    assert keys["model.embed"] == {
        "key": "model.embed",
        "kind": "tensor",
        "dtype": "bfloat16",
        "shape": [256, 128],
        "shards": 1,
        "nbytes": 256 * 128 * 2,
        "stored_bytes": keys["model.embed"]["stored_bytes"],
        "chunks": [{"offsets": [0, 0], "sizes": [256, 128]}],
    }
    assert keys["scalar"]["shape"] == [] and keys["scalar"]["dtype"] == "float64"
    assert keys["ids"]["dtype"] == "int16" and keys["ids"]["nbytes"] == 20
    assert keys["step"]["kind"] == "object" and keys["tag"]["kind"] == "object"
    assert info["tensors"] == 5 and info["objects"] == 2
    assert info["tensor_bytes"] == 256 * 128 * 2 + 128 * 512 * 4 + 128 * 4 + 20 + 8
    assert info["dcp_version"] == "1.0.0" and info["format"] == "dcp"
    files = sorted(p.name for p in ckpt_path.iterdir() if p.suffix == ".distcp")
    assert [f["name"] for f in info["files"]] == files
    assert info["stored_bytes"] == sum(f["bytes"] for f in info["files"])
    assert sum(f["records"] for f in info["files"]) == 7
    assert info["stored_bytes"] <= sum((ckpt_path / f).stat().st_size for f in files)


@pytest.mark.timeout(60)
def test_inspect_text(ckpt_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["inspect", str(ckpt_path)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"checkpoint   {ckpt_path}"
    assert lines[1] == "DCP version  1.0.0"
    assert lines[2].startswith("tensors      5 keys, ")
    row = next(line for line in lines if line.startswith("model.embed "))
    assert row.split() == ["model.embed", "bfloat16", "[256,", "128]", "1", "64.00", "KiB"]
    assert any(line.split()[:3] == ["step", "object", "1"] for line in lines)


# --- load --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_load_prints_stats(ckpt_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        [
            "load",
            str(ckpt_path),
            "--chunk-size",
            "64KiB",
            "--concurrency",
            "3",
            "--budget",
            "256KiB",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    assert out.startswith("Loaded 320.53 KiB in ") and out.count("\n") == 1
    assert "at most" in out and "No retries" in out
    assert "%|" not in err  # no progress bar off a terminal


@pytest.mark.timeout(60)
def test_load_json_reflects_options(ckpt_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        [
            "load",
            str(ckpt_path),
            "--json",
            "--chunk-size",
            "64KiB",
            "--budget",
            "128KiB",
            "--concurrency",
            "1",
            "--verify",
        ],
        capsys,
    )
    assert code == 0, err
    stats = json.loads(out)
    assert stats["bytes_assembled"] == 256 * 128 * 2 + 128 * 512 * 4 + 128 * 4 + 20 + 8
    assert stats["peak_buffered_bytes"] <= 128 << 10
    assert stats["peak_concurrency"] == 1
    assert stats["verified_records"] == 5


def test_over_read_ratio_and_transport_reach_the_options() -> None:
    import argparse

    from asyncload.cli import _options

    opts = _options(argparse.Namespace(max_over_read_ratio=None, transport="fsspec"))
    assert (opts.max_over_read_ratio, opts.transport) == (None, "fsspec")
    opts = _options(argparse.Namespace(max_over_read_ratio=2.0))
    assert (opts.max_over_read_ratio, opts.transport) == (2.0, "auto")


@pytest.mark.timeout(60)
def test_load_compare_torch_local(ckpt_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["load", str(ckpt_path), "--compare-torch", "--no-progress"], capsys)
    assert code == 0, err
    assert "torch FileSystemReader" in out
    assert "Both results are identical bit for bit." in out
    row = next(line for line in out.splitlines() if line.startswith("asyncload "))
    assert row.split()[-1].endswith("x")


@pytest.mark.timeout(120)
def test_load_and_inspect_from_s3(
    ckpt_path: Path, s3_server, bucket_name, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3_server.upload_dir(ckpt_path, bucket_name, "run/ck")
    opts = [
        "--storage-option",
        f"endpoint_url={s3_server.endpoint_url}",
        "-o",
        "key=testing",
        "-o",
        "secret=testing",
        "-o",
        "skip_instance_cache=true",
    ]
    code, out, err = _run(["inspect", url, "--json", *opts], capsys)
    assert code == 0, err
    assert json.loads(out)["tensors"] == 5
    code, out, err = _run(["load", url, "--compare-torch", "--no-progress", *opts], capsys)
    assert code == 0, err
    assert "torch FsspecReader" in out and "Both results are identical bit for bit." in out


# --- verify ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_verify_ok(ckpt_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["verify", str(ckpt_path), "--json"], capsys)
    assert code == 0, err
    res = json.loads(out)
    assert res["ok"] is True and res["tensor_records"] == 5
    assert res["verified_records"] + res["unchecked_records"] == 5
    assert res["verified_records"] == 5
    code, out, _ = _run(["verify", str(ckpt_path)], capsys)
    assert code == 0 and out.startswith("OK: 5 of 5 tensor records match their stored CRC-32")


def _damaged_copy(src: Path, dst: Path, keys: list[str]) -> Path:
    """A copy of ``src`` with one byte flipped in the middle of each key's tensor data."""
    import shutil

    from asyncload.cli import read_metadata

    shutil.copytree(src, dst)
    md = read_metadata(str(dst), {})
    for index, info in md.storage_data.items():
        if index.fqn in keys:
            f = dst / info.relative_path
            data = bytearray(f.read_bytes())
            # the tensor bytes are the end of the record (the zip's last entries are small)
            pos = info.offset + info.length - 1200
            data[pos] ^= 0xFF
            f.write_bytes(bytes(data))
    return dst


@pytest.mark.timeout(60)
def test_verify_reports_every_damaged_key(
    ckpt_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _damaged_copy(ckpt_path, tmp_path / "bad", ["model.embed", "model.layers.0.w"])
    code, out, err = _run(["verify", str(bad), "--no-progress"], capsys)
    assert code == 3, err
    damaged = sorted(
        line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("DAMAGED")
    )
    assert damaged == ["model.embed", "model.layers.0.w"]
    assert "checksum mismatch" in out
    assert out.rstrip().endswith("2 of 7 keys damaged.")
    code, out, _ = _run(["verify", str(bad), "--json", "--no-progress"], capsys)
    assert code == 3
    assert sorted(d["key"] for d in json.loads(out)["damaged"]) == [
        "model.embed",
        "model.layers.0.w",
    ]
    # a plain load with --verify fails with the same status; without it, the damage goes unnoticed
    assert _run(["load", str(bad), "--verify", "--no-progress"], capsys)[0] == 3
    assert _run(["load", str(bad), "--no-progress"], capsys)[0] == 0


@pytest.mark.timeout(60)
def test_verify_missing_data_file_is_damage(
    ckpt_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    bad = tmp_path / "incomplete"
    shutil.copytree(ckpt_path, bad)
    for f in bad.glob("*.distcp"):
        f.unlink()
    code, out, err = _run(["verify", str(bad), "--no-progress"], capsys)
    assert code == 3, err
    assert out.rstrip().endswith("7 of 7 keys damaged.")


# --- errors and exit codes ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_not_found_is_4_and_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for cmd in ("inspect", "load", "verify"):
        code, out, err = _run([cmd, str(tmp_path / "nope")], capsys)
        assert code == 4
        assert out == ""
        assert err.startswith("asyncload: error: ") and err.count("\n") == 1
        assert "does not exist" in err and "Traceback" not in err


@pytest.mark.timeout(60)
def test_debug_shows_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["inspect", str(tmp_path / "nope"), "--debug"], capsys)
    assert code == 4
    assert "Traceback (most recent call last)" in err and "CheckpointNotFoundError" in err


@pytest.mark.timeout(60)
def test_not_a_checkpoint_is_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / ".metadata").write_bytes(b"this is not a pickle")
    code, _, err = _run(["load", str(tmp_path / "junk")], capsys)
    assert code == 3 and err.startswith("asyncload: error: ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["load"],
        ["frobnicate", "x"],
        ["load", "x", "--chunk-size", "12XB"],
        ["load", "x", "--concurrency", "0"],
        ["load", "x", "--timeout", "soon"],
        ["load", "x", "--retries", "-1"],
        ["load", "x", "--max-over-read-ratio", "0.5"],
        ["load", "x", "--max-over-read-ratio", "much"],
        ["load", "x", "--transport", "curl"],
    ],
)
def test_usage_errors_are_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


@pytest.mark.timeout(60)
def test_invalid_option_values_are_2(ckpt_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["load", str(ckpt_path), "--budget", "1KiB"], capsys)
    assert (
        code == 2
        and err == "asyncload: error: --budget 1024 is invalid: must be at least 65536 bytes\n"
    )
    code, _, err = _run(
        ["load", str(ckpt_path), "--chunk-size", "64KiB", "--min-chunk-size", "1MiB"], capsys
    )
    assert code == 2 and "--min-chunk-size" in err
    code, _, err = _run(["inspect", str(ckpt_path), "-o", "novalue"], capsys)
    assert code == 2 and "key=value" in err


@pytest.mark.timeout(60)
def test_storage_error_is_1(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncload.testing import free_port

    port = free_port()  # nothing listens there
    code, _, err = _run(
        [
            "inspect",
            "s3://b/ck",
            "-o",
            f"endpoint_url=http://127.0.0.1:{port}",
            "-o",
            "key=k",
            "-o",
            "secret=s",
        ],
        capsys,
    )
    assert code == 1
    assert err.startswith("asyncload: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_exit_codes_are_documented() -> None:
    assert cli.EXIT_CODES.keys() == {0, 1, 2, 3, 4, 130}
    doc = (REPO / "docs" / "cli.md").read_text()
    for code in cli.EXIT_CODES:
        assert f"| {code} " in doc


# --- the real entry points, a terminal, Ctrl-C --------------------------------------------


@pytest.mark.timeout(120)
def test_entry_points(ckpt_path: Path) -> None:
    script = Path(sys.executable).with_name("asyncload")
    for argv in ([sys.executable, "-m", "asyncload"], [str(script)]):
        res = subprocess.run(
            [*argv, "--version"], capture_output=True, text=True, timeout=60, env=_env()
        )
        assert res.returncode == 0 and res.stdout.strip().startswith("asyncload ")
    res = subprocess.run(
        [sys.executable, "-m", "asyncload", "load", str(ckpt_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Loaded ")
    assert "%|" not in res.stderr and "\r" not in res.stderr  # stderr is a pipe: no progress bar


def _run_in_pty(argv: list[str], timeout: float = 60.0, columns: int = 120) -> tuple[int, str]:
    pid, fd = pty.fork()
    if pid == 0:  # child
        try:
            rows = 24 if columns else 0
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
            os.execve(argv[0], argv, _env())
        finally:
            os._exit(127)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode("utf-8", "replace")


@pytest.mark.timeout(120)
def test_progress_bar_on_a_terminal(ckpt_path: Path) -> None:
    code, text = _run_in_pty(
        [sys.executable, "-m", "asyncload", "load", str(ckpt_path), "--compare-torch"]
    )
    assert code == 0, text
    frames = [f for f in text.replace("\n", "\r").split("\r") if "%|" in f]
    assert any(f.startswith("asyncload: 100%|") and "321k/321k" in f for f in frames), frames
    assert any(f.startswith("torch FileSystemReader: 100%|") for f in frames), frames


@pytest.mark.timeout(120)
def test_ctrl_c_exits_130_and_cleans_up(
    ckpt_path: Path, http_server, fault_proxy, bucket_name
) -> None:
    http_server.upload_dir(ckpt_path, bucket_name, "ck")
    proxy = fault_proxy(http_server)
    # every read of a data file hangs (.metadata, a ranged GET too, goes through)
    proxy.add_rule(stall(), path=".distcp", data_only=True, range_only=True, times=None)
    url = http_server.url(bucket_name, "ck", endpoint_url=proxy.endpoint_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncload", "load", url, "--timeout", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert proxy.wait_for_requests(2, timeout=60)  # the load is under way and stuck
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # and its pipes closed
    assert proc.returncode == 130, err
    assert time.monotonic() - t0 < 15
    assert err.rstrip().endswith("asyncload: interrupted") and "Traceback" not in err
    assert out == ""


@pytest.mark.timeout(60)
def test_other_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    (tmp_path / "st").mkdir()
    save_file(
        {"a": torch.randn(10, 10), "b": torch.ones(3, dtype=torch.bfloat16)},
        str(tmp_path / "st" / "model.safetensors"),
    )
    code, out, err = _run(["inspect", str(tmp_path / "st"), "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert info["format"] == "safetensors"
    assert {k["key"]: (k["dtype"], k["shape"]) for k in info["keys"]} == {
        "a": ("float32", [10, 10]),
        "b": ("bfloat16", [3]),
    }
    code, out, err = _run(["load", str(tmp_path / "st" / "model.safetensors"), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["bytes_assembled"] == 406
    code, _, err = _run(["load", str(tmp_path / "st"), "--compare-torch"], capsys)
    assert code == 2 and "not a DCP one" in err and "Traceback" not in err


# --- claims checked before allocating (issue 11, item 3d) ---------------------------------------


def _forged_8gib(tmp_path: Path) -> Path:
    """A real dcp.save of one 1.6 KiB tensor whose .metadata claims it is 8 GiB."""
    from _ckpt import make_checkpoint
    from _corrupt import mutate_metadata

    path = make_checkpoint(tmp_path / "forged", {"big": torch.arange(400, dtype=torch.float32)})

    def claim(md: object) -> None:
        smd = md.state_dict_metadata["big"]  # type: ignore[attr-defined]
        smd.size = torch.Size([1 << 31])
        smd.chunks[0].sizes = torch.Size([1 << 31])

    mutate_metadata(path, claim)
    assert (path / ".metadata").stat().st_size < 2048
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["load", "verify"])
def test_forged_sizes_are_damage_before_any_allocation(command: str, tmp_path: Path) -> None:
    """The CLI allocates zeros (touched memory) for ``load``: with 2 GiB of address space to
    spare, allocating the 8 GiB claimed would fail in torch, not with the typed error."""
    path = _forged_8gib(tmp_path)
    code = (
        "import resource, sys\n"
        "from asyncload.cli import main\n"
        "vm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:'))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))\n"
        f"sys.exit(main([{command!r}, {str(path)!r}, '--no-progress']))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=_env()
    )
    assert res.returncode == cli.EXIT_DAMAGED, res.stdout + res.stderr
    assert "'big'" in res.stderr + res.stdout and "8589934592 bytes" in res.stderr + res.stdout
    assert "MemoryError" not in res.stderr and "Traceback" not in res.stderr


@pytest.mark.timeout(60)
def test_verify_streams_within_the_budget(
    ckpt_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(["verify", str(ckpt_path), "--budget", "64KiB", "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert info["ok"] and info["verified_records"] == info["tensor_records"] == 5
    # the 256 KiB tensor is read alone; everything else within the 64 KiB budget
    assert info["stats"]["peak_buffered_bytes"] == 128 * 512 * 4


@pytest.mark.timeout(120)
def test_progress_lines_on_a_terminal_with_no_width(ckpt_path: Path) -> None:
    """Issue 44: a terminal that reports 0 columns showed no progress at all (tqdm draws an
    empty bar there); it gets lines of progress instead, the last at 100%."""
    code, text = _run_in_pty(
        [sys.executable, "-m", "asyncload", "load", str(ckpt_path)], columns=0
    )
    assert code == 0, text
    assert "%|" not in text and "\r\r" not in text
    lines = [
        line for line in text.replace("\r\n", "\n").split("\n") if line.startswith("asyncload: ")
    ]
    progress = [line for line in lines if "% " in line]
    assert progress, text
    assert re.fullmatch(
        r"asyncload: 100% 320\.53 KiB of 320\.53 KiB, [\d.]+ [KMG]?i?B/s", progress[-1]
    ), progress


def _drain_pty(master: int, timeout: float = 10.0) -> bytes:
    """Everything the closed slave side wrote: the kernel hands a pty's output to the master
    through a work queue, so one read may see only part of it; read until the master reports
    the slave gone (EIO), with a deadline so a lost byte fails the test instead of hanging it."""
    data = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([master], [], [], left)[0]:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the slave is closed and all it wrote has been read
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(master)
    return bytes(data)


def test_progress_lines_from_byte_progress_on_a_zero_width_pty() -> None:
    """ByteProgress itself: lines at most every ``line_interval`` (0: every update), one more
    when it closes only if it moved since, units of LoadStats; a bar where the width is known."""
    from asyncload.faces.progress import ByteProgress, terminal_width

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    with os.fdopen(slave, "w") as tty:
        assert terminal_width(tty) == 0
        bar = ByteProgress("load", total=3 << 20, file=tty, line_interval=0.0)
        assert bar.lines
        bar.update(1 << 20, 3 << 20)
        bar.update(3 << 20, 3 << 20, retries=1)
        bar.close()
        keys = ByteProgress("keys", total=2, file=tty, unit="key", line_interval=3600.0)
        keys.update(1, 2)  # the first update writes; the next ones wait for the interval
        keys.update(2, 2)
        keys.close()  # moved since its last line: one more
    text = _drain_pty(master).decode()
    lines = text.replace("\r\n", "\n").splitlines()
    assert len(lines) == 4, lines
    assert re.fullmatch(r"load: 33% 1\.00 MiB of 3\.00 MiB, [\d.]+ [KMG]?i?B/s", lines[0])
    assert re.fullmatch(
        r"load: 100% 3\.00 MiB of 3\.00 MiB, [\d.]+ [KMG]?i?B/s, 1 retry", lines[1]
    )
    assert re.fullmatch(r"keys: 50% 1 key of 2 keys, [\d.]+ keys?/s", lines[2])
    assert re.fullmatch(r"keys: 100% 2 keys of 2 keys, [\d.]+ keys?/s", lines[3])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "inspect", "{ck}"],
        ["inspect", "{ck}", "-v"],
        ["-v", "--debug", "-o", "anon=true", "inspect", "{ck}", "--json"],
        ["-o", "anon=true", "load", "{ck}", "--no-progress", "-c", "2"],
    ],
)
def test_options_for_every_command_before_or_after_it(
    ckpt_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    argv = [a.replace("{ck}", str(ckpt_path)) for a in argv]
    code, _out, err = _run(argv, capsys)
    assert code == 0, err
    assert ("asyncload: note: --storage-option is ignored for a local path" in err) == (
        "-o" in argv
    )


def test_options_before_the_command_add_to_those_after_it() -> None:
    args = cli._merge_globals(
        cli._parser().parse_args(
            ["-v", "-o", "a=1", "--debug", "inspect", "URL", "-v", "-o", "b=2"]
        )
    )
    assert (args.verbose, args.debug, args.storage_option) == (2, True, ["a=1", "b=2"])
    assert not any(name.startswith("global_") for name in vars(args))
    args = cli._merge_globals(cli._parser().parse_args(["inspect", "URL"]))
    assert (args.verbose, args.debug, args.storage_option) == (0, False, [])


@pytest.mark.timeout(60)
def test_counts_of_one_are_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    ck = tmp_path / "one"
    dcp.save(
        {"w": torch.arange(6, dtype=torch.float32), "step": 3}, checkpoint_id=ck, no_dist=True
    )
    code, out, err = _run(["inspect", str(ck)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[2].startswith("tensors      1 key, 24 B")
    assert lines[3] == "objects      1 key"
    assert lines[4].startswith("files        2 (.metadata and 1 data file), ")
    code, out, err = _run(["verify", str(ck), "--no-progress"], capsys)
    assert code == 0, err
    assert out.startswith("OK: 1 of 1 tensor record matches its stored CRC-32; 1 object decoded; ")
    assert " in 1 file of " in err
    code, out, err = _run(["load", str(ck), "--no-progress"], capsys)
    assert code == 0, err
    assert "(1 tensor, 1 object)" in err
    assert "1 keys" not in out + err and "1 files" not in out + err
