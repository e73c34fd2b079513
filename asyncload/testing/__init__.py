"""Test helpers for asyncload: real storage servers on 127.0.0.1 and a fault proxy.

* :mod:`asyncload.testing.servers` - :class:`S3Server` (moto), :class:`GCSServer`
  (fake-gcs-server), :class:`HTTPRangeServer` (aiohttp, exact ``Range``),
  :class:`NginxServer` (Debian's nginx, gzip on), optional :class:`S3rverServer` (Node s3rver), and :func:`configure_env`
  (call it before importing s3fs/gcsfs).
* :mod:`asyncload.testing.faults` - :class:`FaultProxy`, an HTTP/1.1 proxy that
  delays, fails, resets, truncates, stalls or slows chosen requests.
* :mod:`asyncload.testing.delay_line` - :class:`~asyncload.testing.delay_line.DelayLine`, a
  TCP forwarder that delivers each piece a fixed delay after it arrived, both ways (a queueing
  delay, bandwidth uncapped); also ``python -m asyncload.testing.delay_line``, so not
  imported by this package.
* :mod:`asyncload.testing.cuda` - :func:`fake_device` and its :class:`FakeCopier`: CPU
  tensors take the CUDA destinations' device path (pinned ring, side stream, events).
* :mod:`asyncload.testing.interrupts` - :func:`interrupted`: a KeyboardInterrupt raised
  before a chosen line (a trace function), to try a Ctrl-C at every line of a sync face.
* :mod:`asyncload.testing.pytest_fixtures` - session fixtures ``s3_server``,
  ``gcs_server``, ``http_server`` and the ``fault_proxy`` factory
  (``from asyncload.testing.pytest_fixtures import *`` in a conftest).

Nothing here talks to anything but 127.0.0.1, and the library never imports this package.
"""

from __future__ import annotations

from asyncload.testing.cuda import FakeCopier, fake_device
from asyncload.testing.faults import (
    Action,
    Delay,
    FaultProxy,
    FaultProxyError,
    LogEntry,
    Overlong,
    Reset,
    Rule,
    ShiftRange,
    Stall,
    Status,
    Trailing,
    Trickle,
    Truncate,
    delay,
    overlong,
    reset,
    shift_range,
    stall,
    status,
    trailing,
    trickle,
    truncate,
)
from asyncload.testing.servers import (
    LOOPBACK,
    TEST_ENV,
    GCSServer,
    HTTPRangeServer,
    LoopbackServer,
    NginxServer,
    RangeNotSatisfiable,
    S3rverServer,
    S3Server,
    ServerError,
    ServerNotAvailableError,
    ServerNotRunningError,
    ServerStartError,
    SigningS3Server,
    aclose_filesystem,
    close_filesystem,
    configure_env,
    free_port,
    parse_byte_range,
)

__all__ = [
    "LOOPBACK",
    "TEST_ENV",
    "Action",
    "Delay",
    "FakeCopier",
    "FaultProxy",
    "FaultProxyError",
    "GCSServer",
    "HTTPRangeServer",
    "LogEntry",
    "LoopbackServer",
    "NginxServer",
    "Overlong",
    "RangeNotSatisfiable",
    "Reset",
    "Rule",
    "S3Server",
    "S3rverServer",
    "ServerError",
    "ServerNotAvailableError",
    "ServerNotRunningError",
    "ServerStartError",
    "ShiftRange",
    "SigningS3Server",
    "Stall",
    "Status",
    "Trailing",
    "Trickle",
    "Truncate",
    "aclose_filesystem",
    "close_filesystem",
    "configure_env",
    "delay",
    "fake_device",
    "free_port",
    "overlong",
    "parse_byte_range",
    "reset",
    "shift_range",
    "stall",
    "status",
    "trailing",
    "trickle",
    "truncate",
]
