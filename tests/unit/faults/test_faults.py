"""The fault kit: the TCP fault proxy against a real local HTTP server, seeded schedules, the ledger check
on synthetic run stores (a clean run passes; each broken promise is named in one line)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from durable_rollouts.faults import Fault, FaultProxy, check_store, schedule
from durable_rollouts.store import RunStore

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
    assert proxy.hits == 0  # passing through is not a hit
    proxy.set(Fault.HTTP_5XX)
    assert (await _get(proxy)).status_code == 503
    assert proxy.hits == 1
    proxy.set(Fault.RESET)
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        await _get(proxy)
    assert proxy.hits == 2
    proxy.set(Fault.TRUNCATE, bytes=100)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await _get(proxy)
    assert proxy.hits == 3
    proxy.set(Fault.HANG)
    with pytest.raises(httpx.ReadTimeout):
        await _get(proxy, timeout=0.5)
    assert proxy.hits == 4
    proxy.set(Fault.DELAY, delay_ms=300)
    t0 = time.monotonic()
    assert (await _get(proxy)).content == BODY and time.monotonic() - t0 >= 0.3
    assert proxy.hits == 5
    proxy.clear()
    assert (await _get(proxy)).content == BODY
    assert proxy.hits == 5
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


async def test_a_failure_fault_drops_the_connections_open_through_the_proxy() -> None:
    """A kept-alive (here: mid-request) connection does not carry a client past a 5xx burst: it is dropped
    when the fault is set, so the client reconnects and meets the fault."""

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_after(reader, writer, 3.0)

    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    async with FaultProxy(("127.0.0.1", server.sockets[0].getsockname()[1])) as p:
        pending = asyncio.ensure_future(_get(p, timeout=10))
        await asyncio.sleep(0.3)  # the request is with the upstream, on a connection through the proxy
        p.set(Fault.DELAY, delay_ms=1)  # not a failure: the open connection stays
        await asyncio.sleep(0.2)
        assert not pending.done()
        p.set(Fault.HTTP_5XX)
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await asyncio.wait_for(pending, 1.0)  # long before the upstream's answer
        assert (await _get(p)).status_code == 503
    server.close()


async def _answer_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await _answer(reader, writer)


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

    from durable_rollouts.cli.rollouts import app

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


# -- process faults and the injector, on processes of a test home ----------------------------------------


def _sleeper(home: Path, name: str = "worker") -> int:
    """A stand-in component: started as the stack starts its own (own session, pid file, log)."""
    from durable_rollouts.stack import procs

    return procs.spawn(
        name, [sys.executable, "-c", "import time; time.sleep(600)"], home, {"CHAOS_MARK": "1"}
    )


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_process_faults_freeze_kill_and_restart_the_same_command(tmp_path: Path) -> None:
    from durable_rollouts.faults import process
    from durable_rollouts.stack import procs

    pid = _sleeper(tmp_path)
    try:
        (t,) = process.targets(tmp_path, "worker")
        assert t.pid == pid and t.env["CHAOS_MARK"] == "1"
        with process.frozen(t):
            assert _state(pid) == "T"
        assert _state(pid) in "SR"  # thawed on leaving
        new = process.restart(t, down_s=0.1)
        assert not procs.pid_alive(pid) and new.pid != pid and procs.pid_alive(new.pid)
        assert new.argv == t.argv and new.env["CHAOS_MARK"] == "1"
        assert procs.read_pid(tmp_path, "worker") == new.pid  # the stack's own view: the new process
        process.kill(new)
        assert process.find(tmp_path, "worker") is None
        with pytest.raises(process.ProcessFaultError, match="no longer running"):
            process.kill(new)
    finally:
        procs.stop_pid(pid)
        if (again := procs.read_pid(tmp_path, "worker")) is not None:
            procs.stop_pid(again)


def test_a_pid_file_whose_start_time_differs_is_never_signalled(tmp_path: Path) -> None:
    from durable_rollouts.faults import process

    (tmp_path / "pids").mkdir()
    process.pid_file(tmp_path, "engine").write_text(f"{os.getpid()} 1\n")  # our pid, another start time
    assert process.find(tmp_path, "engine") is None and process.targets(tmp_path, "engine") == []


async def test_the_injector_logs_each_fault_with_its_time_and_clears_it(tmp_path: Path) -> None:
    from durable_rollouts.faults.chaos import Chaos
    from durable_rollouts.faults.schedule import Planned
    from durable_rollouts.stack import procs

    pid = _sleeper(tmp_path)
    log = tmp_path / "chaos.jsonl"
    printed: list[str] = []
    chaos = Chaos(tmp_path, [], log, store=RunStore(tmp_path), echo=printed.append)
    plan = [Planned(0.0, "worker_freeze", 0.4), Planned(0.6, "worker_kill", 0.2),
            Planned(1.2, "container_kill", 0.0), Planned(1.3, "engine_freeze", 1.0)]  # fmt: skip
    try:
        t0 = time.time()
        counts = await chaos.run(plan)
        events = [json.loads(line) for line in log.read_text().splitlines()]
        assert printed == log.read_text().splitlines()  # the same lines on stdout
        assert [(e["kind"], e["event"]) for e in events] == [
            ("worker_freeze", "fired"), ("worker_freeze", "cleared"), ("worker_kill", "fired"),
            ("worker_kill", "cleared"), ("container_kill", "skipped"), ("engine_freeze", "skipped"),
        ]  # fmt: skip
        assert dict(counts) == {"worker_freeze": 1, "worker_kill": 1}
        assert all(
            e["at"] >= t0 and abs(e["t"] - e["planned_s"]) < 0.5 for e in events if e["event"] != "cleared"
        )
        new = procs.read_pid(tmp_path, "worker")
        assert new is not None and new != pid and events[3]["new_pid"] == new  # started again
        assert _state(new) in "SR"
    finally:
        procs.stop_pid(pid)
        if (again := procs.read_pid(tmp_path, "worker")) is not None:
            procs.stop_pid(again)


def test_rollouts_chaos_refuses_bad_input_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from durable_rollouts.cli.rollouts import app

    monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path))
    _store(tmp_path)
    runner = CliRunner()
    cases = {
        ("chaos", RUN, "--kinds", "worker_kill,bogus"): "--kinds: unknown bogus",
        ("chaos", "nope"): "run nope: not in the store",
        ("chaos", RUN, "--every", "soon"): "--every 'soon': give LOW,HIGH",
        ("chaos", RUN, "--every", "30,15"): "schedule: bad intervals",
        ("chaos", RUN, "--kinds", "partition:worker"): "--kinds: fault kind 'partition:worker': a partition",
        ("chaos", RUN, "--kinds", "partition:worker/temporal"): "give the network with --network FILE",
        ("chaos", RUN, "--kinds", "loss:engine", "--network", "/nonexistent.json"): "--network /nonexistent",
    }
    for argv, message in cases.items():
        res = runner.invoke(app, list(argv))
        assert res.exit_code == 2 and message in res.output, (argv, res.output)
        assert len(res.output.strip().splitlines()) == 1
