"""The fault kit: the TCP fault proxy against a real local HTTP server, seeded schedules, the ledger check
on synthetic run stores (a clean run passes; each broken promise is named in one line)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from faults import Fault, FaultProxy, check_store, schedule
from store import RunStore

BODY = b'{"ok": true, "pad": "' + b"x" * 4000 + b'"}'


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(BODY)}\r\nContent-Type: application/json\r\n\r\n"
    writer.write(head.encode() + BODY)
    await writer.drain()
    writer.close()


@pytest.fixture
async def proxy() -> AsyncIterator[FaultProxy]:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with FaultProxy(("127.0.0.1", port)) as p:
        yield p
    server.close()


async def _get(p: FaultProxy, timeout: float = 2.0) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as c:
        return await c.get(p.url + "/v1/x", headers={"Connection": "close"})


async def test_proxy_passes_through_then_injects_each_fault(proxy: FaultProxy) -> None:
    assert (await _get(proxy)).content == BODY
    proxy.set(Fault.HTTP_5XX)
    assert (await _get(proxy)).status_code == 503
    proxy.set(Fault.RESET)
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        await _get(proxy)
    proxy.set(Fault.TRUNCATE, bytes=100)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await _get(proxy)
    proxy.set(Fault.HANG)
    with pytest.raises(httpx.ReadTimeout):
        await _get(proxy, timeout=0.5)
    proxy.set(Fault.DELAY, delay_ms=300)
    t0 = time.monotonic()
    assert (await _get(proxy)).content == BODY and time.monotonic() - t0 >= 0.3
    proxy.clear()
    assert (await _get(proxy)).content == BODY
    assert [e.setting.fault for e in proxy.events] == [
        Fault.HTTP_5XX, Fault.RESET, Fault.TRUNCATE, Fault.HANG, Fault.DELAY, Fault.NONE,
    ]  # fmt: skip
    assert all(a.at <= b.at for a, b in zip(proxy.events, proxy.events[1:], strict=False))


async def test_clearing_a_hang_releases_the_hung_connections(proxy: FaultProxy) -> None:
    proxy.set(Fault.HANG)
    pending = asyncio.ensure_future(_get(proxy, timeout=10))
    await asyncio.sleep(0.3)
    assert not pending.done()
    proxy.clear()  # as an engine restart would: the hung request ends with an error, promptly
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await asyncio.wait_for(pending, 3)


def test_schedules_are_a_function_of_their_seed() -> None:
    kinds = ["worker_kill", "engine_stop", "proxy_reset"]
    a = schedule(7, kinds, 600, instant=frozenset({"worker_kill"}))
    assert a == schedule(7, kinds, 600, instant=frozenset({"worker_kill"})) != schedule(8, kinds, 600)
    assert all(15 <= b.at_s - x.at_s <= 30 for x, b in itertools.pairwise(a))
    assert {p.kind for p in a} == set(kinds) and all(p.duration_s == 0 for p in a if p.kind == "worker_kill")
    with pytest.raises(ValueError, match="no fault kinds"):
        schedule(1, [], 10)


RUN = "ledger-run"


def _store(tmp_path: Path, groups: int = 2, size: int = 2) -> RunStore:
    store = RunStore(tmp_path)
    cfg = {"run": {"num_groups": groups, "group_size": size}}
    store.register_run(RUN, json.dumps(cfg), "h")
    for g in range(groups):
        gid = f"g{g:06d}"
        for i in range(size):
            _record(store, gid, str(i), i, "completed", reward=float(i % 2))
        rec = {"run_id": RUN, "group_id": gid, "task_id": "t", "size": size, "scorable": size, "failed": 0}
        store.put_group(RUN, gid, "t", rec)
    return store


def _record(store: RunStore, gid: str, slot: str, i: int, outcome: str, reward: float | None = None,
            reason: str | None = None) -> None:  # fmt: skip
    store.put_rollout({
        "rollout_id": f"{RUN}/{gid}/{slot}", "run_id": RUN, "group_id": gid, "task_id": "t",
        "sample_index": i, "env": "math", "outcome": outcome, "reason": reason, "reward": reward,
        "scorable": int(reward is not None), "advantage": None, "prompt_length": 1, "num_tokens": 2,
        "sampling_json": "{}", "extra_json": "{}",
    })  # fmt: skip


def test_a_clean_run_passes_the_ledger(tmp_path: Path) -> None:
    report = check_store(_store(tmp_path), RUN)
    assert report.ok, report.lines()
    assert report.lines() == [f"run {RUN}: ledger clean (2 groups, 4 records, 4 successes)"]


def test_each_broken_promise_is_one_line(tmp_path: Path) -> None:
    store = _store(tmp_path, groups=3, size=2)  # group 2 records exist; make it lose one and break others
    with store._tx() as db:
        db.execute("DELETE FROM rollouts WHERE rollout_id=?", (f"{RUN}/g000002/1",))
        db.execute("DELETE FROM groups WHERE group_id='g000001'")
    _record(store, "g000000", "0r1", 0, "completed", reward=1.0)  # slot 0 ran again but attempt 0 was final
    _record(store, "g000002", "1", 1, "failed", reward=0.0, reason="infra: EngineUnavailable: down")
    rules = {v.rule for v in check_store(store, RUN).violations}
    assert rules == {"duplicate", "missing-group", "scored-failure"}, rules
    lines = check_store(store, RUN).lines()
    assert all("\n" not in line and line.startswith(f"run {RUN}: ") for line in lines)


def test_missing_records_and_no_success_are_caught(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.register_run(RUN, json.dumps({"run": {"num_groups": 1, "group_size": 3}}), "h")
    _record(store, "g000000", "0", 0, "failed", reason="infra: x")
    _record(store, "g000000", "2r1", 2, "cancelled", reason="admission")
    rec = {"run_id": RUN, "group_id": "g000000", "task_id": "t", "size": 3, "scorable": 1, "failed": 1}
    store.put_group(RUN, "g000000", "t", rec)  # says 1 scorable: its records have none
    found = [v.line for v in check_store(store, RUN).violations]
    assert any(line.startswith("missing-record: slot ledger-run/g000000/1 has no record") for line in found)
    assert any("attempts [1] have a gap" in line for line in found)
    assert any(line.startswith("no-success") for line in found)
    assert "group-counts: group g000000 says 1 scorable, its records 0" in found


def test_rollouts_ledger_prints_one_line_per_violation_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from workers.cli import app

    monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path))
    store = _store(tmp_path)
    runner = CliRunner()
    clean = runner.invoke(app, ["ledger", RUN, "--no-temporal", "--no-docker"])
    assert clean.exit_code == 0, clean.output
    assert clean.output.strip() == f"run {RUN}: ledger clean (2 groups, 4 records, 4 successes)"
    with store._tx() as db:
        db.execute("DELETE FROM rollouts WHERE rollout_id=?", (f"{RUN}/g000001/0",))
    broken = runner.invoke(app, ["ledger", RUN, "--no-temporal", "--no-docker"])
    assert broken.exit_code == 1
    assert broken.output.strip().splitlines() == [
        f"run {RUN}: missing-record: slot {RUN}/g000001/0 has no record",
        f"run {RUN}: group-counts: group g000001 says 2 scorable, its records 1",
    ]
    unknown = runner.invoke(app, ["ledger", "nope", "--no-temporal", "--no-docker"])
    assert unknown.exit_code == 2 and "run nope: not in the store" in unknown.output
