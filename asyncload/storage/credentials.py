"""Credentials that come from another host, for the wire transport (:mod:`asyncload.storage.wire`).

Two sources, each behind the same small interface (:class:`RequestAuth`: the headers that
authorize one request):

* :class:`AwsChain`: botocore's credential chain (a profile, SSO, ``credential_process``, web
  identity through STS, a container credentials endpoint, the instance metadata service),
  used when no static key and secret are given. Each request is signed with a frozen set
  (:class:`asyncload.storage.sigv4.SigV4`).
* :class:`GoogleToken`: an OAuth access token from google-auth for GCS (gcsfs' ``token=``
  forms: a service-account or user key file's path, its dict, ``"google_default"``,
  ``"cloud"`` or ``None`` for application default credentials), sent as
  ``Authorization: Bearer``.

Resolving and refreshing ask another host (blocking HTTP in botocore and google-auth), so they
run in the executor, one at a time, shared by the requests that wait for them; a request whose
credentials are still fresh is signed on the event loop without a thread hop. botocore and
google-auth are imported there, on first use, not at import time.

A source that fails raises :class:`CredentialSourceError`, naming the store and the source and
never a secret (the error boundary reports it as a ``StorageReadError`` about credentials,
without retrying: :mod:`asyncload.storage.classify`). The headers made go to the checkpoint's
origin only: the wire transport refuses a redirect to another origin before sending anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from asyncload.storage.sigv4 import SigV4

__all__ = [
    "GCS_READ_SCOPE",
    "AwsChain",
    "CredentialSourceError",
    "GoogleToken",
    "NoCredentialsFoundError",
    "RequestAuth",
    "aio_credentials_or_none_found",
    "botocore_available",
    "google_auth_available",
]

log = logging.getLogger("asyncload.storage")

#: The OAuth scope a read needs.
GCS_READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
#: Runs that look like a key, a secret or a token: never put in a message.
_SECRETISH = re.compile(r"[A-Za-z0-9+/=_\-.]{32,}")


class CredentialSourceError(OSError):
    """Raised by a :class:`RequestAuth` when its source of credentials (an instance metadata
    service, STS, a token endpoint, a key file) gave none or failed: the message names the
    store and the source, never a secret. Not worth a retry of the read (the source's own
    client retried)."""

    def __init__(self, store: str, source: str, why: str) -> None:
        self.store, self.source = store, source
        super().__init__(f"{store}: no credentials from {source}: {_scrub(why)}")


class NoCredentialsFoundError(CredentialSourceError):
    """Raised by :class:`AwsChain` when no source of botocore's chain held credentials: the
    message says so, lists where it looked (variables, profile, SSO, web identity, container,
    instance metadata, each with what it found) and how to give credentials."""

    def __init__(self, store: str, looked: list[str]) -> None:
        self.store, self.source, self.looked = store, "any source", list(looked)
        OSError.__init__(
            self,
            f"{store}: no AWS credentials were found (give storage_options key=/secret=, "
            f"a profile, or anon=True for a public bucket); looked in: {'; '.join(looked)}",
        )


def _scrub(text: str) -> str:
    """``text`` without anything that looks like a key, a secret or a token, shortened."""
    return _SECRETISH.sub("<redacted>", text)[:400]


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def botocore_available() -> bool:
    """Whether botocore can be imported (the ``s3`` extra)."""
    try:
        import botocore.session  # noqa: F401
    except ImportError:
        return False
    return True


def google_auth_available() -> bool:
    """Whether google-auth (with its ``requests`` transport) can be imported (the ``gcs``
    extra)."""
    try:
        import google.auth
        import google.auth.transport.requests  # noqa: F401
    except ImportError:
        return False
    return True


class RequestAuth:
    """The headers that authorize one request, from credentials fetched (and refreshed) in
    ``executor`` (``None``: the loop's default executor). ``source`` says where they come from
    (for messages); nothing secret is in ``repr``."""

    source = "credentials"

    def __init__(self, store: str, executor: concurrent.futures.Executor | None = None) -> None:
        self.store = store
        self._executor = executor
        #: the fetch or refresh in flight (shared by every request waiting for it)
        self._pending: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.store} from {self.source}>"

    async def headers(self, method: str, host: str, path: str, query: str) -> dict[str, str]:
        """The headers to add to a request to ``host`` (as sent in ``Host``) for ``path``
        (URI-encoded) and ``query``.

        Raised: :class:`CredentialSourceError`."""
        if self._stale():
            await self._refresh()
        return self._sign(method, host, path, query)

    async def _refresh(self) -> None:
        pending = self._pending
        if pending is None or pending.done():
            loop = asyncio.get_running_loop()
            pending = self._pending = asyncio.ensure_future(
                loop.run_in_executor(self._executor, self._fetch)
            )
        # a waiter's cancel leaves the shared fetch to the others
        await asyncio.shield(pending)

    # a source's own part
    def _stale(self) -> bool:
        """Whether the credentials must be fetched or refreshed first (on the loop: no I/O)."""
        raise NotImplementedError

    def _fetch(self) -> None:
        """Fetch or refresh the credentials (in the executor; blocking I/O)."""
        raise NotImplementedError

    def _sign(self, method: str, host: str, path: str, query: str) -> dict[str, str]:
        raise NotImplementedError


class AwsChain(RequestAuth):
    """botocore's credential chain for S3 (``profile``: a named profile, else botocore's
    order: environment, web identity, SSO, shared files, ``credential_process``, container
    endpoint, instance metadata), signed with SigV4 for ``region``; ``request_payer`` signs
    ``x-amz-request-payer: requester``."""

    def __init__(
        self,
        store: str,
        region: str,
        *,
        profile: str | None = None,
        request_payer: bool = False,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        super().__init__(store, executor)
        self.region, self.profile, self.request_payer = region, profile, request_payer
        self.source = _aws_source(profile)
        #: botocore's credentials object (refreshable or not), once resolved
        self._creds: Any = None
        #: the frozen set the requests are signed with until a refresh is needed
        self._signer: SigV4 | None = None

    def _stale(self) -> bool:
        if self._signer is None:
            return True
        needed = getattr(self._creds, "refresh_needed", None)
        return bool(needed()) if needed is not None else False

    def _fetch(self) -> None:
        try:
            if self._creds is None:
                import botocore.session

                session = botocore.session.Session(profile=self.profile)
                imds = _ask_imds_once(session)
                creds = session.get_credentials()
                if creds is None:
                    raise NoCredentialsFoundError(self.store, _looked(self.profile, imds))
                self._creds = creds
                self.source = _AWS_METHODS.get(str(getattr(creds, "method", "")), self.source)
            frozen = self._creds.get_frozen_credentials()
        except CredentialSourceError:
            raise
        except Exception as exc:  # botocore's errors, and its RuntimeError for expired ones
            raise CredentialSourceError(self.store, self.source, _why(exc)) from None
        if not (frozen.access_key and frozen.secret_key):
            raise CredentialSourceError(self.store, self.source, "an incomplete key pair")
        self._signer = SigV4(
            frozen.access_key,
            frozen.secret_key,
            self.region,
            frozen.token,
            request_payer=self.request_payer,
        )

    def _sign(self, method: str, host: str, path: str, query: str) -> dict[str, str]:
        assert self._signer is not None  # set by _fetch before any signing
        return self._signer.sign(method, host, path, query)


#: botocore's ``Credentials.method`` -> the source, in words.
_AWS_METHODS = {
    "env": "the AWS_* environment",
    "shared-credentials-file": "the shared credentials file",
    "config-file": "the AWS config file",
    "assume-role": "a role assumed through STS (AssumeRole)",
    "assume-role-with-web-identity": "web identity (STS AssumeRoleWithWebIdentity)",
    "sso": "AWS SSO (IAM Identity Center)",
    "custom-process": "a credential_process",
    "container-role": "the container credentials endpoint",
    "iam-role": "the instance metadata service (an instance role)",
}


def _ask_imds_once(session: Any) -> dict[str, Any]:
    """Make the instance metadata service of botocore's chain in ``session`` be asked at most
    once per retrieval: botocore asks for an IMDSv2 token, then (its answer timed out or was
    refused) asks again without one, each time with its short default timeout (1 s); here a
    request after one of the same retrieval that failed to connect or timed out fails at once
    with the same error (a later refresh, which begins with a token request, asks afresh).
    Returns what happened (``"error"``: the exception, ``"status"``: the last HTTP status), for
    the message; an empty record when botocore's internals are not as expected (then
    botocore's own behaviour stands)."""
    seen: dict[str, Any] = {"asked": 0, "error": None, "status": None}
    try:
        provider = session.get_component("credential_provider").get_provider("iam-role")
        http = provider._role_fetcher._session
        send = http.send
    except Exception:  # another botocore: leave its chain as it is
        return seen

    def once(request: Any) -> Any:
        if str(getattr(request, "method", "")).upper() == "PUT":
            seen["error"] = None  # a token request begins each retrieval (and each refresh)
        elif seen["error"] is not None:
            raise seen["error"]
        seen["asked"] += 1
        try:
            answer = send(request)
        except Exception as exc:
            seen["error"] = exc
            raise
        seen["status"] = answer.status_code
        return answer

    http.send = once
    return seen


async def aio_credentials_or_none_found(session: Any, store: str) -> None:
    """Resolve the credentials of aiobotocore ``session`` (s3fs' session, for the fsspec
    transport) before s3fs makes its client, asking the instance metadata service at most once
    (as :func:`_ask_imds_once` does for botocore): found, they stay cached in ``session`` for
    s3fs' client; none anywhere raises :class:`NoCredentialsFoundError` listing where the chain
    looked, instead of an unsigned request failing later with botocore's bare message."""
    imds = _aio_ask_imds_once(session)
    try:
        creds = await session.get_credentials()
    except Exception as exc:  # a broken profile, an STS refusal, ...
        raise CredentialSourceError(store, _aws_source(None), _why(exc)) from None
    if creds is None:
        raise NoCredentialsFoundError(store, _looked(None, imds))


def _aio_ask_imds_once(session: Any) -> dict[str, Any]:
    """:func:`_ask_imds_once` for an aiobotocore session: its instance metadata fetcher's HTTP
    session answers a request after a failed one of the same retrieval with the same error at
    once. Installed once per session; returns the record (empty when aiobotocore's internals
    are not as expected: then its own behaviour stands)."""
    seen: dict[str, Any] = {"asked": 0, "error": None, "status": None}
    try:
        provider = session.get_component("credential_provider").get_provider("iam-role")
        fetcher = provider._role_fetcher
        shared = fetcher._session
        acquire = shared.acquire
    except Exception:  # another aiobotocore: leave its chain as it is
        return seen
    installed = getattr(fetcher, "_asyncload_imds", None)
    if installed is not None:
        return installed
    fetcher._asyncload_imds = seen

    class _Once:
        def __init__(self, http: Any) -> None:
            self._http = http

        def __getattr__(self, name: str) -> Any:
            return getattr(self._http, name)

        async def send(self, request: Any) -> Any:
            if str(getattr(request, "method", "")).upper() == "PUT":
                seen["error"] = None  # a token request begins each retrieval
            elif seen["error"] is not None:
                raise seen["error"]
            seen["asked"] += 1
            try:
                answer = await self._http.send(request)
            except Exception as exc:
                seen["error"] = exc
                raise
            seen["status"] = getattr(answer, "status_code", None)
            return answer

    @contextlib.asynccontextmanager
    async def once() -> Any:
        async with acquire() as http:
            yield _Once(http)

    shared.acquire = once
    return seen


def _looked(profile: str | None, imds: Mapping[str, Any]) -> list[str]:
    """Where botocore's chain looked for credentials and found none, in words."""
    env = os.environ

    def state(*names: str) -> str:
        given = [n for n in names if env.get(n)]
        return f"{', '.join(given)} set" if given else "unset"

    name = profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    files = (
        env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials",
        env.get("AWS_CONFIG_FILE") or "~/.aws/config",
    )
    where = (env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or "http://169.254.169.254").rstrip("/")
    if (env.get("AWS_EC2_METADATA_DISABLED") or "").lower() == "true":
        metadata = "off (AWS_EC2_METADATA_DISABLED=true)"
    elif imds.get("error") is not None:
        metadata = f"no answer: {type(imds['error']).__name__}, asked once"
    elif imds.get("status") is not None:
        metadata = f"HTTP {imds['status']}, no instance role"
    else:
        metadata = "no instance role"
    keys = state("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    web = state("AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE")
    container = state(
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"
    )
    return [
        f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY ({keys})",
        f"profile {name!r} in {files[0]}, {files[1]} (none)",
        "SSO (none in the profile)",
        f"web identity (AWS_ROLE_ARN, AWS_WEB_IDENTITY_TOKEN_FILE {web})",
        f"container (AWS_CONTAINER_CREDENTIALS_* {container})",
        f"instance metadata at {where} ({metadata})",
    ]


def _aws_source(profile: str | None) -> str:
    """Where botocore's chain will most likely find credentials, in words (before it runs)."""
    env = os.environ
    if profile:
        return f"the AWS profile {profile!r}"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and env.get("AWS_ROLE_ARN"):
        sts = env.get("AWS_ENDPOINT_URL_STS") or env.get("AWS_ENDPOINT_URL") or "AWS STS"
        return f"web identity (STS AssumeRoleWithWebIdentity at {sts})"
    if env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI") or env.get(
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"
    ):
        return "the container credentials endpoint"
    if env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE"):
        return f"the AWS profile {env.get('AWS_PROFILE') or env.get('AWS_DEFAULT_PROFILE')!r}"
    if (env.get("AWS_EC2_METADATA_DISABLED") or "").lower() != "true":
        where = env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or "http://169.254.169.254"
        return f"the instance metadata service at {where.rstrip('/')} (an instance role)"
    return "botocore's credential chain (environment, profiles, web identity, containers)"


class GoogleToken(RequestAuth):
    """An OAuth access token from google-auth for GCS, as gcsfs' ``token=``: a key file's
    path, its dict, a google-auth credentials object, ``"google_default"`` or ``"cloud"``
    (application default credentials), or ``None`` (application default credentials, else
    anonymous, as gcsfs falls back)."""

    def __init__(
        self,
        store: str,
        token: Any,
        *,
        scopes: tuple[str, ...] = (GCS_READ_SCOPE,),
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        super().__init__(store, executor)
        self._token, self._scopes = token, list(scopes)
        if token is None or token in ("google_default", "cloud"):
            self.source = "Google application default credentials"
        elif isinstance(token, str):
            self.source = f"the key file {token!r}"
        elif isinstance(token, Mapping):
            self.source = "the key given as token="
        else:
            self.source = "the google-auth credentials given as token="
        #: google-auth's credentials once loaded; None with ``_anonymous`` set: none found
        self._creds: Any = None
        self._anonymous = False

    def _stale(self) -> bool:
        if self._anonymous:
            return False
        return self._creds is None or not self._creds.valid

    def _fetch(self) -> None:
        try:
            import google.auth
            import google.auth.exceptions
            import google.auth.transport.requests

            if self._creds is None:
                self._creds = self._load(google.auth)
                if self._creds is None:
                    return
            if not self._creds.valid:
                self._creds.refresh(google.auth.transport.requests.Request())
        except CredentialSourceError:
            raise
        except Exception as exc:  # google-auth's errors (RefreshError, DefaultCredentialsError)
            raise CredentialSourceError(self.store, self.source, _why(exc)) from None
        if not self._creds.token:
            raise CredentialSourceError(self.store, self.source, "no access token was issued")

    def _load(self, google_auth: Any) -> Any:
        token = self._token
        if token is None or token in ("google_default", "cloud"):
            try:
                creds, _ = google_auth.default(scopes=self._scopes)
            except google_auth.exceptions.DefaultCredentialsError:
                if token is not None:
                    raise
                # gcsfs' token=None: application default credentials, else anonymous
                log.debug("%s: no application default credentials, reading anonymously", self)
                self._anonymous = True
                return None
            return creds
        if not isinstance(token, (str, Mapping)):
            return token  # a google-auth credentials object
        if isinstance(token, str):
            with open(os.path.expanduser(token), encoding="utf-8") as f:
                info = json.load(f)
        else:
            info = dict(token)
        kind = info.get("type") if isinstance(info, dict) else None
        if kind == "service_account":
            from google.oauth2 import service_account

            return service_account.Credentials.from_service_account_info(info, scopes=self._scopes)
        if kind == "authorized_user":
            from google.oauth2 import credentials

            return credentials.Credentials.from_authorized_user_info(info, scopes=self._scopes)
        raise CredentialSourceError(
            self.store,
            self.source,
            f"a key of type {kind!r}, not 'service_account' or 'authorized_user'",
        )

    def _sign(self, method: str, host: str, path: str, query: str) -> dict[str, str]:
        if self._anonymous:
            return {}
        return {"authorization": f"Bearer {self._creds.token}"}
