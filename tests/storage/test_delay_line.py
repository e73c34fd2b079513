"""The delay line (``asyncload.testing.delay_line``, issue 45's second network model): bytes
through it arrive whole and in order both ways, many connections at once, and a load
through it is bit for bit. Real servers on loopback; nothing is timed."""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
import torch
from safetensors.torch import save_file

import asyncload
from asyncload import LoadOptions
from asyncload.testing.delay_line import DelayLine

pytestmark = pytest.mark.timeout(60)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.write_eof()
    writer.close()


def test_bytes_arrive_whole_and_in_order_both_ways():
    async def main() -> tuple[list[bytes], list[bytes], int, int]:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        rng = random.Random(45)
        sent = [rng.randbytes(n) for n in (1, 1000, 300_001, 3 << 20)]
        with DelayLine(f"127.0.0.1:{port}", 0.005, piece=64 << 10) as line:

            async def one(data: bytes) -> bytes:
                reader, writer = await asyncio.open_connection("127.0.0.1", line.port)
                send = asyncio.ensure_future(_send(writer, data))
                got = await reader.read(-1)  # until the echo closes
                await send
                writer.close()
                return got

            got = await asyncio.gather(*(one(d) for d in sent))
            up, down = line.bytes_up, line.bytes_down
        server.close()
        await server.wait_closed()
        return sent, list(got), up, down

    sent, got, up, down = asyncio.run(main())
    assert [hashlib.sha256(g).hexdigest() for g in got] == [
        hashlib.sha256(s).hexdigest() for s in sent
    ]
    assert up == down == sum(len(s) for s in sent)


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    for i in range(0, len(data), 100_000):  # in pieces, as a client writes a body
        writer.write(data[i : i + 100_000])
        await writer.drain()
    writer.write_eof()


def test_a_load_through_the_delay_line_is_bit_for_bit(http_server, tmp_path):
    g = torch.Generator().manual_seed(45)
    sd = {f"w{i}": torch.randn((256, 1024), generator=g) for i in range(6)}
    save_file(sd, str(tmp_path / "model.safetensors"))
    http_server.put_object(
        "dl", "ckpt/model.safetensors", (tmp_path / "model.safetensors").read_bytes()
    )
    with DelayLine(http_server.endpoint_url, 0.002) as line:
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        asyncload.load(
            dest,
            http_server.url("dl", "ckpt/model.safetensors", endpoint_url=line.endpoint_url),
            options=LoadOptions(transport="wire", chunk_size=256 << 10),
        )
        assert line.connections >= 1
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="delay"):
        DelayLine("127.0.0.1:1", -1.0)
    with pytest.raises(ValueError, match="host and a port"):
        DelayLine("http://127.0.0.1", 0.01)
    with pytest.raises(RuntimeError, match="not started"):
        _ = DelayLine("127.0.0.1:1", 0.0).port
