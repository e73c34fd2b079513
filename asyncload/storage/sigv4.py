"""AWS Signature Version 4 for the wire transport's S3 requests (:mod:`asyncload.storage.wire`):
the ``Authorization`` header of a GET or HEAD without a body, as botocore signs it.

Only what a read needs: the host, the date, the payload hash (of an empty body), a session
token and a requester-pays acknowledgement (``x-amz-request-payer``) are signed; ``Range`` and ``If-Match`` ride unsigned (S3 accepts them so). The path must
arrive already URI-encoded, as it is sent (S3 does not encode it twice).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from dataclasses import dataclass, field
from urllib.parse import quote

__all__ = ["EMPTY_SHA256", "SigV4"]

#: The SHA-256 of an empty payload (every request of a read has none).
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode("utf-8"), hashlib.sha256).digest()


def _canonical_query(query: str) -> str:
    """The query string's pairs, each encoded as SigV4 wants, sorted."""
    if not query:
        return ""
    pairs = []
    for part in query.split("&"):
        k, _, v = part.partition("=")
        pairs.append((quote(_unquote(k), safe="-_.~"), quote(_unquote(v), safe="-_.~")))
    return "&".join(f"{k}={v}" for k, v in sorted(pairs))


def _unquote(s: str) -> str:
    from urllib.parse import unquote

    return unquote(s)


@dataclass(frozen=True)
class SigV4:
    """Static credentials (never in ``repr``) and where they sign (region, service);
    ``request_payer``: the requester pays (``x-amz-request-payer: requester``, s3fs'
    ``requester_pays``)."""

    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    region: str
    token: str | None = field(default=None, repr=False)
    service: str = "s3"
    request_payer: bool = False

    def sign(
        self,
        method: str,
        host: str,
        path: str,
        query: str = "",
        *,
        now: datetime.datetime | None = None,
    ) -> dict[str, str]:
        """The headers that sign a request without a body to ``host`` (as sent in ``Host``:
        with a port unless it is the scheme's default) for ``path`` (URI-encoded) and
        ``query`` (the raw query string)."""
        now = now or datetime.datetime.now(datetime.UTC)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        headers = {
            "host": host,
            "x-amz-content-sha256": EMPTY_SHA256,
            "x-amz-date": amz_date,
        }
        if self.token:
            headers["x-amz-security-token"] = self.token
        if self.request_payer:
            headers["x-amz-request-payer"] = "requester"
        names = sorted(headers)
        canonical = "\n".join(
            [
                method,
                path or "/",
                _canonical_query(query),
                "".join(f"{n}:{headers[n].strip()}\n" for n in names),
                ";".join(names),
                EMPTY_SHA256,
            ]
        )
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = "\n".join(
            [
                "AWS4-HMAC-SHA256",
                amz_date,
                scope,
                hashlib.sha256(canonical.encode("utf-8")).hexdigest(),
            ]
        )
        key = _hmac(("AWS4" + self.secret_key).encode("utf-8"), day)
        key = _hmac(_hmac(_hmac(key, self.region), self.service), "aws4_request")
        signature = hmac.new(key, to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
        out = {k: v for k, v in headers.items() if k != "host"}
        out["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return out
