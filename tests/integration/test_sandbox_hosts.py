"""A run across sandbox hosts: two workers with state directories of their own, a PostgreSQL store and two
Docker daemons on this machine (the second on its own socket, data root and exec root).

- Sandboxes land on both daemons; one worker SIGKILLed and its daemon stopped mid-run: every rollout has
  exactly one record, the orphaned rollouts recover on the other host (by replay), the ledger is clean,
  and once the lost host comes back its reaper leaves no container of the run on either daemon.
- Capacity joining mid-run: a host of 2 slots, then a second of 4: the dispatcher's pool follows the live
  capacity (its log shows 2, then 6 ready), admissions rise past 2, no rollout fails for want of a sandbox.

Real Temporal, real Docker, real PostgreSQL; the engine is the scripted simulated one.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.contracts.types import group_id
from durable_rollouts.faults.ledger import check_run
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.stack import procs
from durable_rollouts.store import RunStore, open_store
from tests.integration.docker_daemons import SecondDockerd, need_second_daemon
from tests.integration.support import CODING_TASKS, coding_config, export, start_run, until
from tests.postgres import drop_database, new_database

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def second_daemon() -> Iterator[SecondDockerd]:
    """The second sandbox host's daemon, holding the sandbox image (stopped and started by the tests)."""
    need_second_daemon()
    daemon = SecondDockerd("dr-d2")
    try:
        daemon.start()
        daemon.load(DEFAULT_IMAGE)
        yield daemon
    finally:
        daemon.close()


@pytest.fixture
def pg_store(postgres_server: str) -> Iterator[str]:
    url = new_database(postgres_server, "hosts")
    try:
        yield url
    finally:
        drop_database(postgres_server, url)


LOCAL_DOCKER = "unix:///var/run/docker.sock"


def spawn_host(
    client: Client, task_queue: str, home: Path, store: str, name: str, docker_host: str, slots: int
) -> int:
    """A worker process that is also a sandbox host; its own state directory, the shared store."""
    address = client.service_client.config.target_host
    argv = [
        *procs.worker_argv(address, task_queue),
        "--store", store, "--sandbox-host", name, "--docker-host", docker_host, "--sandbox-slots", str(slots),
    ]  # fmt: skip
    home.mkdir(parents=True, exist_ok=True)
    return procs.spawn(name, argv, home, env={"ROLLOUTS_HOME": str(home)})


@pytest.fixture
async def sim() -> AsyncIterator[str]:
    # member 1 of every group runs `sleep 30` (cut by the command timeout): its sandbox lives a few seconds
    rules = [ModeRule(on="request", prefix=f"hosts-kill/{group_id(g)}/1", mode=Mode.SLEEP) for g in range(8)]
    settings = SimSettings(tasks=CODING_TASKS, mode=Mode.REFERENCE, mode_rules=rules, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def containers(backend: DockerBackend, run_id: str) -> int:
    return len(backend.list_containers(run_id))


HOSTS_POOL = {"placement": "hosts", "initial_size": 0, "max_size": 16, "host_timeout_s": 4.0}


async def test_a_host_killed_with_its_daemon_mid_run_loses_nothing_and_leaves_nothing(
    client: Client, second_daemon: SecondDockerd, pg_store: str, sim: str, task_queue: str, tmp_path: Path
) -> None:
    run_id = "hosts-kill"
    local, remote = DockerBackend(), second_daemon.backend()
    cfg = coding_config(
        sim, task_queue, groups=8, size=2, rollout={"max_turns": 4}, sandbox={"command_timeout_s": 5},
        sandbox_pool=HOSTS_POOL, admission={"enabled": True, "poll_interval_s": 0.5, "admit_window_s": 0.0,
                                            "initial_cap": 8, "max_model_len": 4096},
    )  # fmt: skip
    store = open_store(pg_store)
    one = spawn_host(client, task_queue, tmp_path / "h1", pg_store, "h1", LOCAL_DOCKER, 3)
    two = spawn_host(client, task_queue, tmp_path / "h2", pg_store, "h2", second_daemon.url, 3)
    again = 0
    try:
        handle = await start_run(client, cfg, run_id)
        await until(lambda: containers(local, run_id) >= 1 and containers(remote, run_id) >= 1, 120, "both")
        await asyncio.sleep(1.0)  # the sleepers' commands are running on both daemons
        os.killpg(two, signal.SIGKILL)
        second_daemon.stop()
        await asyncio.wait_for(handle.result(), timeout=300)
        rollouts, groups = export(store, run_id)
        counts = Counter(r["rollout_id"] for r in rollouts)
        assert len(counts) == 16 and set(counts.values()) == {1} and len(groups) == 8
        moved = [r for r in rollouts if (r.get("sandbox_replays") or 0) > 0]
        assert moved, "no rollout recovered on the other host"
        assert all(r["outcome"] != "failed" for r in rollouts), [r["reason"] for r in rollouts]
        report = await check_run(store, run_id, client=client)
        assert report.ok, "\n".join(report.lines())
        assert containers(local, run_id) == 0
        # the lost host comes back: its reaper removes what its rollouts left there
        second_daemon.start()
        assert containers(remote, run_id) >= 1
        again = spawn_host(client, task_queue, tmp_path / "h2b", pg_store, "h2", second_daemon.url, 3)
        await until(lambda: containers(remote, run_id) == 0, 90, "the rejoined host to reap")
    finally:
        for pid in (one, two, again):
            if pid:
                procs.stop_pid(pid)


async def test_capacity_that_joins_mid_run_is_admitted_and_no_rollout_waits_in_vain(
    client: Client, second_daemon: SecondDockerd, pg_store: str, task_queue: str, tmp_path: Path
) -> None:
    run_id = "hosts-join"
    # member 1 of every group sleeps through its command timeout (its slot held ~3 s); member 0 completes
    rules = [ModeRule(on="request", prefix=f"{run_id}/{group_id(g)}/1", mode=Mode.SLEEP) for g in range(6)]
    settings = SimSettings(tasks=CODING_TASKS, mode=Mode.REFERENCE, mode_rules=rules, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        cfg = coding_config(
            url, task_queue, groups=6, size=2, rollout={"max_turns": 4}, sandbox={"command_timeout_s": 3},
            sandbox_pool={**HOSTS_POOL, "tasks_per_minute": 2.0},  # beyond the live slots: one group's burst
            admission={"enabled": True, "poll_interval_s": 0.5, "admit_window_s": 0.0, "initial_cap": 12,
                       "max_model_len": 4096},
        )  # fmt: skip
        store: RunStore = open_store(pg_store)
        one = spawn_host(client, task_queue, tmp_path / "h1", pg_store, "h1", LOCAL_DOCKER, 2)
        two = 0
        try:
            handle = await start_run(client, cfg, run_id)
            await until(lambda: len(store.rollouts(run_id)) >= 2, 120, "the first records")
            two = spawn_host(client, task_queue, tmp_path / "h2", pg_store, "h2", second_daemon.url, 4)
            await asyncio.wait_for(handle.result(), timeout=300)
        finally:
            for pid in (one, two):
                if pid:
                    procs.stop_pid(pid)
    rollouts, _ = export(store, run_id)
    assert len(rollouts) == 12
    outcomes = Counter((r["outcome"], r["reason"]) for r in rollouts)
    assert outcomes == {("completed", None): 6, ("truncated", "command_timeout"): 6}, outcomes
    log = store.dispatch_log(run_id)
    ready = [e["pool"]["ready"] for e in log if e["pool"] is not None]
    assert ready and ready[0] == 2 and max(ready) == 6, ready
    first_six = next(i for i, e in enumerate(log) if e["pool"] is not None and e["pool"]["ready"] == 6)
    # admission followed the live capacity: 2 slots plus one group's burst of the bucket, then more
    assert max(e["inflight"] + e["admitted"] for e in log[:first_six]) <= 4
    assert max(e["inflight"] + e["admitted"] for e in log[first_six:]) > 4
    report = await check_run(store, run_id, client=client)
    assert report.ok, "\n".join(report.lines())
    assert containers(DockerBackend(), run_id) == 0 and containers(second_daemon.backend(), run_id) == 0
