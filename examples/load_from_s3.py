"""Load a checkpoint from S3 (or any S3-compatible store) with asyncload.

    python examples/load_from_s3.py s3://bucket/prefix/step-4000 [--endpoint-url URL]
    ASYNCLOAD_S3_URL=s3://bucket/prefix/step-4000 python examples/load_from_s3.py
    python examples/load_from_s3.py          # no bucket: a loopback S3 server is started for you

With a URL, credentials come from the usual places (environment, ~/.aws); the state dict
is allocated from the checkpoint's own metadata by ``asyncload.read_state_dict``. S3 is read
through asyncload's own HTTP client by default (``LoadOptions.transport="auto"``;
``"fsspec"`` uses s3fs), the same ``storage_options`` either way. Without a URL, the script starts moto's S3 server on
127.0.0.1, writes a small checkpoint with ``dcp.save``, uploads it, loads it back twice
(into tensors you already have with ``asyncload.load``, and into new ones with
``read_state_dict``) and checks every tensor bit for bit. Set ASYNCLOAD_EXAMPLE_SMALL=1 for a
tiny checkpoint.

Needs: with a URL, the ``s3`` extra (``pip install ".[s3]"``); without one, also moto's server
(``pip install "moto[server]"``, part of the ``test`` extra).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import asyncload

# torch warns on every single-process dcp.save / dcp.load; this script calls them on purpose
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

SMALL = os.environ.get("ASYNCLOAD_EXAMPLE_SMALL") == "1"


OPTIONS = asyncload.LoadOptions(concurrency=32, chunk_size=8 << 20, timeout=30, retries=4)


def load_into(state: dict[str, Any], url: str, storage_options: dict[str, Any]) -> None:
    """Into tensors you already have (a model's state dict): every key must be in the checkpoint."""
    stats = asyncload.load(state, url, options=OPTIONS, storage_options=storage_options)
    print(stats)


def load_new(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """No destination yet: the checkpoint's metadata says what to allocate."""
    return asyncload.read_state_dict(url, options=OPTIONS, storage_options=storage_options)


def with_loopback_server() -> None:
    from asyncload.testing import S3Server  # moto's S3 server: pip install "moto[server]"

    g = torch.Generator().manual_seed(0)
    n = 64 if SMALL else 1024
    saved = {
        f"layers.{i}.{name}": torch.randn(n, n, generator=g).to(dtype)
        for i in range(4)
        for name, dtype in (("w", torch.bfloat16), ("norm", torch.float32))
    }
    saved["step"] = 4000
    with tempfile.TemporaryDirectory(prefix="asyncload-s3-example-") as tmp, S3Server() as s3:
        dcp.save(saved, checkpoint_id=tmp)
        url = s3.upload_dir(tmp, "checkpoints", "run7/step-4000")
        # what you would pass for your own S3-compatible store (or leave out for AWS S3 with
        # credentials from the environment or ~/.aws): the loopback server's made-up keys
        storage_options = {
            "endpoint_url": s3.endpoint_url,
            "key": s3.access_key,
            "secret": s3.secret_key,
        }
        print(f"loopback S3 server at {s3.endpoint_url}; loading {url}")
        state = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in saved.items()
        }
        load_into(state, url, storage_options)
        fresh = load_new(url, storage_options)
    for got in (state, fresh):
        bad = [
            k
            for k, v in saved.items()
            if not (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v)
        ]
        if bad or set(got) != set(saved):
            raise SystemExit(f"loaded values differ for {bad or sorted(set(got) ^ set(saved))}")
    print(f"all {len(saved)} keys identical to what was saved, both ways")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url", nargs="?", help="s3://bucket/prefix of a DCP checkpoint")
    parser.add_argument(
        "--endpoint-url", help="an S3-compatible store's endpoint (MinIO, Ceph, R2...)"
    )
    args = parser.parse_args()
    args.url = args.url or os.environ.get("ASYNCLOAD_S3_URL")
    args.endpoint_url = (
        args.endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if args.url is None:
        with_loopback_server()
        return
    storage_options: dict[str, Any] = {}
    if args.endpoint_url:
        storage_options["endpoint_url"] = args.endpoint_url
    state = load_new(args.url, storage_options)
    print(f"{len(state)} keys loaded")


if __name__ == "__main__":
    main()
