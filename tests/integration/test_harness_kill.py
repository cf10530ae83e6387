"""A worker SIGKILLed while mini-swe-agent's model call waits at the gateway: the harness keeps running in
its container, the pending call is answered once (after its activity is retried on another worker), and
the rollout still scores 1.0; mini-swe-agent's own trajectory file (kept with the rollout) agrees with the
gateway's log: every answer seen once.

Real Temporal, real Docker, the scripted engine slowed down (each call takes seconds), two worker
processes one after the other; the harness's client (litellm through mini-swe-agent) retries the call
whose connection died with the first worker (mini-swe-agent's retry: 4 s to 60 s between attempts).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from tests import REPO_ROOT
from tests.integration.support import assert_no_containers, export, start_run
from tests.integration.test_harness import (  # noqa: F401  (fixtures)
    HARBOR,
    HARNESS,
    assert_token_exact,
    assert_trajectory_agrees,
    dataset,
    harness_config,
    harness_image,
)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
async def slow_sim(
    harness_image: Path,  # noqa: F811
    dataset: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[str]:
    from harness_env.transcripts import write

    transcripts = write(tmp_path_factory.mktemp("tr") / "transcripts.jsonl", dataset)
    rules = [ModeRule(on="request", prefix="", mode=Mode.REFERENCE)]
    settings = SimSettings(
        transcripts=transcripts, mode_rules=rules, max_model_len=65536, decode_ms_per_token=20.0
    )
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def spawn(env: WorkflowEnvironment, task_queue: str, home: Path, name: str, site: Path) -> int:
    address = env.client.service_client.config.target_host
    parts = [site, HARNESS, HARBOR, REPO_ROOT]
    path = os.pathsep.join([*map(str, parts), os.environ.get("PYTHONPATH", "")])
    return procs.spawn(
        name,
        procs.worker_argv(address, task_queue),
        home,
        env={"ROLLOUTS_HOME": str(home), "PYTHONPATH": path},
    )


async def test_worker_sigkill_while_a_harness_call_waits(
    temporal_env: WorkflowEnvironment, client: Client, docker: DockerBackend,
    harness_image: Path,  # noqa: F811
    slow_sim: str,
    dataset: Path,  # noqa: F811
    task_queue: str, tmp_path: Path, ledger: Any,
) -> None:  # fmt: skip
    run_id = "harness-sigkill"
    rid = rollout_id(run_id, group_id(0), 0)
    cfg = harness_config([slow_sim], task_queue, dataset, "mini-swe-agent")
    store = RunStore(tmp_path)
    first = spawn(temporal_env, task_queue, tmp_path, "worker-1", harness_image)
    second = None
    try:
        handle = await start_run(client, cfg, run_id)
        for _ in range(1200):  # wait for call 1 to be recorded and not answered yet (the engine is slow)
            calls = store.gateway_calls(rid)
            if len(calls) >= 2 and not calls[-1].answered:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(
                f"no pending call 1: {[(c.index, c.status) for c in store.gateway_calls(rid)]}"
            )
        killed_at = calls[-1].index
        os.killpg(first, signal.SIGKILL)
        kill_time = time.time()
        assert rid in [i.key for i in docker.list_containers(run_id)]  # the harness's sandbox lives on
        second = spawn(temporal_env, task_queue, tmp_path, "worker-2", harness_image)
        await asyncio.wait_for(handle.result(), timeout=600)
    finally:
        procs.stop_pid(first)
        if second is not None:
            procs.stop_pid(second)
    await ledger(store, run_id, client=client, backend=docker, pool=SandboxPool(store))
    (rec,), _ = export(store, run_id)
    assert rec["outcome"] == "completed" and rec["reward"] == 1.0, rec["reason"]
    calls = store.gateway_calls(rid)
    segs = store.segments(rid)
    model = [s for s in segs if s.kind == "model"]
    # Every call answered and sampled exactly once; the one pending at the kill among them.
    assert [c.index for c in calls] == [s.turn for s in model] == list(range(len(calls)))
    assert killed_at < len(calls) and all(c.status == 200 for c in calls)
    (answered_at,) = store.db.execute(
        "SELECT answered_at FROM gateway_calls WHERE rollout_id=? AND idx=?", (rid, killed_at)
    ).fetchone()
    assert answered_at > kill_time  # the pending call was answered by the second worker
    assert_token_exact(store, rec)
    assert_trajectory_agrees(store, rid)  # the harness got every reply once, the pending one included
    assert_no_containers(docker, run_id)
