"""A Harbor rollout whose worker is SIGKILLed twice: inside its solution's bash step, then in its verifier.

The task (harbor_tasks/count-runs, played by the simulated engine from its reference transcript) counts
its own runs in the container: ``solve.sh`` appends a line to ``/app/step-runs.txt`` and sleeps, the
verifier appends to ``/app/verifier-runs.txt``, sleeps, and scores 1.0 only if the step ran exactly once;
both counts come back as the scored turn's metrics. Each kill is timed by polling the container for the
line the running script has just written (no fixed sleep), and is checked to have landed inside: the
step's observation, or the rollout's end, is not stored yet. A fresh worker then takes over the retried
activity. One undisturbed rollout of the same task, in the same test, is the reference.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable
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
from durable_rollouts.store import RunStore, model_segment, obs_segment
from tests import REPO_ROOT
from tests.integration.support import assert_no_containers, export, run_to_end, start_run, until, worker
from tests.integration.test_durability import spawn_worker
from tests.integration.test_harbor import harbor_base, harbor_config

TASK = REPO_ROOT / "tests" / "integration" / "harbor_tasks" / "count-runs"
UNDISTURBED = {"reward": 1.0, "step_runs": 1.0, "verifier_runs": 1.0}

__all__ = ["harbor_base"]  # the fixture, imported for its name


@pytest.fixture(scope="module")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    from harbor_env.transcripts import write

    transcripts = write(tmp_path_factory.mktemp("harbor-kill") / "transcripts.jsonl", TASK)
    rules = [ModeRule(on="request", prefix="harbor-ref", mode=Mode.REFERENCE)]
    settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=8192)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def lines_in(docker: DockerBackend, store: RunStore, rid: str, path: str) -> Callable[[], int]:
    """How many lines ``path`` holds in the rollout's container now (0 before it exists)."""

    def count() -> int:
        handle = store.get_sandbox(rid)
        if handle is None:
            return 0
        res = docker.exec(handle, f"cat {path} 2>/dev/null | grep -c .", timeout_s=10)
        return int(res.output.split()[0]) if res.output.split() else 0

    return count


def solve_turn(store: RunStore, rid: str) -> int | None:
    """The turn whose recorded action runs solve.sh (recorded before it runs)."""
    for seg in store.segments(rid):
        action = seg.meta.get("action") if seg.kind == "model" else None
        if action and action["arguments"].get("cmd", "").startswith("chmod +x /solution/solve.sh"):
            return seg.turn
    return None


@pytest.mark.timeout(600)
async def test_worker_sigkill_in_a_bash_step_and_in_the_verifier_runs_each_once(
    temporal_env: WorkflowEnvironment,
    client: Client,
    docker: DockerBackend,
    harbor_base: None,
    sim: str,
    task_queue: str,
    tmp_path: Path,
    ledger: Any,
) -> None:
    suffix = uuid.uuid4().hex[:8]  # no container of an earlier, interrupted session is reattached
    calm_id, run_id = f"harbor-ref-calm-{suffix}", f"harbor-ref-kill-{suffix}"
    async with worker(client, task_queue, tmp_path / "calm") as calm:
        await run_to_end(client, harbor_config(sim, task_queue, TASK, groups=1, size=1), calm_id)
    (undisturbed,), _ = export(calm, calm_id)
    assert undisturbed["outcome"] == "completed", undisturbed["reason"]
    assert undisturbed["turns"][-1]["metrics"] == UNDISTURBED

    rid = rollout_id(run_id, group_id(0), 0)
    home = tmp_path / "kill"
    store = RunStore(home)
    pids = [spawn_worker(temporal_env, task_queue, home, "worker-1")]
    try:
        handle = await start_run(client, harbor_config(sim, task_queue, TASK, groups=1, size=1), run_id)
        steps = lines_in(docker, store, rid, "/app/step-runs.txt")
        await until(lambda: steps() > 0, 180, "solve.sh to start", every_s=0.2)
        os.killpg(pids[0], signal.SIGKILL)
        turn = solve_turn(store, rid)
        assert turn is not None and store.get_segment(rid, obs_segment(turn)) is None, "killed after the step"
        pids.append(spawn_worker(temporal_env, task_queue, home, "worker-2"))

        verifier = lines_in(docker, store, rid, "/app/verifier-runs.txt")
        await until(lambda: verifier() > 0, 180, "the verifier to start", every_s=0.2)
        os.killpg(pids[1], signal.SIGKILL)
        last = max(s.turn for s in store.segments(rid) if s.kind == "model" and s.turn is not None)
        seg = store.get_segment(rid, model_segment(last))
        assert seg is not None and "step" not in seg.meta, "killed after the verifier"
        assert (steps(), verifier()) == (1, 1), "the step ran again"
        pids.append(spawn_worker(temporal_env, task_queue, home, "worker-3"))
        result = await asyncio.wait_for(handle.result(), timeout=300)
        for pid in pids:
            procs.stop_pid(pid)
        assert result.done
        rollouts, groups = export(store, run_id)
        assert len(rollouts) == 1 and len(groups) == 1  # one record
        (rec,) = rollouts
        assert rec["outcome"] == "completed", rec["reason"]
        assert rec["turns"][-1]["metrics"] == UNDISTURBED  # the step and the verifier each ran once
        assert rec["reward"] == undisturbed["reward"] == 1.0
        assert [t["range"] for t in rec["turns"]] == [t["range"] for t in undisturbed["turns"]]
        await ledger(store, run_id, client=client, backend=docker, pool=SandboxPool(store))
        assert_no_containers(docker, run_id)
    finally:
        for pid in pids:
            procs.stop_pid(pid)
        docker.reap(run_id=run_id)  # a failed run's container (the assertion above saw none left)
