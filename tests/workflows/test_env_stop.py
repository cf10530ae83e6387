"""A streak of environment failures stops the run, on the test server with fake activities: no group starts
after it, the groups in flight are cancelled (reason run-stopped), the store is told ``stopped`` and the
run returns its progress with a one-line reason. The history replays."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from durable_rollouts.config.models import Config, RolloutConfig, RunConfig
from durable_rollouts.contracts.activity_io import EnvStepInput, GenerateInput
from durable_rollouts.contracts.types import Outcome, RunInput, RunProgress, group_id
from durable_rollouts.workflows.group import RUN_STOP_REASON
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import WORKFLOWS, Fakes, fake_worker


def env_config(groups: int, inflight: int, stop_after: int | None) -> Config:
    return Config(
        run=RunConfig(num_groups=groups, group_size=2, max_inflight_groups=inflight,
                      max_consecutive_environment_failures=stop_after),
        rollout=RolloutConfig(max_turns=1),
    )  # fmt: skip


def broken_env(fakes: Fakes) -> None:
    """Every env step raises in the environment's code."""

    async def hook(inp: EnvStepInput) -> Any:
        raise ApplicationError("KeyError: 'answer'", type="EnvironmentFailure", non_retryable=True)

    fakes.env_hook = hook


async def run(client: Client, fakes: Fakes, inp: RunInput, uid: str) -> RunProgress:
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        result: RunProgress = await handle.result()
        history = await handle.fetch_history()
    await Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter).replay_workflow(history)
    return result


async def test_an_environment_failing_every_rollout_stops_the_run(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    broken_env(fakes)
    inp = RunInput(run_id=f"run-{uid}", config=env_config(groups=20, inflight=1, stop_after=3))
    result = await run(ts_client, fakes, inp, uid)
    # group 0: 2 failures in a row, group 1: 4 >= 3: stopped; groups 2.. never start
    assert (
        result.stopped
        == "4 consecutive environment failures (last: environment: EnvironmentFailure: KeyError: 'answer')"
    )
    assert not result.done and result.groups_done == 2 and result.outcomes == {"failed": 4}
    assert sorted(fakes.groups) == [group_id(0), group_id(1)]
    assert fakes.calls["finish_run_status"] == ["stopped"]


async def test_the_groups_in_flight_are_cancelled(own_client: Client, uid: str) -> None:
    fakes = Fakes()
    broken_env(fakes)

    async def later_groups_held(inp: GenerateInput) -> Any:
        while int(inp.rollout_id.split("/")[1].removeprefix("g")) >= 2:  # heartbeats until cancelled
            activity.heartbeat()
            await asyncio.sleep(0.05)
        return None

    fakes.generate_hook = later_groups_held
    inp = RunInput(run_id=f"run-{uid}", config=env_config(groups=20, inflight=3, stop_after=3))
    result = await run(own_client, fakes, inp, uid)
    assert result.stopped is not None and result.stopped.startswith("4 consecutive environment failures")
    # groups 0 and 1 fail; group 2 and (admitted when group 0 freed its slot, unless both closed at once)
    # group 3 are held in flight, then cancelled; nothing starts after the stop
    started = sorted(fakes.groups)
    assert started in ([group_id(g) for g in range(3)], [group_id(g) for g in range(4)])
    assert result.groups_done == len(started) and fakes.records
    held = {rid: r for rid, r in fakes.records.items() if int(rid.split("/")[1].removeprefix("g")) >= 2}
    assert len(held) == 2 * (len(started) - 2)
    assert {(r.outcome, r.reason) for r in held.values()} == {(Outcome.CANCELLED, RUN_STOP_REASON)}
    assert fakes.calls["finish_run_status"] == ["stopped"]


async def test_successes_in_between_or_no_threshold_never_stop_it(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    broken_env(fakes)
    inp = RunInput(run_id=f"run-{uid}", config=env_config(groups=4, inflight=1, stop_after=None))
    result = await run(ts_client, fakes, inp, uid)
    assert result.done and result.stopped is None and result.outcomes == {"failed": 8}
    assert fakes.calls["finish_run_status"] == ["finished"]
