"""The fault kit's own faults through a running pipeline (real Temporal, real Docker; the simulated engine
unless the fault is the engine's), each run ending with the ledger check clean: a container frozen and one
OOM-killed mid-command, sandbox creation failing for a while during scale-up, a weight publish with
rollouts in flight (vLLM), a worker SIGSTOPped then SIGCONTed, and ``rollouts chaos`` itself as a CLI.

Coding modes are chosen per request id: the victim slots (``<run>/g000000/0``) run ``sleep 30`` each turn
(the command a fault lands in), every other slot the reference solution (the run's successes).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import docker as docker_sdk
import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.faults import LedgerReport, Planned
from durable_rollouts.faults import containers as cfaults
from durable_rollouts.faults import process as pfaults
from durable_rollouts.faults.chaos import Chaos
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.stack import procs
from durable_rollouts.store import RunStore
from tests import REPO_ROOT
from tests.conftest import MODEL_DIR, POLICY_VERSION, Engine
from tests.integration.support import (
    CODING_TASKS,
    coding_config,
    export,
    make_config,
    start_run,
    wait_for_first_command,
    worker,
)

VICTIMS = [f"{r}/{group_id(0)}/0" for r in ("frozen", "oom", "cli-chaos")] + [f"cli-chaos/{group_id(1)}/0"]
TURNS = {"max_turns": 2}
FAST_CMD = {"command_timeout_s": 3}
"""A command's limit; a frozen exec is given up ``3 + 1 + 10`` s after it started (the stream deadline)."""


@pytest.fixture(scope="module")
async def sim() -> AsyncIterator[str]:
    rules = [ModeRule(on="request", prefix=v, mode=Mode.SLEEP) for v in VICTIMS]
    settings = SimSettings(tasks=CODING_TASKS, mode_rules=rules, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def _ledger_where(docker: DockerBackend, store: RunStore) -> dict:
    return {"backend": docker, "pool": SandboxPool(store)}


def _victim(store, run_id: str) -> dict:
    return next(r for r in export(store, run_id)[0] if r["rollout_id"] == rollout_id(run_id, group_id(0), 0))


@pytest.mark.timeout(180)
async def test_a_container_frozen_mid_command_is_given_up_and_replayed(
    client: Client, docker: DockerBackend, sim: str, ledger: Callable[..., Awaitable[LedgerReport]],
    task_queue: str, tmp_path: Path,
) -> None:  # fmt: skip
    """Frozen past the exec's stream deadline: the sandbox is declared lost (never waited on forever, never
    scored), replaced and its recorded turns replayed; the run ends clean."""
    run_id = "frozen"
    cfg = coding_config(sim, task_queue, groups=1, size=2, rollout=TURNS, sandbox=FAST_CMD)
    async with worker(client, task_queue, tmp_path) as store:
        handle = await start_run(client, cfg, run_id)
        await wait_for_first_command(store, rollout_id(run_id, group_id(0), 0))
        await asyncio.sleep(0.5)  # `sleep 30` is running
        victim = next(
            c for c in cfaults.run_containers(run_id) if cfaults.rollout_of(c).endswith(f"{group_id(0)}/0")
        )
        with cfaults.paused(victim):
            victim.reload()
            assert victim.status == "paused"
            await asyncio.sleep(16.0)
        result = await asyncio.wait_for(handle.result(), 120)
        await ledger(store, run_id, client=client, **_ledger_where(docker, store))
        rec = _victim(store, run_id)
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    assert rec["sandbox_replays"] >= 1 and rec["reward"] is None  # lost, replaced; never scored as is


@pytest.mark.timeout(180)
async def test_a_container_oom_killed_mid_command_is_replaced_and_replayed(
    client: Client, docker: DockerBackend, sim: str, ledger: Callable[..., Awaitable[LedgerReport]],
    task_queue: str, tmp_path: Path,
) -> None:  # fmt: skip
    run_id = "oom"
    cfg = coding_config(sim, task_queue, groups=1, size=2, rollout=TURNS, sandbox=FAST_CMD)
    async with worker(client, task_queue, tmp_path) as store:
        handle = await start_run(client, cfg, run_id)
        await wait_for_first_command(store, rollout_id(run_id, group_id(0), 0))
        await asyncio.sleep(0.5)
        victim = next(
            c for c in cfaults.run_containers(run_id) if cfaults.rollout_of(c).endswith(f"{group_id(0)}/0")
        )
        assert await asyncio.to_thread(cfaults.oom, victim)  # the kernel OOM-killed it as a whole
        result = await asyncio.wait_for(handle.result(), 120)
        await ledger(store, run_id, client=client, **_ledger_where(docker, store))
        rec = _victim(store, run_id)
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    assert rec["sandbox_replays"] >= 1 and rec["reward"] is None


@pytest.fixture
def own_image(docker: DockerBackend) -> Iterator[str]:
    """A tag of the sandbox image that only this test uses (untagging the shared one would hit others)."""
    tag = f"chaos-{os.getpid()}"
    docker.client.images.get(DEFAULT_IMAGE).tag(DEFAULT_IMAGE.split(":")[0], tag)
    image = f"{DEFAULT_IMAGE.split(':')[0]}:{tag}"
    try:
        yield image
    finally:
        docker.client.images.remove(image, noprune=True)


@pytest.mark.timeout(240)
async def test_sandbox_creation_failing_for_a_while_during_scale_up_delays_instead_of_failing(
    client: Client, docker: DockerBackend, sim: str, ledger: Callable[..., Awaitable[LedgerReport]],
    own_image: str, task_queue: str, tmp_path: Path,
) -> None:  # fmt: skip
    """The image is gone for 20 s while the run starts its groups (longer than the create activity's own
    retries): every create fails as the real error path sees it (SandboxNotReady), the rollouts wait
    durably and go on once it is back; none fails."""
    run_id = "create-fails"
    cfg = coding_config(
        sim, task_queue, groups=3, size=2, run={"max_inflight_groups": 3}, sandbox={"image": own_image}
    )
    async with worker(client, task_queue, tmp_path) as store:
        with cfaults.image_unavailable(own_image):
            with pytest.raises(docker_sdk.errors.ImageNotFound):
                docker.client.images.get(own_image)
            handle = await start_run(client, cfg, run_id)
            await asyncio.sleep(20.0)
            assert docker.list_containers(run_id) == []  # nothing could be created meanwhile
        result = await asyncio.wait_for(handle.result(), 180)
        report = await ledger(store, run_id, client=client, **_ledger_where(docker, store))
        rollouts, _ = export(store, run_id)
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    assert report.successes == 6
    assert all(r["sandbox_slot_waits"] >= 1 for r in rollouts)  # each waited out the outage durably


@pytest.mark.timeout(400)
async def test_a_weight_publish_with_rollouts_in_flight(
    client: Client, engine: Engine, ledger: Callable[..., Awaitable[LedgerReport]], task_queue: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The injector's ``publish`` fault mid-run on vLLM: later tokens carry the new version, earlier ones
    the old; the run ends clean. The session engine gets its label back afterwards (same weights)."""
    run_id = "publish-mid-run"
    cfg = make_config(
        [engine.url], task_queue,
        run={"num_groups": 8, "group_size": 2, "max_inflight_groups": 4},
        sampling={"max_tokens": 48},
    )  # fmt: skip
    async with worker(client, task_queue, tmp_path) as store:
        store.put_policy(POLICY_VERSION, "bundled", str(MODEL_DIR), [engine.url])
        store.finish_policy(POLICY_VERSION, [engine.url])
        chaos = Chaos(tmp_path, [run_id], tmp_path / "chaos.jsonl", store=store, client=client)
        try:
            handle = await start_run(client, cfg, run_id)
            for _ in range(600):
                if sum(store.count_rollouts(run_id).values()) >= 2:
                    break
                await asyncio.sleep(0.1)
            await chaos.run([Planned(0.0, "publish", 0.0)])
            result = await asyncio.wait_for(handle.result(), 300)
        finally:
            procs.set_weight_version(engine.url, POLICY_VERSION)
        (fired,) = [e for e in chaos.events if e["event"] == "fired"]
        await ledger(store, run_id, client=client)
        rollouts, _ = export(store, run_id)
    versions = {v for r in rollouts for v in r["policy_versions"] if v is not None}
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    assert versions == {POLICY_VERSION, fired["version"]}, versions  # the publish landed mid-run
    assert "reload_weights" in fired["steps"]


def _spawn_worker(env: WorkflowEnvironment, task_queue: str, home: Path) -> int:
    address = env.client.service_client.config.target_host
    return procs.spawn("worker", procs.worker_argv(address, task_queue), home, {"ROLLOUTS_HOME": str(home)})


@pytest.mark.timeout(240)
async def test_a_worker_sigstopped_then_sigconted(
    temporal_env: WorkflowEnvironment, client: Client, ledger: Callable[..., Awaitable[LedgerReport]],
    task_queue: str, tmp_path: Path,
) -> None:  # fmt: skip
    """The only worker frozen for 12 s (past the model call's 10 s heartbeat timeout) mid-run, then thawed:
    the timed-out calls run again, late completions are dropped, the ledger is clean."""
    run_id = "worker-frozen"
    sim = {"policy": "random", "random_min_tokens": 4, "random_max_tokens": 8, "decode_ms_per_token": 60}
    async with SimEngine(SimSettings(**sim)).serve(port=0) as url:
        cfg = make_config(
            [url], task_queue,
            run={"num_groups": 4, "group_size": 2, "max_inflight_groups": 4}, rollout={"max_turns": 4},
        )  # fmt: skip
        pid = _spawn_worker(temporal_env, task_queue, tmp_path)
        try:
            store = RunStore(tmp_path)
            handle = await start_run(client, cfg, run_id)
            from tests.integration.test_faults import wait_for_model_turns

            await wait_for_model_turns(store, run_id, 3)
            (target,) = pfaults.targets(tmp_path, "worker")
            assert target.pid == pid
            with pfaults.frozen(target):
                await asyncio.sleep(0.2)
                assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
                done_frozen = sum(store.count_rollouts(run_id).values())
                await asyncio.sleep(12.0)
                assert sum(store.count_rollouts(run_id).values()) == done_frozen  # nothing moved
            result = await asyncio.wait_for(handle.result(), 180)
            await ledger(store, run_id, client=client)
        finally:
            procs.stop_pid(pid)
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    assert done_frozen < 8, "the freeze must land while rollouts are in flight"


@pytest.mark.timeout(300)
async def test_rollouts_chaos_runs_a_short_schedule_logs_each_fault_and_checks_the_ledger(
    temporal_env: WorkflowEnvironment, client: Client, sim: str, task_queue: str, tmp_path: Path
) -> None:
    """`rollouts chaos` as a user runs it: worker and container faults on a seeded 12 s schedule against a
    worker spawned from a stack home; every fault logged with its time; ledger clean; exit 0."""
    run_id = "cli-chaos"
    # the victims' `sleep 30` runs 15 s (a command timing out ends its rollout): the faults' targets
    cfg = coding_config(sim, task_queue, groups=3, size=2, sandbox={"command_timeout_s": 15}, rollout=TURNS)
    address = temporal_env.client.service_client.config.target_host
    _spawn_worker(temporal_env, task_queue, tmp_path)
    log = tmp_path / "chaos.jsonl"
    try:
        await start_run(client, cfg, run_id)
        await wait_for_first_command(RunStore(tmp_path), rollout_id(run_id, group_id(0), 0))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "durable_rollouts.cli.rollouts", "chaos", run_id,
            "--kinds", "container_kill,container_pause,container_oom,worker_freeze,worker_kill",
            "--seed", "5", "--duration", "12", "--every", "2,3", "--fault-s", "1,3",
            "--log", str(log), "--address", address, "--wait", "200",
            env={**os.environ, "ROLLOUTS_HOME": str(tmp_path)}, cwd=REPO_ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out = (await asyncio.wait_for(proc.communicate(), 260))[0].decode()
    finally:
        for t in pfaults.targets(tmp_path, "worker"):
            procs.stop_pid(t.pid)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    fired = [e for e in events if e["event"] == "fired"]
    assert proc.returncode == 0, out
    assert f"run {run_id}: ledger clean" in out
    assert len(fired) >= 3 and all(e["at"] > 0 and "target" in e for e in fired), events
    kinds = {e["kind"].split("_")[0] for e in fired}
    assert kinds == {"container", "worker"}, events  # both families landed (seed 5: oom, kill, pause, kill)
    assert sum(e["event"] == "error" for e in events) == 0, events
    lines = set(out.splitlines())
    assert all(line in lines for line in log.read_text().splitlines())  # each logged line on stdout too
