"""Infra retries that keep groups whole, on the time-skipping server with fake activities: a member that
failed for infrastructure runs again under the next attempt id (``rollout.infra_retries``), the failed
attempt keeps its record and is marked superseded; once the retries are spent the group either leaves the
member out (``exclude``) or is unscorable as a whole (``fail-group``). Each history replays."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from durable_rollouts.config.models import Config, GroupConfig, RolloutConfig, RunConfig
from durable_rollouts.contracts.activity_io import GenerateInput
from durable_rollouts.contracts.types import (
    EnvStepResult,
    GroupInput,
    GroupResult,
    Outcome,
    RunInput,
    RunProgress,
)
from durable_rollouts.workflows.group import GroupWorkflow
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import WORKFLOWS, Fakes, fake_worker, rollout_input


def failing(fakes: Fakes, ids: set[str]) -> None:
    """The model calls of these rollouts fail for good, as infra (the engine rejects them)."""

    async def hook(inp: GenerateInput) -> Any:
        if inp.rollout_id in ids:
            raise ApplicationError("flaky host", type="EngineBadRequest", non_retryable=True)
        return None

    fakes.generate_hook = hook


async def replays(client: Client, workflow_id: str) -> None:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    await Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter).replay_workflow(history)


async def run_group(
    client: Client, fakes: Fakes, uid: str, **settings: Any
) -> tuple[GroupInput, GroupResult]:
    template = rollout_input(uid)
    inp = GroupInput(
        run_id=template.run_id, group_id="g000000", task_id="task-0", size=3, advantage_eps=1e-6,
        template=template, **settings,
    )  # fmt: skip
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        wid = f"{inp.run_id}/{inp.group_id}"
        result: GroupResult = await (
            await client.start_workflow(GroupWorkflow.run, inp, id=wid, task_queue=tq)
        ).result()
        await replays(client, wid)
    return result


async def test_an_infra_failed_member_runs_again_until_it_is_scored(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 1
    slot = f"run-{uid}/g000000/1"
    failing(fakes, {slot, f"{slot}r1"})  # two attempts fail; the third (r2) is the retry budget's last

    async def reward_by_slot(inp: Any) -> Any:  # distinct rewards: the statistics show who is compared
        return EnvStepResult(done=True, reward=float(inp.rollout_id.rsplit("/", 1)[-1][0]))

    fakes.env_hook = reward_by_slot
    result = await run_group(ts_client, fakes, uid, infra_retries=2)

    attempts = [slot, f"{slot}r1", f"{slot}r2"]
    assert [f.rollout_id for f in fakes.finalized() if f.sample_index == 1] == attempts
    assert [fakes.records[a].outcome for a in attempts] == [Outcome.FAILED, Outcome.FAILED, Outcome.COMPLETED]
    assert all((fakes.records[a].reason or "").startswith("infra: EngineBadRequest") for a in attempts[:2])
    assert fakes.records[attempts[2]].scorable and fakes.records[attempts[2]].reward == 1.0
    assert (result.size, result.scorable, result.failed, result.superseded) == (3, 3, 2, 2)
    assert result.reward_mean == 1.0 and result.unscorable_reason is None  # rewards 0, 1, 2: all three
    [closed] = fakes.calls["finalize_group"]
    assert closed.superseded == {slot: f"{slot}r1", f"{slot}r1": f"{slot}r2"} and closed.unscorable == []
    assert closed.advantages[attempts[2]] is not None
    assert closed.advantages[slot] is None and closed.advantages[f"{slot}r1"] is None


async def test_without_retries_the_member_fails_once(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 1
    slot = f"run-{uid}/g000000/1"
    failing(fakes, {slot})
    result = await run_group(ts_client, fakes, uid)  # infra_retries 0: groups started before the setting
    assert [f.rollout_id for f in fakes.finalized() if f.sample_index == 1] == [slot]
    assert (result.scorable, result.failed, result.superseded) == (2, 1, 0)


async def test_retries_spent_exclude_leaves_the_member_out(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 1
    slot = f"run-{uid}/g000000/2"
    failing(fakes, {slot, f"{slot}r1"})
    result = await run_group(ts_client, fakes, uid, infra_retries=1, on_infra_failure="exclude")
    assert [f.rollout_id for f in fakes.finalized() if f.sample_index == 2] == [slot, f"{slot}r1"]
    assert (result.scorable, result.failed, result.superseded) == (2, 2, 1)
    assert result.unscorable_reason is None and result.reward_mean == 1.0
    [closed] = fakes.calls["finalize_group"]
    assert closed.superseded == {slot: f"{slot}r1"}  # the last attempt is final, not superseded
    assert closed.unscorable == []


async def test_fail_group_makes_the_whole_group_unscorable(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 1
    slot = f"run-{uid}/g000000/2"
    failing(fakes, {slot, f"{slot}r1"})
    result = await run_group(ts_client, fakes, uid, infra_retries=1, on_infra_failure="fail-group")
    assert result.unscorable_reason is not None and result.unscorable_reason.startswith(f"{slot}r1: infra: ")
    assert (result.scorable, result.failed, result.superseded) == (0, 2, 1)
    assert result.reward_mean is None and result.successes == 2  # the breaker still sees the fleet work
    [closed] = fakes.calls["finalize_group"]
    assert set(closed.advantages.values()) == {None}
    assert closed.unscorable == sorted(fakes.records) and len(closed.unscorable) == 4


async def test_the_run_hands_its_settings_to_its_groups(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 1
    slot = f"run-{uid}/g000001/0"
    failing(fakes, {slot})
    cfg = Config(
        run=RunConfig(num_groups=2, group_size=2, max_inflight_groups=2),
        rollout=RolloutConfig(max_turns=1),  # infra_retries: the default, 1
        group=GroupConfig(on_infra_failure="fail-group"),
    )
    inp = RunInput(run_id=f"run-{uid}", config=cfg)
    tq = f"tq-{uid}"
    async with fake_worker(ts_client, tq, fakes):
        handle = await ts_client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        result: RunProgress = await handle.result()
        await replays(ts_client, inp.run_id)
    assert result.done and result.outcomes == {"completed": 4, "failed": 1}
    assert fakes.records[f"{slot}r1"].outcome == Outcome.COMPLETED
    assert fakes.groups["g000001"].record.superseded == 1
    assert fakes.groups["g000001"].record.unscorable_reason is None  # the retry was scored
