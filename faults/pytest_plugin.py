"""pytest fixtures for fault-injection suites: ``fault_proxy`` and ``ledger``.

Enable with ``-p faults.pytest_plugin`` (or ``pytest_plugins = ["durable_rollouts.faults.pytest_plugin"]`` in
a root conftest)::

    async def test_my_stack_survives_resets(fault_proxy, ledger):
        proxy = await fault_proxy("http://127.0.0.1:8000")   # point engine.urls at proxy.url
        proxy.set("reset")
        ...                                                   # run through the proxy
        await ledger(store, run_id, client=client)            # fails the test, one line per violation

Invariant: every proxy a test starts is stopped when the test ends, whatever the outcome.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from durable_rollouts.faults.ledger import LedgerReport, check_run
from durable_rollouts.faults.proxy import FaultProxy


@pytest.fixture
async def fault_proxy() -> AsyncIterator[Callable[[str], Awaitable[FaultProxy]]]:
    """A factory: ``await fault_proxy(upstream_url)`` starts a proxy in front of it."""
    started: list[FaultProxy] = []

    async def start(upstream: str) -> FaultProxy:
        u = urlsplit(upstream)
        proxy = await FaultProxy((u.hostname or "127.0.0.1", u.port or 80)).start()
        started.append(proxy)
        return proxy

    try:
        yield start
    finally:
        for p in started:
            await p.stop()


@pytest.fixture
def ledger() -> Callable[..., Awaitable[LedgerReport]]:
    """``await ledger(store, run_id, client=..., backend=..., pool=...)``: the ledger check; a violation
    fails the test with one line per broken promise."""

    async def check(store: Any, run_id: str, **where: Any) -> LedgerReport:
        report = await check_run(store, run_id, **where)
        if not report.ok:
            pytest.fail("\n".join(report.lines()), pytrace=False)
        return report

    return check
