"""Ending a rollout early: a cancel signal mid-generate, a group shedding a member for admission, and the
rollout's wall-clock limit (skipped in time). Each still writes exactly one record."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError

from durable_rollouts.admission.controller import CANCEL_REASON
from durable_rollouts.contracts.activity_io import FinalizeRolloutInput, GenerateInput, StoredOutcome
from durable_rollouts.contracts.sandbox import SandboxCreated, SandboxStepInput
from durable_rollouts.contracts.types import (
    EnvTraits,
    GroupInput,
    GroupResult,
    Outcome,
    RolloutResult,
    TurnResult,
)
from durable_rollouts.sandboxes.base import SandboxSpec
from durable_rollouts.workflows.group import GroupWorkflow
from durable_rollouts.workflows.rollout import RolloutWorkflow

from .fakes import Fakes, fake_worker, rollout_input, wait_for


class Hang:
    """A generate_turn hook that blocks (heartbeating) until the activity is cancelled, for the rollouts
    and turns it is told to."""

    def __init__(self, turn: int, rollout_suffix: str = "") -> None:
        self.turn, self.suffix = turn, rollout_suffix
        self.started = asyncio.Event()
        self.cancelled: list[str] = []

    async def __call__(self, inp: GenerateInput) -> TurnResult | None:
        if inp.turn != self.turn or not inp.rollout_id.endswith(self.suffix):
            return None
        self.started.set()
        try:
            while True:
                activity.heartbeat()
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            self.cancelled.append(inp.rollout_id)
            raise


async def test_cancel_signal_mid_generate_ends_cancelled_with_one_record(
    own_client: Client, uid: str
) -> None:
    fakes = Fakes()
    hang = fakes.generate_hook = Hang(turn=1)
    inp = rollout_input(uid)
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        handle = await own_client.start_workflow(RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=tq)
        await asyncio.wait_for(hang.started.wait(), 10)
        await handle.signal(RolloutWorkflow.cancel_for, "manual")
        result: RolloutResult = await handle.result()
        # The in-flight model call is cancelled too (its next heartbeat learns it).
        await wait_for(lambda: hang.cancelled == [inp.rollout_id], what="the activity's cancellation")

    assert (result.outcome, result.reason) == (Outcome.CANCELLED, "manual")
    assert (result.reward, result.scorable, result.turns) == (None, False, 1)
    [rec] = fakes.finalized(inp.rollout_id)
    assert (rec.outcome, rec.reason, rec.scorable) == (Outcome.CANCELLED, "manual", False)
    assert rec.wasted_tokens is None, "only admission cancels count wasted tokens"
    assert rec.state.sampled_tokens == 10


class LateWriter(Hang):
    """Like Hang, but on cancellation keeps working a while (as a real call writing its segment would)
    and notes when it stopped, beside the finalize calls."""

    def __init__(self, fakes: Fakes, turn: int) -> None:
        super().__init__(turn)
        self.fakes = fakes

    async def __call__(self, inp: GenerateInput) -> TurnResult | None:
        try:
            return await super().__call__(inp)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)
            self.fakes.calls["generate_turn_stopped"].append(len(self.fakes.calls["finalize_rollout"]))
            raise


async def test_a_cancelled_model_call_stops_before_the_record_is_written(
    own_client: Client, uid: str
) -> None:
    """The rollout waits for its cancelled model call to stop: nothing that call writes can land after the
    record (whose token count it would then contradict)."""
    fakes = Fakes()
    late = fakes.generate_hook = LateWriter(fakes, turn=1)
    inp = rollout_input(uid)
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        handle = await own_client.start_workflow(RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=tq)
        await asyncio.wait_for(late.started.wait(), 10)
        await handle.signal(RolloutWorkflow.cancel_for, "manual")
        result: RolloutResult = await handle.result()
    assert result.outcome == Outcome.CANCELLED
    assert fakes.calls["generate_turn_stopped"] == [0], "the record was written before the call stopped"
    assert len(fakes.finalized(inp.rollout_id)) == 1


async def test_cancel_signal_before_start_still_records(ts_client: Client, uid: str) -> None:
    """A cancel that arrives with the first workflow task (signal-with-start) cancels before any turn."""
    fakes = Fakes()
    inp = rollout_input(uid)
    tq = f"tq-{uid}"
    async with fake_worker(ts_client, tq, fakes):
        handle = await ts_client.start_workflow(
            RolloutWorkflow.run,
            inp,
            id=inp.rollout_id,
            task_queue=tq,
            start_signal="cancel_for",
            start_signal_args=["early"],
        )
        result: RolloutResult = await handle.result()

    assert (result.outcome, result.reason, result.turns) == (Outcome.CANCELLED, "early", 0)
    assert len(fakes.finalized(inp.rollout_id)) == 1


async def test_group_shed_cancels_the_youngest_member_for_admission(own_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 2
    hang = fakes.generate_hook = Hang(turn=1, rollout_suffix="/1")  # member 1 blocks on its second turn
    template = rollout_input(uid)
    run_id, gid = template.run_id, "g000000"
    inp = GroupInput(
        run_id=run_id, group_id=gid, task_id="task-0", size=2, advantage_eps=1e-6, template=template
    )
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        handle = await own_client.start_workflow(GroupWorkflow.run, inp, id=f"{run_id}/{gid}", task_queue=tq)
        await asyncio.wait_for(hang.started.wait(), 10)
        await wait_for(lambda: f"{run_id}/{gid}/0" in fakes.records, what="member 0's record")
        await handle.signal(GroupWorkflow.shed, 1)
        result: GroupResult = await handle.result()
        await wait_for(lambda: hang.cancelled == [f"{run_id}/{gid}/1"], what="member 1's model call cancel")

    assert result.outcomes == {"completed": 1, "cancelled": 1}
    assert (result.size, result.scorable, result.failed) == (2, 1, 0)
    assert (result.admission_cancelled, result.wasted_tokens) == (1, 10)
    [m0] = fakes.finalized(f"{run_id}/{gid}/0")
    [m1] = fakes.finalized(f"{run_id}/{gid}/1")
    assert (m0.outcome, m0.reward) == (Outcome.COMPLETED, 1.0)
    assert (m1.outcome, m1.reason, m1.wasted_tokens, m1.scorable) == (
        Outcome.CANCELLED, CANCEL_REASON, 10, False,
    )  # fmt: skip
    [group] = fakes.calls["finalize_group"]
    assert group.record == result
    assert set(group.advantages) == {m0.rollout_id, m1.rollout_id}
    assert group.advantages[m1.rollout_id] is None


async def test_group_shed_with_redispatch_runs_the_slot_again(own_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 2
    hang = fakes.generate_hook = Hang(turn=1, rollout_suffix="/1")  # only the first attempt ends in "/1"
    template = rollout_input(uid)
    run_id, gid = template.run_id, "g000000"
    inp = GroupInput(
        run_id=run_id,
        group_id=gid,
        task_id="task-0",
        size=2,
        advantage_eps=1e-6,
        template=template,
        redispatch_cancelled=True,
    )
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        handle = await own_client.start_workflow(GroupWorkflow.run, inp, id=f"{run_id}/{gid}", task_queue=tq)
        await asyncio.wait_for(hang.started.wait(), 10)
        await handle.signal(GroupWorkflow.shed, 1)
        result: GroupResult = await handle.result()

    assert result.outcomes == {"completed": 2, "cancelled": 1}
    assert (result.size, result.scorable, result.admission_cancelled) == (2, 2, 1)
    retry = fakes.finalized(f"{run_id}/{gid}/1r1")
    assert [(r.outcome, r.sample_index) for r in retry] == [(Outcome.COMPLETED, 1)]
    assert sorted(fakes.records) == sorted(f"{run_id}/{gid}/{s}" for s in ("0", "1", "1r1"))
    assert all(len(fakes.finalized(rid)) == 1 for rid in fakes.records)


async def test_timeout_while_paused_truncates_with_reason_timeout(ts_client: Client, uid: str) -> None:
    """A partial rollout waits (durable timers) for a policy version that is never published: its
    wall-clock limit of an hour, skipped in time, ends it truncated (timeout) with its record."""
    fakes = Fakes()
    fakes.done_on_turn = None
    inp = rollout_input(uid, timeout_s=3600.0, step_token_budget=10, partial_poll_s=60.0)
    tq = f"tq-{uid}"
    async with fake_worker(ts_client, tq, fakes):
        handle = await ts_client.start_workflow(RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=tq)
        result: RolloutResult = await handle.result()
        desc = await handle.describe()

    assert (result.outcome, result.reason, result.turns) == (Outcome.TRUNCATED, "timeout", 1)
    [rec] = fakes.finalized(inp.rollout_id)
    assert (rec.outcome, rec.reason, rec.score_truncated) == (Outcome.TRUNCATED, "timeout", False)
    assert rec.state.partial_steps == 0
    assert len(fakes.calls["generate_turn"]) == 1
    # about one version check per poll interval over the hour (skipped, not waited)
    assert 3600 / 60 <= len(fakes.calls["latest_policy_version"]) <= 3600 / 60 + 3
    assert desc.close_time is not None and desc.start_time is not None
    assert (desc.close_time - desc.start_time).total_seconds() >= 3600


async def test_timeout_mid_generate_truncates_and_cancels_the_call(own_client: Client, uid: str) -> None:
    """A model call that never returns: the rollout's limit ends it truncated (timeout) and the call is
    cancelled. The test server does not skip time while an activity runs, so the limit is 1 s of real time.
    """
    fakes = Fakes()
    hang = fakes.generate_hook = Hang(turn=1)
    inp = rollout_input(uid, timeout_s=1.0)
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        result: RolloutResult = await own_client.execute_workflow(
            RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=tq
        )
        await wait_for(lambda: hang.cancelled == [inp.rollout_id], what="the activity's cancellation")

    assert (result.outcome, result.reason, result.turns) == (Outcome.TRUNCATED, "timeout", 1)
    [rec] = fakes.finalized(inp.rollout_id)
    assert (rec.outcome, rec.reason, rec.score_truncated) == (Outcome.TRUNCATED, "timeout", False)


async def test_a_tasks_own_limit_truncates_mid_generate_when_shorter_than_the_runs(
    own_client: Client, uid: str
) -> None:
    """``SandboxCreated.timeout_s`` (a Harbor task's ``[agent].timeout_sec``) limits the rollout from its
    sandbox's creation: a model call still running when it passes is cancelled and the rollout truncates
    (timeout), though the run's own limit (600 s) is far off; its sandbox is destroyed."""

    async def limited(s: SandboxStepInput) -> SandboxCreated:
        return SandboxCreated(created=True, host="h", timeout_s=1.0)

    fakes = Fakes()
    hang = fakes.generate_hook = Hang(turn=1)
    fakes.sandbox_create_hook = limited
    inp = rollout_input(uid, env=EnvTraits(name="fake", uses_sandbox=True), sandbox=SandboxSpec())
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        result: RolloutResult = await own_client.execute_workflow(
            RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=tq
        )
        await wait_for(lambda: hang.cancelled == [inp.rollout_id], what="the activity's cancellation")
    assert (result.outcome, result.reason, result.turns) == (Outcome.TRUNCATED, "timeout", 1)
    [rec] = fakes.finalized(inp.rollout_id)
    assert rec.state.task_deadline is not None
    assert fakes.calls["sandbox_destroy"] == [inp.rollout_id]


async def test_member_whose_workflow_dies_gets_one_record_from_its_group(ts_client: Client, uid: str) -> None:
    """A member whose workflow fails without its record (here: its own record write fails for good) is
    recorded by its group, failed (infra), and the group still closes on count.

    (Terminating the member would be the natural way to kill it, but the test server never reports a
    child's termination to its parent: the group would wait forever; see temporalio/sdk-java#2921.)
    """
    fakes = Fakes()
    fakes.done_on_turn = 2
    template = rollout_input(uid)
    run_id, gid = template.run_id, "g000000"
    dying = f"{run_id}/{gid}/1"
    real_finalize = fakes.finalize_rollout

    @activity.defn(name="finalize_rollout")
    async def finalize_fails_once_for_member_1(inp: FinalizeRolloutInput) -> StoredOutcome:
        if inp.rollout_id == dying and not fakes.calls["finalize_rollout_refused"]:
            fakes.calls["finalize_rollout_refused"].append(inp)
            raise ApplicationError("store gone", type="StoreError", non_retryable=True)
        return await real_finalize(inp)

    fakes.finalize_rollout = finalize_fails_once_for_member_1  # type: ignore[method-assign]
    inp = GroupInput(
        run_id=run_id, group_id=gid, task_id="task-0", size=2, advantage_eps=1e-6, template=template
    )
    tq = f"tq-{uid}"
    async with fake_worker(ts_client, tq, fakes):
        handle = await ts_client.start_workflow(GroupWorkflow.run, inp, id=f"{run_id}/{gid}", task_queue=tq)
        result: GroupResult = await handle.result()
        member = await ts_client.get_workflow_handle(dying).describe()

    assert member.status == WorkflowExecutionStatus.FAILED
    [refused] = fakes.calls["finalize_rollout_refused"]
    assert refused.outcome == Outcome.COMPLETED, "the member had completed when its record write failed"
    assert result.outcomes == {"completed": 1, "failed": 1}
    assert (result.size, result.scorable, result.failed, result.admission_cancelled) == (2, 1, 1, 0)
    [dead] = fakes.finalized(dying)
    assert dead.outcome == Outcome.FAILED and not dead.scorable and dead.turns == 0
    assert dead.reason is not None and dead.reason.startswith("infra: child workflow")
    assert sorted(fakes.records) == [f"{run_id}/{gid}/0", dying]
    assert len(fakes.calls["finalize_group"]) == 1
