"""Helpers for the remote-storage tests: a small checkpoint written by ``dcp.save``,
uploaded to each loopback server (behind a FaultProxy), and checks that nothing of a
load is left open afterwards.

Import from a test module as ``from _remote import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from _ckpt import small_state_dict  # re-exported: the remote tests' checkpoint

__all__ = [
    "BACKENDS",
    "Remote",
    "established_to",
    "make_remote",
    "no_unclosed_session_warnings",
    "small_state_dict",
    "wait_closed",
]

#: The three stores, as fixture names.
BACKENDS = ["s3", "gcs", "http"]


@dataclass
class Remote:
    """A checkpoint on a loopback server, reached through ``proxy``."""

    backend: str
    url: str
    storage_options: dict[str, Any]
    proxy: Any
    server: Any


def make_remote(
    request: pytest.FixtureRequest,
    backend: str,
    local_dir: Path,
    bucket: str,
    fault_proxy: Callable[..., Any],
    **proxy_kwargs: Any,
) -> Remote:
    """Upload ``local_dir`` to ``backend``'s session server under ``bucket``; a fresh proxy in front."""
    server = request.getfixturevalue(f"{backend}_server")
    proxy = fault_proxy(server, **proxy_kwargs)
    direct = server.upload_dir(local_dir, bucket, "ckpt")
    if backend == "http":
        return Remote(
            backend,
            server.url(bucket, "ckpt", endpoint_url=proxy.endpoint_url),
            server.storage_options(),
            proxy,
            server,
        )
    return Remote(
        backend, direct, server.storage_options(endpoint_url=proxy.endpoint_url), proxy, server
    )


def established_to(port: int) -> list[Any]:
    """This process's TCP connections to 127.0.0.1:``port`` that are not closed."""
    out = []
    for c in psutil.Process().net_connections(kind="tcp"):
        if (
            c.raddr
            and c.raddr.port == port
            and c.status not in (psutil.CONN_CLOSE, psutil.CONN_TIME_WAIT, psutil.CONN_NONE)
        ):
            out.append(c)
    return out


def wait_closed(port: int, timeout: float = 3.0) -> list[Any]:
    """Poll until no connection to ``port`` is open (a close is seen by the kernel at once,
    but a cancelled request's close may take one loop iteration, and a store's connection
    pool closes on the store's runtime once the store is freed); return what is left. Half
    way, the cyclic garbage collector runs once: a pool that only garbage still holds is
    not a connection the load kept."""
    import time

    start = time.monotonic()
    deadline = start + timeout
    collected = False
    left = established_to(port)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        if not collected and time.monotonic() - start > timeout / 2:
            gc.collect()
            collected = True
        left = established_to(port)
    # CLOSE_WAIT on our side would mean we never closed: report those too
    return left


class no_unclosed_session_warnings:
    """Context manager: fail if aiohttp reports an unclosed session or connector."""

    def __enter__(self) -> no_unclosed_session_warnings:
        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.collect()
        self._cm.__exit__(*exc)
        bad = [str(w.message) for w in self.caught if "Unclosed" in str(w.message)]
        if exc[0] is None:
            assert bad == [], bad
