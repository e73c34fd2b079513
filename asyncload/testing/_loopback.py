"""What every loopback server shares: the test environment (:data:`TEST_ENV`,
:func:`configure_env`), free ports, closing fsspec clients, the errors, and
:class:`LoopbackServer`, the base class that runs one server child on a free port of
127.0.0.1, waits until it answers HTTP and stops it by its process id.

Raised: :class:`ServerNotAvailableError` when the server's program is not installed,
:class:`ServerStartError` when the child does not answer in time,
:class:`ServerNotRunningError` for the address of a server that is not started.
"""

from __future__ import annotations

import atexit
import http.client
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, ClassVar

from asyncload.testing._serve import LOOPBACK

if TYPE_CHECKING:
    from typing import Self


logger = logging.getLogger("asyncload.testing")

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

# _serve.py run as a child's script; -P (3.11+) keeps asyncload/testing off sys.path.
_SCRIPT = [
    sys.executable,
    *(["-P"] if sys.version_info >= (3, 11) else []),
    str(Path(__file__).resolve().with_name("_serve.py")),
]


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
                    in_use = (
                        "address already in use" in str(exc).lower()
                        or "eaddrinuse" in str(exc).lower()
                    )
                    self._terminate()
                    last_error = exc
                    if in_use and not self._requested_port:
                        logger.info(
                            "%s: port %d was taken, retrying on another", type(self).__name__, port
                        )
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
                logger.info(
                    "%s started: pid %d, %s", type(self).__name__, self.pid, self.endpoint_url
                )
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
                logger.info(
                    "%s stopped: pid %d exited with %s",
                    type(self).__name__,
                    proc.pid,
                    proc.returncode,
                )

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
            self._workdir = tempfile.TemporaryDirectory(
                prefix=f"asyncload-{type(self).__name__.lower()}-"
            )
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
        state = (
            f"pid={proc.pid} {self.endpoint_url}"
            if proc is not None and self.running and self._port
            else "stopped"
        )
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
        logger.debug(
            "%s: uploaded %d files from %s to %s/%s",
            type(self).__name__,
            count,
            root,
            bucket,
            prefix,
        )
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
                    logger.warning(
                        "%s pid %d ignored SIGTERM; killing it", type(self).__name__, proc.pid
                    )
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
