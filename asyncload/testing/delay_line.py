"""A delay line that queues: a TCP forwarder delivering each piece a fixed delay after it
arrived, both ways (issue 45: a second network model beside :class:`FaultProxy`).

The :class:`FaultProxy` sleeps ``latency`` once before each request and once before each
answer's head, then relays the body as fast as it comes: the delay is per request. A real
long link delays every byte: each piece read from one side is written to the other
``delay`` seconds after it was read, and reading goes on meanwhile, so the bytes in flight
grow with the bandwidth (the bandwidth-delay product), never capped by the delay. This
forwarder knows nothing of HTTP: it moves bytes, so a request and its answer each take
``delay`` plus their transfer, and a connection's bytes stay in order::

    with S3rverServer() as s3, DelayLine(s3.endpoint_url, delay=0.01) as line:
        fs = s3fs.S3FileSystem(endpoint_url=line.endpoint_url, ...)

Pieces are what one ``read`` returns (at most ``piece`` bytes, 256 KiB by default). A
side that stops reading is pushed back on once ``max_queued`` bytes wait for it (TCP's
own flow control, as on a real path whose buffers fill). The forwarder runs its own
asyncio loop in a daemon thread (``start``/``stop``, or a ``with`` block); benchmarks run
it in a process of its own so that relaying does not compete for their GIL
(``python -m asyncload.testing.delay_line UPSTREAM DELAY``: prints its port, runs until
its stdin closes).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import sys
import threading
import urllib.parse
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self

__all__ = ["DelayLine"]

KiB = 1024


class DelayLine:
    """Forwards ``127.0.0.1:port`` to ``upstream`` (``http://127.0.0.1:PORT`` or
    ``HOST:PORT``), each piece delivered ``delay`` seconds after it arrived, both ways."""

    def __init__(
        self,
        upstream: str,
        delay: float,
        *,
        piece: int = 256 * KiB,
        max_queued: int = 64 << 20,
        port: int = 0,
    ) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        if piece <= 0 or max_queued < piece:
            raise ValueError("piece must be > 0 and max_queued >= piece")
        target = upstream if "://" in upstream else f"tcp://{upstream}"
        u = urllib.parse.urlsplit(target)
        if not u.hostname or not u.port:
            raise ValueError(f"upstream needs a host and a port: {upstream!r}")
        self.upstream = (u.hostname, u.port)
        self.delay = delay
        self.piece = piece
        self.max_queued = max_queued
        self._requested_port = port
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = threading.Lock()
        #: connections accepted, bytes delivered each way (client -> upstream, back)
        self.connections = 0
        self.bytes_up = 0
        self.bytes_down = 0

    # lifecycle
    def start(self) -> Self:
        ready = threading.Event()
        error: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, error), name="delay-line", daemon=True
        )
        self._thread.start()
        ready.wait(10)
        if error:
            raise error[0]
        if self._port is None:
            raise RuntimeError("the delay line did not start")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            with contextlib.suppress(Exception):
                fut.result(timeout)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
        self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the delay line is not started")
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __repr__(self) -> str:
        return (
            f"<DelayLine 127.0.0.1:{self._port} -> {self.upstream[0]}:{self.upstream[1]} "
            f"delay={self.delay}s>"
        )

    # the loop
    def _run(self, ready: threading.Event, error: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            try:
                server = loop.run_until_complete(
                    asyncio.start_server(self._on_client, "127.0.0.1", self._requested_port)
                )
            except BaseException as exc:
                error.append(exc)
                ready.set()
                return
            self._server = server
            self._port = int(server.sockets[0].getsockname()[1])
            ready.set()
            loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()
            self._loop = None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self.connections += 1
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            for w in (writer, up_writer):
                with contextlib.suppress(OSError):
                    w.get_extra_info("socket").setsockopt(
                        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
                    )
            await asyncio.gather(
                self._pump(reader, up_writer, up=True),
                self._pump(up_reader, writer, up=False),
            )
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()
            if up_writer is not None:
                up_writer.transport.abort()
            self._tasks.discard(task)

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, up: bool
    ) -> None:
        """Read pieces from ``src`` as they come; write each to ``dst`` ``delay`` seconds
        after it was read, in order; end ``dst``'s writing once ``src`` ends."""
        loop = asyncio.get_running_loop()
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        queued = [0]
        more = asyncio.Event()  # something queued, or the end
        room = asyncio.Event()  # below max_queued
        room.set()
        done = [False]

        async def read() -> None:
            try:
                while True:
                    await room.wait()
                    data = await src.read(self.piece)
                    if not data:
                        break
                    queue.append((loop.time() + self.delay, data))
                    queued[0] += len(data)
                    if queued[0] >= self.max_queued:
                        room.clear()
                    more.set()
            except OSError:
                pass
            finally:
                done[0] = True
                more.set()

        reading = asyncio.ensure_future(read())
        try:
            while True:
                if not queue:
                    if done[0]:
                        break
                    more.clear()
                    await more.wait()
                    continue
                due, data = queue[0]
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                queue.popleft()
                queued[0] -= len(data)
                if queued[0] < self.max_queued:
                    room.set()
                dst.write(data)
                await dst.drain()
                with self._lock:
                    if up:
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
            if dst.can_write_eof():
                with contextlib.suppress(OSError):
                    dst.write_eof()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await reading


def _main(argv: list[str]) -> None:
    """``python -m asyncload.testing.delay_line UPSTREAM DELAY [PIECE]``."""
    upstream, delay = argv[0], float(argv[1])
    piece = int(argv[2]) if len(argv) > 2 else 256 * KiB
    line = DelayLine(upstream, delay, piece=piece).start()
    print(line.port, flush=True)
    try:
        sys.stdin.read()
    finally:
        line.stop()


if __name__ == "__main__":
    _main(sys.argv[1:])
