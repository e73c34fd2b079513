"""Shared fixtures. Storage servers (S3, GCS, HTTP on loopback) come from asyncload.testing."""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest  # noqa: E402

try:  # the loopback servers' fixtures: s3_server, gcs_server, http_server
    from asyncload.testing.pytest_fixtures import *  # noqa: F401,F403,E402
except ImportError:  # pragma: no cover - only while asyncload.testing is being written
    pass


@pytest.fixture
def tmp_ckpt(tmp_path):
    """A fresh directory for one checkpoint."""
    d = tmp_path / "ckpt"
    return d
