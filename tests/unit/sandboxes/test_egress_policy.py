"""The egress policy's rules and the egress proxy's decisions, on loopback (the proxy program itself, run in
this process; the Docker side is tests/integration/test_egress.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from durable_rollouts.sandboxes.base import SandboxSpec
from durable_rollouts.sandboxes.egress_policy import EgressPolicy
from durable_rollouts.sandboxes.egress_proxy import Refused, allowed, resolve, serve

pytestmark = pytest.mark.timeout(30)


def test_the_default_allows_nothing_and_a_spec_carries_it() -> None:
    assert not EgressPolicy().enabled and not SandboxSpec().egress.enabled
    policy = EgressPolicy(allow=["PyPI.org.", "*.Debian.org", "astral.sh:8443"])
    assert policy.allow == ["pypi.org", "*.debian.org", "astral.sh:8443"]
    assert allowed(policy.allow, "pypi.org", 443) and allowed(policy.allow, "pypi.org", 80)
    assert not allowed(policy.allow, "pypi.org", 22)
    assert allowed(policy.allow, "deb.debian.org", 80) and not allowed(policy.allow, "debian.org", 80)
    assert allowed(policy.allow, "astral.sh", 8443) and not allowed(policy.allow, "astral.sh", 443)
    assert not allowed(policy.allow, "evil-pypi.org", 443) and not allowed(policy.allow, "pypi.org.evil", 443)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"allow": ["10.0.0.1"]}, "name hosts, not IP addresses"),
        ({"allow": ["10.0.0.0/8"]}, "name hosts, not IP addresses"),
        ({"allow": ["https://pypi.org/simple"]}, "sandbox.egress.allow"),
        ({"allow": ["pypi.org:99999"]}, "the port must be a number"),
        ({"allow": ["py*.org"]}, "expected a host name"),
        ({"allow": ["pypi.org"], "map": {"astral.sh": "10.0.0.5"}}, "'astral.sh' is not allowed"),
        ({"allow": ["pypi.org"], "map": {"pypi.org": "151.101.0.223:80"}}, "a stand-in must be local"),
        ({"allow": ["*.org"], "map": {"*.org": "10.0.0.5"}}, "map one host name"),
    ],
)
def test_bad_policies_are_refused_naming_the_key(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=r"sandbox\.egress") as e:
        EgressPolicy(**fields)
    assert message in str(e.value)


def test_a_task_list_narrows_the_operators_never_widens_it() -> None:
    operator = EgressPolicy(
        allow=["pypi.org", "*.pythonhosted.org", "deb.debian.org:80", "astral.sh"],
        map={"pypi.org": "10.1.0.5:8000", "astral.sh": "10.1.0.6"},
    )
    task = operator.narrowed(["files.pythonhosted.org", "*.debian.org", "pypi.org", "example.com", "1.2.3.4"])
    assert task.allow == ["pypi.org", "files.pythonhosted.org", "deb.debian.org:80"]
    assert task.map == {"pypi.org": "10.1.0.5:8000"}  # astral.sh is no longer allowed: its stand-in goes
    assert operator.narrowed(["*.org"]).allow == ["pypi.org", "*.pythonhosted.org", "deb.debian.org:80"]
    assert operator.narrowed(["example.com", "10.0.0.0/8"]).allow == []
    assert operator.narrowed(["pypi.org"]).key() != operator.key()


def test_resolution_checks_what_is_connected_to() -> None:
    rules = EgressPolicy(allow=["pypi.org", "localhost:8000"], map={"pypi.org": "127.0.0.1:9"}).rules()
    assert resolve(rules, "pypi.org", 443) == ("127.0.0.1", 9)  # a stand-in: local only, its own port
    for host, port, why in [
        ("127.0.0.1", 80, "a raw IP address is never allowed"),
        ("example.org", 443, "not in the egress policy's allow list"),
        ("pypi.org", 22, "not in the egress policy's allow list"),
        ("localhost", 8000, "resolves to the non-public address"),
    ]:
        with pytest.raises(Refused, match=why):
            resolve(rules, host, port)


@pytest.fixture
async def stand_in() -> AsyncIterator[int]:
    """A one-line HTTP server on loopback answering with the Host and the request line it got."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        host = next(
            ln.split(":", 1)[1].strip() for ln in head.split("\r\n") if ln.lower().startswith("host:")
        )
        body = f"{head.splitlines()[0]} for {host}".encode()
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


async def _ask(port: int, raw: bytes) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data.decode()


async def test_the_proxy_forwards_allowed_names_and_refuses_the_rest(
    stand_in: int, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = EgressPolicy(allow=["pypi.org"], map={"pypi.org": f"127.0.0.1:{stand_in}"}).rules()
    server = await serve(rules, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        plain = await _ask(port, b"GET http://pypi.org/simple/x/ HTTP/1.1\r\nHost: pypi.org\r\n\r\n")
        assert plain.startswith("HTTP/1.0 200") and plain.endswith("GET /simple/x/ HTTP/1.1 for pypi.org")
        tunnel = await _ask(
            port, b"CONNECT pypi.org:443 HTTP/1.1\r\n\r\nGET /t HTTP/1.1\r\nHost: pypi.org\r\n\r\n"
        )
        assert (
            tunnel.startswith("HTTP/1.1 200 Connection established")
            and "GET /t HTTP/1.1 for pypi.org" in tunnel
        )
        other = await _ask(port, b"GET http://example.org/ HTTP/1.1\r\nHost: example.org\r\n\r\n")
        assert other.startswith("HTTP/1.1 403") and "not in the egress policy's allow list" in other
        raw = await _ask(port, f"CONNECT 127.0.0.1:{stand_in} HTTP/1.1\r\n\r\n".encode())
        assert raw.startswith("HTTP/1.1 403") and "a raw IP address is never allowed" in raw
        bad = await _ask(port, b"GET /relative HTTP/1.1\r\n\r\n")
        assert bad.startswith("HTTP/1.1 400")
    log = capsys.readouterr().out
    assert "egress allowed GET pypi.org:80 from 127.0.0.1" in log
    assert "egress refused GET example.org:80 from 127.0.0.1: not in the egress policy's allow list" in log
    assert f"egress refused CONNECT 127.0.0.1:{stand_in} from 127.0.0.1: a raw IP" in log
