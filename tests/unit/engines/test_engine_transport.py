"""engines.pool.EngineTransport against a real loopback HTTP server: connections are reused last-in
first-out, never after a response that ends them or a request that did not finish; failures surface as
httpx's transport errors (the engine client's EngineUnavailable); other schemes go to the fallback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.engines.pool import EngineTransport
from durable_rollouts.errors import EngineUnavailable

pytestmark = pytest.mark.timeout(30)

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
REFUSED = "http://127.0.0.1:9"
"""The discard port on loopback: nothing listens there, so a connection is refused."""


class Server:
    """An HTTP/1.1 server answering each request with ``answer(n)`` (n counts requests from 1; None:
    never answer); counts connections opened and closed, and sets ``all_closed`` when every one ended."""

    def __init__(self, answer: Callable[[int], bytes | None] = lambda n: OK) -> None:
        self.answer = answer
        self.opened = self.closed = self.requests = 0
        self.bodies: list[bytes] = []
        self.all_closed = asyncio.Event()
        self.received = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        self.all_closed.clear()
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = [
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length")
                ]
                self.bodies.append(await reader.readexactly(length[0]) if length else b"")
                self.requests += 1
                self.received.set()
                out = self.answer(self.requests)
                if out is None:
                    await reader.read()  # hold the request unanswered until the client goes
                    break
                writer.write(out)
                await writer.drain()
                if _ends_connection(out):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed += 1
            if self.closed == self.opened:
                self.all_closed.set()


def _ends_connection(answer: bytes) -> bool:
    """Whether the server closes the connection after ``answer`` (it says so, or its length is unknown)."""
    low = answer.lower()
    if b"connection: close" in low or low.startswith(b"http/1.0"):
        return True
    return b"content-length" not in low and b"chunked" not in low


@pytest.fixture
async def served() -> AsyncIterator[Callable[..., tuple[Server, str]]]:
    servers: list[asyncio.Server] = []

    async def start(answer: Callable[[int], bytes | None] = lambda n: OK) -> tuple[Server, str]:
        srv = Server(answer)
        server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
        servers.append(server)
        return srv, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for s in servers:
        s.close()


def _client(expiry: float = 30.0) -> tuple[httpx.AsyncClient, EngineTransport]:
    transport = EngineTransport(httpx.AsyncHTTPTransport(), keepalive_expiry=expiry)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0)), transport


async def test_one_connection_serves_calls_one_after_another_and_closing_closes_it(served) -> None:
    srv, url = await served()
    client, transport = _client()
    for i in range(5):
        r = await client.post(f"{url}/x?i={i}", json={"i": i})
        assert (r.status_code, r.text) == (200, "ok")
    assert (srv.opened, srv.requests) == (1, 5)
    assert srv.bodies[-1] == b'{"i":4}'
    assert transport.idle_connections() == 1
    await client.aclose()
    await asyncio.wait_for(srv.all_closed.wait(), 5)
    assert transport.idle_connections() == 0


async def test_concurrent_calls_open_connections_that_later_calls_reuse(served) -> None:
    srv, url = await served()
    client, transport = _client()
    answers = await asyncio.gather(*(client.get(f"{url}/") for _ in range(8)))
    assert [a.text for a in answers] == ["ok"] * 8 and srv.opened == 8
    for _ in range(8):
        await client.get(f"{url}/")
    assert srv.opened == 8 and transport.idle_connections() == 8
    await client.aclose()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n\r\nok",  # no length: the body runs to the connection's end
    ],
    ids=["connection-close", "http-1.0", "read-to-end"],
)
async def test_a_response_that_ends_its_connection_is_not_reused(served, answer: bytes) -> None:
    srv, url = await served(lambda n: answer)
    client, transport = _client()
    assert [(await client.get(f"{url}/")).text for _ in range(3)] == ["ok"] * 3
    assert srv.opened == 3 and transport.idle_connections() == 0
    await client.aclose()


async def test_expired_idle_connections_are_closed_not_reused(served) -> None:
    srv, url = await served()
    client, transport = _client(expiry=0.0)
    for _ in range(3):
        await client.get(f"{url}/")
    assert srv.opened == 3 and transport.idle_connections() == 1
    await client.aclose()
    await asyncio.wait_for(srv.all_closed.wait(), 5)


async def test_a_chunked_body_is_joined(served) -> None:
    chunked = b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\n{"a\r\n5\r\n": 1}\r\n0\r\n\r\n'
    srv, url = await served(lambda n: chunked)
    client, _ = _client()
    assert (await client.get(f"{url}/")).json() == {"a": 1}
    assert (await client.get(f"{url}/")).json() == {"a": 1}
    assert srv.opened == 1
    await client.aclose()


async def test_a_request_cancelled_mid_answer_closes_its_connection(served) -> None:
    srv, url = await served(lambda n: None if n == 1 else OK)
    client, transport = _client()
    call = asyncio.ensure_future(client.get(f"{url}/"))
    await asyncio.wait_for(srv.received.wait(), 5)  # the request reached the server
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert transport.idle_connections() == 0
    await asyncio.wait_for(srv.all_closed.wait(), 5)  # the server saw the connection end
    assert (await client.get(f"{url}/")).text == "ok" and srv.opened == 2
    await client.aclose()


async def test_failures_are_httpx_transport_errors(served) -> None:
    srv, url = await served(lambda n: None if n == 1 else b"HTTP/1.1 OK\r\n\r\n")
    client, transport = _client()
    with pytest.raises(httpx.ReadTimeout):
        await client.get(f"{url}/", timeout=httpx.Timeout(5.0, read=0.2))
    with pytest.raises(httpx.RemoteProtocolError, match="malformed status line"):
        await client.get(f"{url}/")
    assert transport.idle_connections() == 0
    await asyncio.wait_for(srv.all_closed.wait(), 5)
    with pytest.raises(httpx.ConnectError):
        await client.get(f"{REFUSED}/")
    await client.aclose()


async def test_the_engine_client_maps_a_refused_connection_to_engine_unavailable() -> None:
    engine = EngineClient()
    sampling = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, seed=1, logprob_mode="processed"
    )
    with pytest.raises(EngineUnavailable, match="ConnectError"):
        await engine.generate(REFUSED, "tiny", [1, 2], sampling, 4, "r/g/0/0/1")
    await engine.aclose()


async def test_other_schemes_go_to_the_fallback() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text="fallback")

    transport = EngineTransport(httpx.MockTransport(handler))
    async with httpx.AsyncClient(transport=transport) as client:
        assert (await client.get("https://engine.example/v1/models")).text == "fallback"
    assert seen == ["https://engine.example/v1/models"]
