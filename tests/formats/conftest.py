"""Fixtures of the formats tests: where a checkpoint written by a test is read from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def publish(request: pytest.FixtureRequest) -> Callable[[Path], tuple[str, dict[str, Any] | None]]:
    """``publish(path)`` -> (url, storage_options) of a local file or directory, as it is, or
    uploaded to the loopback S3 server (``@pytest.mark.parametrize("where", WHERE)``)."""
    if request.node.callspec.params["where"] == "local":
        return lambda path: (str(path), None)
    s3 = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("bucket_name")

    def up(path: Path) -> tuple[str, dict[str, Any] | None]:
        if path.is_dir():
            return s3.upload_dir(path, bucket, f"up/{path.name}"), s3.storage_options()
        return s3.put_object(bucket, f"up/{path.name}", path.read_bytes()), s3.storage_options()

    return up
