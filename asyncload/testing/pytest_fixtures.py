"""pytest fixtures starting real loopback storage servers once per session.

Use them from a conftest (importing this module also calls
:func:`~asyncload.testing.servers.configure_env`, so it must come before any
``import gcsfs``)::

    from asyncload.testing.pytest_fixtures import *  # noqa: F401,F403

Fixtures:

``s3_server`` (session) -> :class:`~asyncload.testing.servers.S3Server`
    moto's S3 server, started on first use and stopped at the end of the
    session. ``s3_server.storage_options()`` gives the s3fs options,
    ``s3_server.upload_dir(local_dir, bucket, prefix)`` returns
    ``s3://bucket/prefix``. Buckets persist for the whole session: use the
    ``bucket_name`` fixture (or ``s3_server.reset()``) to keep tests apart.
``gcs_server`` (session) -> :class:`~asyncload.testing.servers.GCSServer`
    fake-gcs-server; ``storage_options()`` for gcsfs; urls ``gs://bucket/...``.
``http_server`` (session) -> :class:`~asyncload.testing.servers.HTTPRangeServer`
    serves a session temporary directory with exact ``Range`` support;
    ``upload_dir`` returns ``http://127.0.0.1:P/bucket/prefix``.
``fault_proxy`` (function) -> ``make(upstream, **kwargs) -> FaultProxy``
    a factory: ``proxy = fault_proxy(s3_server)`` starts a
    :class:`~asyncload.testing.faults.FaultProxy` in front of a server (or an
    ``http://127.0.0.1:P`` url; keyword arguments go to ``FaultProxy``); every
    proxy made is stopped when the test ends.
``bucket_name`` (function) -> str
    a bucket name unique to the test (``t-<n>-<test name>``, lowercase, <= 63 chars).

A server whose program is not installed makes the tests that use it skip
(:class:`~asyncload.testing.servers.ServerNotAvailableError`); one that is
installed but does not start fails them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from asyncload.testing.faults import FaultProxy
from asyncload.testing.servers import (
    GCSServer,
    HTTPRangeServer,
    LoopbackServer,
    S3Server,
    ServerNotAvailableError,
    configure_env,
)

__all__ = ["bucket_name", "fault_proxy", "gcs_server", "http_server", "s3_server"]

configure_env()

_S = TypeVar("_S", bound=LoopbackServer)
_bucket_ids = itertools.count(1)


def _serve(server: _S) -> Iterator[_S]:
    try:
        server.start()
    except ServerNotAvailableError as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto S3 server for the whole session (see the module docstring)."""
    yield from _serve(S3Server())


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    """fake-gcs-server for the whole session (see the module docstring)."""
    yield from _serve(GCSServer())


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPRangeServer]:
    """Range-capable HTTP server of a session temporary directory."""
    yield from _serve(HTTPRangeServer(tmp_path_factory.mktemp("http-root")))


@pytest.fixture
def fault_proxy() -> Iterator[Callable[..., FaultProxy]]:
    """Factory of started FaultProxy objects, all stopped when the test ends."""
    made: list[FaultProxy] = []

    def make(upstream: Any, **kwargs: Any) -> FaultProxy:
        proxy = FaultProxy(upstream, **kwargs).start()
        made.append(proxy)
        return proxy

    try:
        yield make
    finally:
        for proxy in reversed(made):
            proxy.stop()


@pytest.fixture
def bucket_name(request: pytest.FixtureRequest) -> str:
    """A valid bucket name unique to this test."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")
    return f"t-{next(_bucket_ids)}-{stem}"[:63].rstrip("-")
