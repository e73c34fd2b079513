"""What a checkpoint says, printed by the CLI (issue 25, item 7): key names with ESC, BEL,
CR, LF, a bidi override or a lone surrogate are escaped in every human-readable line of
``inspect`` and ``verify`` (no forged line, no terminal title change), and come back
exact in ``--json``; ``verify`` of a checkpoint damaged in every key decodes ``.metadata``
once per run, not once per key.

Checkpoints are real ``dcp.save`` outputs; the CLI runs in-process through ``main``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncload.formats
from asyncload.cli import EXIT_DAMAGED, main

pytestmark = pytest.mark.timeout(120)

TITLE = "evil\x1b]0;owned\x07"  # sets the terminal's title
FORGED = "w\r\nOK: 5 of 5 tensor records match"  # a forged line
BIDI = "bidi\u202eexe.txt"
SURROGATE = "half\udc80"
HOSTILE = [TITLE, FORGED, BIDI, SURROGATE]
RAW = ["\x1b", "\x07", "\r", "\u202e", "\udc80"]


def _save(path: Path, sd: dict[str, Any]) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    return _save(
        tmp_path / "ck",
        {k: torch.full((4,), float(i)) for i, k in enumerate(HOSTILE)} | {"plain": 1},
    )


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_escaped(text: str) -> None:
    for ch in RAW:
        assert ch not in text, (ch, text)
    assert not any(line.startswith("OK: ") for line in text.split("\n"))
    assert "evil\\x1b]0;owned\\x07" in text or "'evil\\x1b]0;owned\\x07'" in text


def test_inspect_escapes_keys(hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["inspect", str(hostile)], capsys)
    assert code == 0, err
    _assert_escaped(out + err)
    rows = [
        line.split()[0]
        for line in out.split("\n")
        if line.startswith(("evil", "w\\x0d", "bidi", "half"))
    ]
    assert sorted(rows) == sorted(
        ["evil\\x1b]0;owned\\x07", "w\\x0d\\x0aOK:", "bidi\\u202eexe.txt", "half\\udc80"]
    )


def test_inspect_json_is_exact(hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["inspect", str(hostile), "--json"], capsys)
    assert code == 0, err
    for ch in RAW:
        assert ch not in out
    keys = {k["key"] for k in json.loads(out)["keys"]}
    assert keys == {*HOSTILE, "plain"}


def test_verify_escapes_keys_and_messages(
    hostile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for f in hostile.glob("*.distcp"):
        f.unlink()
    code, out, err = _run(["verify", str(hostile), "--no-progress"], capsys)
    assert code == EXIT_DAMAGED, err
    _assert_escaped(out + err)
    damaged = [line for line in out.split("\n") if line.startswith("DAMAGED  ")]
    assert len(damaged) == 5
    assert any(
        line.startswith("DAMAGED  w\\x0d\\x0aOK: 5 of 5 tensor records match: ")
        for line in damaged
    )
    assert out.rstrip().endswith("5 of 5 keys damaged.")
    code, out, _ = _run(["verify", str(hostile), "--no-progress", "--json"], capsys)
    assert code == EXIT_DAMAGED
    assert {d["key"] for d in json.loads(out)["damaged"]} == {*HOSTILE, "plain"}


def test_verify_decodes_the_metadata_once_per_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 keys, every one damaged (the data file is gone): one decode, not 201."""
    ckpt = _save(tmp_path / "many", {f"k{i:03d}": torch.full((2,), float(i)) for i in range(200)})
    for f in ckpt.glob("*.distcp"):
        f.unlink()
    real = asyncload.formats.decode_metadata
    calls: list[str] = []

    def counting(raw: Any, url: str, **kwargs: Any) -> Any:
        calls.append(url)
        return real(raw, url, **kwargs)

    monkeypatch.setattr(asyncload.formats, "decode_metadata", counting)
    code, out, err = _run(["verify", str(ckpt), "--no-progress"], capsys)
    assert code == EXIT_DAMAGED, err
    assert out.rstrip().endswith("200 of 200 keys damaged.")
    assert calls == [str(ckpt / ".metadata")]
