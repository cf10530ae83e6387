"""Connections for many concurrent calls to few engines: a lean HTTP/1.1 keep-alive pool for ``http://``
engines (``EngineTransport``), httpx's own pools (``ShardedTransport``) for anything else.

Why: httpcore's pool walks every connection it holds on each request's start and end, asking each idle
one whether its socket is readable (a dict of socket attributes, ``getpeername`` and ``poll`` per
connection), so a worker with a few hundred connections to its engines spent a third of its CPU in that
walk with short turns, and still a sixth with the requests spread over 8 pools (docs/measurements/cost.md).
``EngineTransport`` keeps each engine's idle connections on a stack: a request takes the most recently
used one that is still open (the event loop marks a connection the server closed as it reads its end,
without a system call of ours) and younger than ``keepalive_expiry``, or opens a new one; nothing walks.

Invariants:
- A request goes to exactly one connection and is answered on it; a connection goes back to its stack
  only after a complete response that lets it stay open (HTTP/1.1, no ``Connection: close``), so a
  cancelled or failed request never leaves a half-read connection for the next one.
- Failures surface as httpx's own exceptions (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
  ``WriteTimeout``, ``ReadError``, ``WriteError``, ``RemoteProtocolError``: all ``httpx.TransportError``),
  so the engine client classifies them as it always did. The request's timeouts are httpx's (``connect``,
  ``write``, and ``read`` for the whole response).
- Closing the transport closes every connection it holds and every pool it delegates to.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field

import httpx

SHARDS = 8
"""Pools a ``ShardedTransport`` spreads its requests over (each walk sees about 1/SHARDS of them)."""
MAX_HEAD = 65536
"""Longest response head (status line and headers) accepted, in bytes."""


class ShardedTransport(httpx.AsyncBaseTransport):
    """``shards`` HTTP transports with the same limits; each request goes to the next one in turn."""

    def __init__(self, limits: httpx.Limits, shards: int = SHARDS) -> None:
        if shards < 1:
            raise ValueError(f"shards: {shards} (at least 1)")
        self.pools = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(shards)]
        self._turn = itertools.cycle(self.pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await next(self._turn).handle_async_request(request)

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


@dataclass(eq=False)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = field(default_factory=time.monotonic)

    def usable(self, now: float, expiry: float) -> bool:
        return (
            now - self.idle_since < expiry
            and not self.reader.at_eof()
            and not self.writer.transport.is_closing()
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class EngineTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive connections per engine, reused last-in first-out (see the module docstring);
    requests to other schemes go to ``fallback``."""

    def __init__(
        self, fallback: httpx.AsyncBaseTransport, keepalive_expiry: float = 4.0, max_idle: int = 1024
    ) -> None:
        self.fallback = fallback
        self.keepalive_expiry = keepalive_expiry
        self.max_idle = max_idle
        """Idle connections kept per engine (more are closed as they come back)."""
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._busy: set[_Conn] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            return await self.fallback.handle_async_request(request)
        key = (url.host, url.port or 80)
        timeout = request.extensions.get("timeout", {})
        body = await request.aread()
        conn = self._take(key) or await _connect(key, timeout.get("connect"))
        self._busy.add(conn)
        done = False
        try:
            await _send(conn, request, body, timeout.get("write"))
            status, reason, headers, content, keep = await _receive(conn, request, timeout.get("read"))
            done = keep
        finally:
            self._busy.discard(conn)
            if done:
                self._give_back(key, conn)
            else:
                conn.close()
        return httpx.Response(
            status,
            headers=headers,
            stream=httpx.ByteStream(content),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
        )

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        stack = self._idle.get(key)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            if conn.usable(now, self.keepalive_expiry):
                return conn
            conn.close()
        return None

    def _give_back(self, key: tuple[str, int], conn: _Conn) -> None:
        stack = self._idle.setdefault(key, [])
        if len(stack) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        stack.append(conn)

    def idle_connections(self) -> int:
        """Connections kept open for reuse right now."""
        return sum(len(s) for s in self._idle.values())

    async def aclose(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()
        for conn in list(self._busy):
            conn.close()
        await self.fallback.aclose()


async def _connect(key: tuple[str, int], timeout: float | None) -> _Conn:
    host, port = key
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD)
    except TimeoutError as e:
        raise httpx.ConnectTimeout(f"connect to {host}:{port} timed out") from e
    except OSError as e:
        raise httpx.ConnectError(f"connect to {host}:{port}: {e}") from e
    return _Conn(reader, writer)


async def _send(conn: _Conn, request: httpx.Request, body: bytes, timeout: float | None) -> None:
    url = request.url
    target = url.raw_path.decode("ascii")
    lines = [f"{request.method} {target} HTTP/1.1"]
    lines += [f"{k}: {v}" for k, v in request.headers.multi_items() if k.lower() != "transfer-encoding"]
    if body and "content-length" not in request.headers:
        lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    try:
        async with asyncio.timeout(timeout):
            conn.writer.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.writer.write(body)
            await conn.writer.drain()
    except TimeoutError as e:
        raise httpx.WriteTimeout(f"{url}: write timed out") from e
    except OSError as e:
        raise httpx.WriteError(f"{url}: {e}") from e


async def _receive(
    conn: _Conn, request: httpx.Request, timeout: float | None
) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes, bool]:
    """The response's status, reason, headers and body, and whether the connection may be reused."""
    url = request.url
    try:
        async with asyncio.timeout(timeout):
            while True:
                status, reason, version, headers = _head(await conn.reader.readuntil(b"\r\n\r\n"), url)
                if status >= 200 or status == 101:
                    break  # 1xx informational answers precede the real one
            content, to_end = await _body(conn.reader, request.method, status, headers)
    except TimeoutError as e:
        raise httpx.ReadTimeout(f"{url}: read timed out") from e
    except asyncio.IncompleteReadError as e:
        raise httpx.RemoteProtocolError(f"{url}: server disconnected without a complete response") from e
    except asyncio.LimitOverrunError as e:
        raise httpx.RemoteProtocolError(f"{url}: response head longer than {MAX_HEAD} bytes") from e
    except ValueError as e:  # a length or chunk size that is not a number
        raise httpx.RemoteProtocolError(f"{url}: malformed response ({e})") from e
    except OSError as e:
        raise httpx.ReadError(f"{url}: {e}") from e
    close = (
        to_end
        or version != b"HTTP/1.1"
        or any(k.lower() == b"connection" and b"close" in v.lower() for k, v in headers)
    )
    return status, reason, headers, content, not close


def _head(raw: bytes, url: httpx.URL) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
    lines = raw[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    try:
        status = int(code)
    except ValueError:
        raise httpx.RemoteProtocolError(f"{url}: malformed status line {lines[0][:80]!r}") from None
    headers = []
    for line in lines[1:]:
        k, sep, v = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError(f"{url}: malformed header line {line[:80]!r}")
        headers.append((k.strip(), v.strip()))
    return status, reason, version, headers


async def _body(
    reader: asyncio.StreamReader, method: str, status: int, headers: list[tuple[bytes, bytes]]
) -> tuple[bytes, bool]:
    """The response's body, and whether it ran to the connection's end (then the connection is spent)."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return b"", False
    length, chunked = None, False
    for k, v in headers:
        name = k.lower()
        if name == b"content-length":
            length = int(v)
        elif name == b"transfer-encoding" and b"chunked" in v.lower():
            chunked = True
    if chunked:
        parts: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                    pass
                return b"".join(parts), False
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
    if length is not None:
        return await reader.readexactly(length), False
    return await reader.read(), True  # until the server closes (no length, not chunked)
