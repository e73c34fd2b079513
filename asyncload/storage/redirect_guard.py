"""A refusing loopback proxy: keeps an obstore store's requests on the checkpoint's origin.

object_store (through reqwest) follows redirects itself and obstore 0.12 offers no redirect
policy, so the store is given :class:`RedirectGuard` as its proxy for every host but the
origin's; the guard answers 403 to whatever reaches it and forwards nothing.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from asyncload.storage.base import CrossOriginRedirectError, origin_of

__all__ = ["RedirectGuard"]

log = logging.getLogger("asyncload.storage")


class RedirectGuard:
    """Refuses every request of an obstore store to a host other than its origin's.

    object_store (through reqwest) follows redirects itself, up to 10, and obstore 0.12 offers
    no redirect policy: a redirect to another host would carry the caller's headers (an API
    key), an S3 session token and the ``Referer`` there, and its answer would be used. So the
    store's HTTP client is given this listener on 127.0.0.1 as its proxy for every host but the
    origin's (``proxy_url`` with ``proxy_excludes``): a request to another host reaches only
    this process, which notes where it was going, answers 403 and closes. Nothing is
    forwarded. :meth:`refusal` then turns the store's error into
    :class:`asyncload.storage.base.CrossOriginRedirectError`.

    Not caught this way: a redirect to another port of the same host (``proxy_excludes`` names
    hosts, not ports: object_store follows it, with the session token, and uses the answer), and
    any redirect of a store whose credentials come from another host (no guard: its credential
    requests must reach those hosts). The wire transport, which ``transport="auto"`` picks for
    every store it can sign for (all of them, with botocore and google-auth installed), refuses
    both; see docs/remote.md, Redirects.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.setblocking(False)
        self.proxy_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        #: the origins of the requests refused, oldest first
        self.refused: list[str] = []
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Serve on the running loop (connections wait in the backlog until then)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, sock=self._sock, limit=1 << 16)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            words = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            target = words[1] if len(words) >= 2 else "?"
            if words and words[0].upper() == "CONNECT":
                target = f"https://{target}"
            where = origin_of(target)
            self.refused.append(where)
            log.debug(
                "refused a request of an obstore store to %s: not the checkpoint's origin", where
            )
            body = (
                f"asyncload refused a request to {where}: not the checkpoint's origin\n".encode()
            )
            writer.write(
                b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            writer.close()

    def refusal(self, url: str, origin: str) -> CrossOriginRedirectError | None:
        """The error to raise for a failed request about ``url`` (a store of ``origin``) when
        a request was refused."""
        if not self.refused:
            return None
        return CrossOriginRedirectError(url, self.refused[-1], None, origin=origin)

    async def aclose(self) -> None:
        starting, self._starting = self._starting, None
        if starting is not None:
            await asyncio.gather(starting, return_exceptions=True)
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
        self._sock.close()
