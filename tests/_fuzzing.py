"""Shared by tests/decoding/test_fuzz.py (hypothesis, bounded) and benchmarks/fuzz_long.py (a longer,
random campaign): seed inputs from real checkpoints, a mutator, and the targets.

A target returns normally or raises one of asyncload's own errors; anything else
escaping it (struct.error, zipfile.BadZipFile, IndexError, RecursionError,
MemoryError...) is a finding.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import random
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

__all__ = ["INTERESTING", "OUR_ERRORS", "TARGETS", "Seeds", "make_seeds", "mutate", "work_bound"]


def work_bound(nbytes: int) -> int:
    """The most units of decoding work (:class:`asyncload.decoding.work.WorkBudget`) that
    ``nbytes`` of input may cost a target: the pickle VM's own limit (2**20 units plus 8 a
    byte) and a unit a byte read, twice over for what the checks of the decoded value add
    (walking it, comparing its chunks). Linear in the input: a check that turned quadratic
    would pass it on inputs of a few kilobytes."""
    return 2 * ((1 << 20) + 9 * nbytes)


#: Values that break parsers: boundaries of 1/2/4/8-byte fields.
INTERESTING = {
    1: [0, 1, 0x7F, 0x80, 0xFF],
    2: [0, 1, 0x7FFF, 0x8000, 0xFFFF],
    4: [0, 1, 22, 46, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF],
    8: [0, 1, (1 << 31), (1 << 32), (1 << 62), (1 << 63) - 1, (1 << 63), (1 << 64) - 1],
}
_OPCODES = [op.code.encode("latin-1") for op in pickletools.opcodes]


class Seeds:
    """Real bytes to start from: DCP records (tensor and object), their data.pkl, .metadata."""

    def __init__(self, records: list[bytes], pickles: list[bytes], metadata: list[bytes]) -> None:
        self.records, self.pickles, self.metadata = records, pickles, metadata


def make_seeds() -> Seeds:
    from asyncload.decoding import StorageRef  # noqa: F401 - asyncload importable

    g = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(16, 8, generator=g),
        "t": torch.randn(4, 6, generator=g).t(),  # saved with its strides
        "h": torch.arange(10, dtype=torch.int16),
        "b": torch.tensor([True, False]),
        "c": torch.randn(3, dtype=torch.complex64, generator=g),
        "e": torch.empty(0, 3),
        "s": torch.tensor(2.5, dtype=torch.bfloat16),
        "opt": {
            "step": 7,
            "lr": 0.25,
            "name": "adam",
            "betas": (0.9, 0.99),
            "ids": [1, 2, 3],
            "tags": {"a", "b"},
            "raw": b"\x00\x01",
            "none": None,
        },
    }
    with tempfile.TemporaryDirectory() as d:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=d, no_dist=True)
        md_bytes = (Path(d) / ".metadata").read_bytes()
        md = pickle.loads(md_bytes)
        records: list[bytes] = []
        for info in md.storage_data.values():
            blob = (Path(d) / info.relative_path).read_bytes()
            records.append(blob[info.offset : info.offset + info.length])
    pickles = []
    for rec in records:
        zf = zipfile.ZipFile(io.BytesIO(rec))
        pickles.append(zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl"))))
    # protocol variants of the metadata, so every opcode family is represented
    metas = [md_bytes] + [pickle.dumps(md, protocol=p) for p in (2, 3, 5)]
    return Seeds(records, pickles, metas)


def mutate(
    rng: random.Random, data: bytes, *, pickle_aware: bool = False, rounds: int | None = None
) -> bytes:
    """A few random edits of ``data``: bit flips, bytes set, boundary integers written over
    fields, cuts, insertions, deletions, duplicated spans, (for pickles) opcodes inserted."""
    b = bytearray(data)
    for _ in range(rounds if rounds is not None else rng.randint(1, 6)):
        n = len(b)
        pos = rng.randrange(n) if n else 0
        kind = rng.randrange(9 if pickle_aware else 8)
        if kind == 0 and n:
            b[pos] ^= 1 << rng.randrange(8)
        elif kind == 1 and n:
            b[pos] = rng.randrange(256)
        elif kind == 2:
            width = rng.choice((1, 2, 4, 8))
            value = rng.choice(INTERESTING[width])
            b[pos : pos + width] = value.to_bytes(width, "little")
        elif kind == 3:
            del b[pos:]
        elif kind == 4:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == 5:
            del b[pos : pos + rng.randint(1, 32)]
        elif kind == 6:
            span = b[pos : pos + rng.randint(1, 64)]
            b[pos:pos] = span * rng.randint(1, 4)
        elif kind == 7 and n > 1:  # swap two spans
            a, c = sorted(rng.sample(range(n), 2))
            ln = rng.randint(1, min(16, n - c))
            b[a : a + ln], b[c : c + ln] = b[c : c + ln], b[a : a + ln]
        elif kind == 8:
            b[pos:pos] = rng.choice(_OPCODES) + bytes(
                rng.randrange(256) for _ in range(rng.randint(0, 8))
            )
    return bytes(b)


# --- targets ------------------------------------------------------------------------


def _parse_record(data: bytes, work: Any = None) -> Any:
    """A DCP record as asyncload reads it: layout, then the tensor's location or the object."""
    from asyncload.decoding import TensorRef
    from asyncload.formats import ByteWindow, materialize, parse_archive, tensor_location

    win = ByteWindow()
    win.add(0, data)
    layout = parse_archive(win, 0, len(data), "fuzz", max_pickle=1 << 20, work=work)
    if isinstance(layout.obj, TensorRef):
        return tensor_location(layout, "x")
    return materialize(layout, win)


def _parse_record_probed(data: bytes, work: Any = None) -> Any:
    """The same through aparse_archive, fetching missing bytes like a remote load does."""
    import asyncio

    from asyncload.formats import ByteWindow, aparse_archive

    async def go() -> Any:
        win = ByteWindow()
        tail = min(len(data), 4096)
        win.add(len(data) - tail, data[len(data) - tail :])

        async def fetch(lo: int, hi: int) -> bytes:
            assert 0 <= lo <= hi <= len(data), (lo, hi)
            return data[lo:hi]

        return await aparse_archive(
            win, 0, len(data), "fuzz", fetch, max_pickle=1 << 20, work=work
        )

    return asyncio.run(go())


def _decode_metadata(data: bytes, work: Any = None) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    from asyncload.decoding import check_metadata, safe_loads

    md = safe_loads(data, what="fuzz/.metadata", check_structure=False, expect=Metadata, work=work)
    check_metadata(md, "fuzz/.metadata", work)
    return md


def _decode_record_pickle(data: bytes, work: Any = None) -> Any:
    from asyncload.decoding import record_globals, safe_loads, storage_persistent_load

    return safe_loads(
        data,
        what="fuzz/data.pkl",
        allowed=record_globals(),
        persistent_load=storage_persistent_load,
        work=work,
    )


#: name -> (function, seed attribute, pickle-aware mutation)
TARGETS: dict[str, tuple[Callable[..., Any], str, bool]] = {
    "record parser (parse_archive + tensor_location/materialize)": (
        _parse_record,
        "records",
        False,
    ),
    "record parser, probed (aparse_archive)": (_parse_record_probed, "records", False),
    "metadata decoder (safe_loads + check_metadata)": (_decode_metadata, "metadata", True),
    "record pickle decoder (safe_loads, record allow-list)": (
        _decode_record_pickle,
        "pickles",
        True,
    ),
}


def OUR_ERRORS() -> tuple[type[BaseException], ...]:
    from asyncload import CheckpointFormatError, UnsafeCheckpointError

    return (CheckpointFormatError, UnsafeCheckpointError)
