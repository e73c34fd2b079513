"""Load a checkpoint from S3 (or any S3-compatible store) with asyncload.

    python examples/load_from_s3.py s3://bucket/prefix/step-4000 [--endpoint-url URL]
    ASYNCLOAD_S3_URL=s3://bucket/prefix/step-4000 python examples/load_from_s3.py
    python examples/load_from_s3.py          # no bucket: a loopback S3 server is started for you

With a URL, credentials come from the usual places (environment, ~/.aws) through s3fs;
the destination is built from the checkpoint's own metadata. Without one, the script
starts moto's S3 server on 127.0.0.1, writes a small checkpoint with ``dcp.save``,
uploads it, loads it back with ``asyncload.load`` and checks every tensor bit for bit.
Set ASYNCLOAD_EXAMPLE_SMALL=1 for a tiny checkpoint.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import asyncload

# torch warns on every single-process dcp.save / dcp.load; this script calls them on purpose
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

SMALL = os.environ.get("ASYNCLOAD_EXAMPLE_SMALL") == "1"


def zeros_from_metadata(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """A destination for every key of the checkpoint: zeros of the saved shapes and dtypes."""
    reader = asyncload.PipelinedReader(url, storage_options=storage_options)
    try:
        md = reader.read_metadata()
    finally:
        reader.close()
    return {
        k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
        for k, m in md.state_dict_metadata.items()
    }


def load(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    state = zeros_from_metadata(url, storage_options)
    options = asyncload.LoadOptions(concurrency=32, chunk_size=8 << 20, timeout=30, retries=4)
    stats = asyncload.load(state, url, options=options, storage_options=storage_options)
    print(stats)
    return state


def with_loopback_server() -> None:
    from asyncload.testing import S3Server, configure_env

    configure_env()  # fake credentials for the loopback server, set before s3fs is used
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
        # what you would pass for a real S3-compatible store: endpoint_url, key, secret...
        storage_options = s3.storage_options()
        print(f"loopback S3 server at {s3.endpoint_url}; loading {url}")
        state = load(url, storage_options)
    bad = [
        k for k, v in saved.items() if not (torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v)
    ]
    if bad:
        raise SystemExit(f"loaded values differ for {bad}")
    print(f"all {len(saved)} keys identical to what was saved")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", nargs="?", help="s3://bucket/prefix of a DCP checkpoint")
    parser.add_argument("--endpoint-url", help="an S3-compatible store's endpoint (MinIO, Ceph, R2...)")
    args = parser.parse_args()
    args.url = args.url or os.environ.get("ASYNCLOAD_S3_URL")
    args.endpoint_url = args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if args.url is None:
        with_loopback_server()
        return
    storage_options: dict[str, Any] = {"config_kwargs": {"max_pool_connections": 64}}  # s3fs's default pool is 10
    if args.endpoint_url:
        storage_options["endpoint_url"] = args.endpoint_url
    load(args.url, storage_options)


if __name__ == "__main__":
    main()
