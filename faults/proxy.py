"""A TCP fault proxy (asyncio, no external binary) to put in front of any engine, or any HTTP service.

Point the run's ``engine.urls`` at the proxy's URL; it forwards every connection to the upstream and,
while a fault is set, injects it:

- ``delay``: each chunk from the upstream waits ``delay_ms`` first;
- ``hang``: connections are accepted and the request read, but nothing is ever answered (a hung engine
  whose port is open);
- ``reset``: new connections are closed at once with a TCP reset (RST);
- ``truncate``: replies are cut after ``bytes`` bytes and the connection closed (a truncated body);
- ``slow_close``: the reply is forwarded, then the connection is held open ``delay_ms`` before closing;
- ``http_5xx``: requests are answered ``503 Service Unavailable`` by the proxy itself (a 5xx burst).

Invariants: setting or clearing a fault takes effect for connections accepted from then on (``reset``,
``hang``, ``http_5xx``) and for bytes forwarded from then on (``delay``, ``truncate``). Setting ``reset``,
``hang`` or ``http_5xx`` also drops the connections open through the proxy (reset), as an engine restart or
a load balancer flip would: a client's kept-alive connection cannot carry its requests past the fault.
Clearing a fault releases hung connections (they are closed, as an engine restart would). Every change is
logged with its time (``events``), so a suite can line faults up with what the pipeline recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from dataclasses import dataclass, field
from enum import StrEnum


class Fault(StrEnum):
    NONE = "none"
    DELAY = "delay"
    HANG = "hang"
    RESET = "reset"
    TRUNCATE = "truncate"
    SLOW_CLOSE = "slow_close"
    HTTP_5XX = "http_5xx"


@dataclass(frozen=True)
class FaultSetting:
    """The fault in force and its parameters."""

    fault: Fault = Fault.NONE
    delay_ms: float = 0.0
    bytes: int = 0


@dataclass(frozen=True)
class ProxyEvent:
    at: float
    """Unix time the setting changed."""
    setting: FaultSetting


_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 41\r\n"
    b'Connection: close\r\n\r\n{"error": "injected by the fault proxy"}\n'
)


@dataclass
class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (host, port), injecting the current fault."""

    upstream: tuple[str, int]
    host: str = "127.0.0.1"
    port: int = 0
    """0 = a free port, known after `start`."""
    setting: FaultSetting = field(default_factory=FaultSetting)
    events: list[ProxyEvent] = field(default_factory=list)
    hits: int = 0
    """Times a fault acted on traffic: a new connection reset, hung or answered 503, a reply truncated or
    delayed (a test can wait for the fault to have reached the pipeline, not just been set). Connections
    that a new setting cuts are not counted: one may already have finished its exchange."""
    _server: asyncio.Server | None = None
    _hung: set[asyncio.StreamWriter] = field(default_factory=set)
    _open: set[asyncio.StreamWriter] = field(default_factory=set)
    """Client connections being forwarded to the upstream now."""
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._release_hung()
            for t in list(self._tasks):
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def set(self, fault: Fault | str, delay_ms: float = 0.0, bytes: int = 0) -> None:
        """Put ``fault`` in force (``none`` clears it); logged with its time."""
        self.setting = FaultSetting(Fault(fault), delay_ms, bytes)
        self.events.append(ProxyEvent(time.time(), self.setting))
        if self.setting.fault != Fault.HANG:
            self._release_hung()
        if self.setting.fault in (Fault.RESET, Fault.HANG, Fault.HTTP_5XX):
            for w in list(self._open):
                w.transport.abort()
            self._open.clear()

    def clear(self) -> None:
        self.set(Fault.NONE)

    def _release_hung(self) -> None:
        for w in list(self._hung):
            w.close()
        self._hung.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._connection(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            if task is not None:
                self._tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        s = self.setting
        if s.fault in (Fault.RESET, Fault.HANG, Fault.HTTP_5XX):
            self.hits += 1
        if s.fault == Fault.RESET:
            sock = writer.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: close sends RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        if s.fault == Fault.HANG:
            self._hung.add(writer)
            while not writer.is_closing() and await reader.read(65536):
                pass  # read and drop; never answer
            return
        if s.fault == Fault.HTTP_5XX:
            await reader.read(65536)
            writer.write(_503)
            await writer.drain()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._open.add(writer)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, upstream=False), self._pump(up_reader, writer, upstream=True)
            )
        finally:
            self._open.discard(writer)
            up_writer.close()
        if self.setting.fault == Fault.SLOW_CLOSE:
            await asyncio.sleep(self.setting.delay_ms / 1000.0)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
        sent = 0
        while data := await src.read(65536):
            s = self.setting
            if upstream and s.fault == Fault.DELAY and s.delay_ms > 0:
                self.hits += 1
                await asyncio.sleep(s.delay_ms / 1000.0)
            if upstream and s.fault == Fault.TRUNCATE:
                self.hits += 1
                data = data[: max(0, s.bytes - sent)]
                if data:
                    dst.write(data)
                    await dst.drain()
                dst.close()
                return
            dst.write(data)
            sent += len(data)
            await dst.drain()
        with contextlib.suppress(Exception):
            if dst.can_write_eof():
                dst.write_eof()
