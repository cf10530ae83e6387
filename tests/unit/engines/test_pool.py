"""engines.pool.ShardedTransport against a real loopback HTTP server: requests spread over its pools,
each pool reuses its connections, closing the transport closes them all."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from durable_rollouts.engines.pool import ShardedTransport

pytestmark = pytest.mark.timeout(30)


class Server:
    """An HTTP/1.1 keep-alive server answering ``ok`` to every request; counts connections."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


async def test_requests_spread_over_the_pools_and_each_pool_reuses_its_connections() -> None:
    srv = Server()
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=30.0)
    transport = ShardedTransport(limits, shards=4)
    async with server, httpx.AsyncClient(transport=transport) as client:
        for _ in range(16):  # one after another: each pool opens one connection and keeps it
            assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
        assert (srv.opened, srv.requests) == (4, 16)
        answers = await asyncio.gather(*(client.get(f"http://127.0.0.1:{port}/") for _ in range(8)))
        assert [a.status_code for a in answers] == [200] * 8
        assert srv.requests == 24
        await transport.aclose()
        for _ in range(100):  # the server sees every connection end
            if srv.closed == srv.opened:
                break
            await asyncio.sleep(0.01)
        assert srv.closed == srv.opened


def test_at_least_one_pool() -> None:
    with pytest.raises(ValueError, match="shards: 0"):
        ShardedTransport(httpx.Limits(), shards=0)
