"""The egress proxy: an HTTP(S) forward proxy that lets a sandbox reach only the hosts its policy allows.

It runs in its own container (``sandboxes.egress``), on every per-sandbox ``--internal`` network and on
one upstream network, started as ``python3 -c <this file> <rules as JSON>``: standard library only, so
the sandbox image's own Python runs it and nothing is downloaded or built.

``CONNECT host:port`` (https, any TLS client) opens a tunnel; an absolute-URI request (``GET http://host/``)
is forwarded in origin form with ``Connection: close``. The rules decide before any connection is made:

Invariants:
- A host is reached only when an ``allow`` entry matches its name and port (``host``, ``host:port``,
  ``*.suffix``, ``*.suffix:port``; no port: 80 and 443). A raw IP address is never allowed.
- An allowed name found in ``map`` goes to its stand-in (``address[:port]``), which must resolve to a
  private, loopback or link-local address only; any other allowed name must resolve to public
  (globally routable) addresses only, so no allowed name can lead to the host, the Docker networks or
  another sandbox. The address checked is the address connected to (no second lookup).
- Every refusal is answered ``403`` and logged as one line ``egress refused <method> <host>:<port> from
  <client>: <why>``; every tunnel or request let through is logged ``egress allowed ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import sys
from typing import Any

PORT = 3128
"""Where the proxy listens on each of its networks."""
HEAD_LIMIT = 64 * 1024
"""Largest request head (request line and headers) read from a client."""
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
DEFAULT_PORTS = (80, 443)
"""Ports an ``allow`` entry without a port opens."""
_HOP_HEADERS = {"proxy-connection", "proxy-authorization", "connection", "keep-alive"}


def split_entry(entry: str) -> tuple[str, int | None]:
    """An ``allow`` entry or a host as (lower-case name, port or None)."""
    host, sep, port = entry.strip().lower().rstrip(".").rpartition(":")
    if not sep:
        return port, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r}: the port must be a number in 1..65535")
    return host.rstrip("."), int(port)


def name_matches(pattern: str, host: str) -> bool:
    """Whether ``host`` is ``pattern`` (or, for ``*.suffix``, a name under ``suffix``; not the suffix)."""
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def allowed(allow: list[str], host: str, port: int) -> bool:
    """Whether an ``allow`` entry lets ``host:port`` through (a raw IP address never)."""
    host = host.lower().rstrip(".")
    if is_ip(host):
        return False
    for entry in allow:
        name, entry_port = split_entry(entry)
        ports = DEFAULT_PORTS if entry_port is None else (entry_port,)
        if port in ports and name_matches(name, host):
            return True
    return False


def mapped(stand_ins: dict[str, str], host: str, port: int) -> tuple[str, int] | None:
    """The stand-in of ``host`` (its address and port; no port: ``port``), or None."""
    target = stand_ins.get(host.lower().rstrip("."))
    if target is None:
        return None
    name, target_port = split_entry(target)
    return name, target_port or port


def local_address(address: str) -> bool:
    """Private, loopback or link-local: where a stand-in may live, and what a real name must not reach."""
    ip = ipaddress.ip_address(address)
    return ip.is_private or ip.is_loopback or ip.is_link_local


class Refused(Exception):
    """A request the rules do not let through; the message says why."""


def resolve(rules: dict[str, Any], host: str, port: int) -> tuple[str, int]:
    """The address to connect to for ``host:port``, after every check (see the module docstring).

    Raises:
        Refused: not allowed, a raw IP, or the name resolves where it must not.
    """
    if is_ip(host):
        raise Refused("a raw IP address is never allowed (name a host the policy allows)")
    if not allowed(rules["allow"], host, port):
        raise Refused("not in the egress policy's allow list (sandbox.egress.allow)")
    stand_in = mapped(rules.get("map", {}), host, port)
    name, target_port = stand_in if stand_in is not None else (host, port)
    try:
        infos = socket.getaddrinfo(name, target_port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise Refused(f"cannot resolve {name!r} ({e})") from None
    addresses = [str(info[4][0]) for info in infos]
    if stand_in is not None:
        bad = [a for a in addresses if not local_address(a)]
        if bad:
            raise Refused(f"its stand-in {name!r} resolves to a public address {bad[0]} (map: local only)")
    else:
        bad = [a for a in addresses if not ipaddress.ip_address(a).is_global]
        if bad:
            raise Refused(f"resolves to the non-public address {bad[0]}")
    return addresses[0], target_port


def parse_head(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    """(method, target, version, headers) of a request head; ValueError when malformed."""
    lines = head.decode("latin-1").split("\r\n")
    method, target, version = lines[0].split(" ")
    headers = []
    for line in lines[1:]:
        if line:
            key, _, value = line.partition(":")
            headers.append((key.strip(), value.strip()))
    return method.upper(), target, version, headers


def target_of(method: str, target: str) -> tuple[str, int, str]:
    """(host, port, origin-form path) of a CONNECT authority or an absolute ``http://`` URI."""
    if method == "CONNECT":
        host, port = split_entry(target)
        if port is None:
            raise ValueError("CONNECT needs host:port")
        return host.strip("[]"), port, ""
    if not target.lower().startswith("http://"):
        raise ValueError("only absolute http:// URIs and CONNECT are proxied")
    rest = target[len("http://") :]
    authority, slash, path = rest.partition("/")
    host, port = split_entry(authority.rpartition("@")[2])
    return host.strip("[]"), port or 80, "/" + path if slash else "/"


def log(line: str) -> None:
    print(line, flush=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            pass


async def _refuse(writer: asyncio.StreamWriter, status: str, why: str) -> None:
    body = f"egress proxy: {why}\n".encode()
    writer.write(
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()


async def handle(rules: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One client connection: one CONNECT tunnel or one forwarded request."""
    peer = writer.get_extra_info("peername")
    client = peer[0] if peer else "?"
    upstream: asyncio.StreamWriter | None = None
    up_reader: asyncio.StreamReader
    try:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            method, target, version, headers = parse_head(head[:-4])
            host, port, path = target_of(method, target)
        except (ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError) as e:
            log(f"egress refused request from {client}: malformed ({type(e).__name__}: {e})")
            await _refuse(writer, "400 Bad Request", "malformed request")
            return
        try:
            address, target_port = await asyncio.get_running_loop().run_in_executor(
                None, resolve, rules, host, port
            )
        except Refused as e:
            log(f"egress refused {method} {host}:{port} from {client}: {e}")
            await _refuse(writer, "403 Forbidden", f"{host}:{port} refused: {e}")
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(address, target_port), CONNECT_TIMEOUT_S
            )
            upstream = up_writer
        except (OSError, TimeoutError) as e:
            log(f"egress failed {method} {host}:{port} from {client}: {address}:{target_port}: {e}")
            await _refuse(writer, "502 Bad Gateway", f"{host}:{port} unreachable")
            return
        log(f"egress allowed {method} {host}:{port} from {client} -> {address}:{target_port}")
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            kept = [(k, v) for k, v in headers if k.lower() not in _HOP_HEADERS]
            lines = [f"{method} {path} {version}", *(f"{k}: {v}" for k, v in kept), "Connection: close"]
            up_writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            sending = asyncio.ensure_future(_pipe(reader, up_writer))  # a request body, if any
            await _pipe(up_reader, writer)  # the response, to the upstream's close: then this connection's
            sending.cancel()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        for w in (upstream, writer):
            if w is not None:
                w.close()


async def serve(rules: dict[str, Any], host: str = "0.0.0.0", port: int = PORT) -> asyncio.Server:
    """Start the proxy (``port`` 0: any free port); the caller keeps the server."""
    return await asyncio.start_server(
        lambda r, w: handle(rules, r, w), host, port, limit=HEAD_LIMIT, reuse_address=True
    )


async def main(rules: dict[str, Any]) -> None:
    server = await serve(rules)
    log(f"egress proxy listening on :{PORT}; allow={rules['allow']} map={sorted(rules.get('map', {}))}")
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
