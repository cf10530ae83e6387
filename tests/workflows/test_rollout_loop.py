"""RolloutWorkflow's turn loop on the time-skipping test server: completion, each limit, infra and
environment failures, failover and the sandbox path; every ending writes exactly one record."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from durable_rollouts.contracts.activity_io import EnvStepInput, GenerateInput
from durable_rollouts.contracts.types import (
    EngineTarget,
    EnvTraits,
    Outcome,
    RolloutInput,
    RolloutResult,
    SandboxStepInput,
)
from durable_rollouts.sandboxes.base import SandboxSpec
from durable_rollouts.workflows.rollout import RolloutWorkflow, rollout_replicas

from .fakes import Fakes, fake_worker, rollout_input

NO_OUTAGE_BUDGET = EngineTarget(
    urls=["http://engine-a"], model="tiny", request_timeout_s=30.0, outage_budget_s=0
)
"""The fakes' engine, failing at once when it is unavailable (no outage to wait out)."""


async def run_rollout(client: Client, fakes: Fakes, inp: RolloutInput, uid: str) -> RolloutResult:
    async with fake_worker(client, f"tq-{uid}", fakes):
        result: RolloutResult = await client.execute_workflow(
            RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=f"tq-{uid}"
        )
    assert len(fakes.finalized(inp.rollout_id)) == 1, "exactly one finalize_rollout per rollout"
    return result


async def test_three_turns_then_done_completes_with_reward(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn, fakes.reward = 3, 0.75
    inp = rollout_input(uid)
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert (result.outcome, result.reason, result.reward, result.scorable) == (
        Outcome.COMPLETED, None, 0.75, True,
    )  # fmt: skip
    assert result.turns == 3
    assert [g.turn for g in fakes.calls["generate_turn"]] == [0, 1, 2]
    assert [e.turn for e in fakes.calls["env_step"]] == [0, 1, 2]
    assert [e.last_turn for e in fakes.calls["env_step"]] == [False, False, False]
    # Only the first call renders the prompt (no sandbox: no separate prepare activity).
    assert [g.prepare is not None for g in fakes.calls["generate_turn"]] == [True, False, False]
    assert fakes.calls["prepare_rollout"] == []
    # prompt 7, three turns of 10, two observations of 5 (the last turn ends the rollout)
    assert result.num_tokens == 7 + 3 * 10 + 2 * 5
    rec = fakes.finalized(inp.rollout_id)[0]
    assert (rec.outcome, rec.reward, rec.scorable, rec.turns) == (Outcome.COMPLETED, 0.75, True, 3)
    assert rec.state.sampled_tokens == 30 and rec.state.version == "v1"
    assert rec.score_truncated is None and rec.wasted_tokens is None


async def test_max_turns_truncates(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = None
    inp = rollout_input(uid, max_turns=2)
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert (result.outcome, result.reason, result.reward) == (Outcome.TRUNCATED, "max_turns", None)
    assert result.turns == 2 and not result.scorable
    assert len(fakes.calls["generate_turn"]) == 2
    assert [e.last_turn for e in fakes.calls["env_step"]] == [False, True]
    assert not any(e.score_only for e in fakes.calls["env_step"])
    assert fakes.finalized(inp.rollout_id)[0].score_truncated is False


async def test_max_turns_truncated_and_scored(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = None
    inp = rollout_input(uid, max_turns=2, score_truncated=True)
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert (result.outcome, result.reason) == (Outcome.TRUNCATED, "max_turns")
    assert (result.reward, result.scorable) == (fakes.truncated_reward, True)
    assert [e.score_only for e in fakes.calls["env_step"]] == [False, False, True]
    assert fakes.finalized(inp.rollout_id)[0].score_truncated is True


async def test_token_budget_truncates_between_turns(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = None
    # prompt 7 + turn 10 + obs 5 + turn 10 + obs 5 = 37: no budget left for a third turn
    inp = rollout_input(uid, max_total_tokens=37)
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert (result.outcome, result.reason) == (Outcome.TRUNCATED, "token_budget")
    assert (result.turns, result.num_tokens) == (2, 37)
    assert len(fakes.calls["generate_turn"]) == 2
    assert [g.max_tokens for g in fakes.calls["generate_turn"]] == [16, 37 - 22]
    assert all(g.max_total_tokens == 37 for g in fakes.calls["generate_turn"])


async def test_token_budget_truncates_a_turn_cut_by_length(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = None
    # turn 0: 7 -> 17, obs -> 22; turn 1 may sample only 8 and stops for length at 30
    inp = rollout_input(uid, max_total_tokens=30)
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert (result.outcome, result.reason) == (Outcome.TRUNCATED, "token_budget")
    assert [g.max_tokens for g in fakes.calls["generate_turn"]] == [16, 8]
    assert result.num_tokens == 30
    assert len(fakes.calls["env_step"]) == 1, "a turn that hit the budget is not stepped"
    rec = fakes.finalized(inp.rollout_id)[0]
    assert rec.state.sampled_tokens == 18


async def test_engine_unavailable_non_retryable_fails_as_infra(ts_client: Client, uid: str) -> None:
    fakes = Fakes()

    async def down(inp: GenerateInput) -> None:
        raise ApplicationError("engine refused", type="EngineUnavailable", non_retryable=True)

    fakes.generate_hook = down
    inp = rollout_input(uid, engine=NO_OUTAGE_BUDGET)
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert result.outcome == Outcome.FAILED
    assert result.reason is not None and result.reason.startswith("infra:")
    assert result.reason == "infra: EngineUnavailable: engine refused"
    assert (result.reward, result.scorable) == (None, False)
    assert len(fakes.calls["generate_turn"]) == 1


async def test_engine_unavailable_retried_then_fails_as_infra(ts_client: Client, uid: str) -> None:
    fakes = Fakes()

    async def flaky(inp: GenerateInput) -> None:
        raise ApplicationError("connection reset", type="EngineUnavailable")

    fakes.generate_hook = flaky
    inp = rollout_input(uid, engine=NO_OUTAGE_BUDGET)  # retry: max_attempts=2
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert result.outcome == Outcome.FAILED
    assert result.reason == "infra: EngineUnavailable: connection reset"
    assert len(fakes.calls["generate_turn"]) == inp.retry.max_attempts


async def test_an_outage_of_the_only_engine_is_waited_out_within_its_budget(
    ts_client: Client, uid: str
) -> None:
    """No replica to fail over to: the rollout waits (durable timers) while the engine is down, then
    completes once it is back; the waits count in its state."""
    fakes = Fakes()
    fakes.done_on_turn = 1
    down_for = {"calls": 5}

    async def restarting(inp: GenerateInput) -> None:
        if len(fakes.calls["generate_turn"]) <= down_for["calls"]:
            raise ApplicationError("connection refused", type="EngineUnavailable")

    fakes.generate_hook = restarting
    inp = rollout_input(uid)  # outage budget 300 s (the default), 2 attempts per activity
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result.reason
    [rec] = fakes.finalized(inp.rollout_id)
    assert rec.state.outage_waits == 2 and rec.state.outage_since is None
    assert len(fakes.calls["generate_turn"]) == 6


async def test_an_outage_longer_than_its_budget_fails_as_infra(ts_client: Client, uid: str) -> None:
    fakes = Fakes()

    async def down(inp: GenerateInput) -> None:
        raise ApplicationError("connection refused", type="EngineUnavailable")

    fakes.generate_hook = down
    budget = NO_OUTAGE_BUDGET.model_copy(update={"outage_budget_s": 90.0})
    result = await run_rollout(ts_client, fakes, rollout_input(uid, engine=budget), uid)

    assert result.outcome == Outcome.FAILED
    assert result.reason == "infra: EngineUnavailable: connection refused"
    [rec] = fakes.finalized()
    assert rec.state.outage_waits >= 3  # 2 + 4 + 8 + ... s of back-off until 90 s have passed


async def test_engine_unavailable_fails_over_to_the_next_replica(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    inp = rollout_input(
        uid,
        engine=EngineTarget(urls=["http://engine-a", "http://engine-b"], model="tiny", request_timeout_s=30),
    )
    first, second = rollout_replicas(inp)

    async def first_dies_at_turn_1(g: GenerateInput) -> None:
        if g.engine_url == first and g.turn == 1:
            raise ApplicationError("gone", type="EngineUnavailable", non_retryable=True)

    fakes.generate_hook = first_dies_at_turn_1
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert result.outcome == Outcome.COMPLETED and result.turns == 3
    assert [(g.turn, g.engine_url) for g in fakes.calls["generate_turn"]] == [
        (0, first), (1, first), (1, second), (2, second),
    ]  # fmt: skip
    state = fakes.finalized(inp.rollout_id)[0].state
    assert (state.engine_failovers, state.reprefill_tokens) == (1, 7 + 10 + 5)


async def test_environment_failure_fails_as_environment(ts_client: Client, uid: str) -> None:
    fakes = Fakes()

    async def verifier_crashes(e: EnvStepInput) -> None:
        if e.turn == 1:
            raise ApplicationError("verifier crashed", type="EnvironmentFailure", non_retryable=True)

    fakes.env_hook = verifier_crashes
    inp = rollout_input(uid)
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert result.outcome == Outcome.FAILED
    assert result.reason == "environment: EnvironmentFailure: verifier crashed"
    assert result.turns == 1 and not result.scorable
    assert [e.turn for e in fakes.calls["env_step"]] == [0, 1], "an environment failure is not retried"


async def test_sandboxed_rollout_waits_for_a_slot_recovers_and_destroys(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    pending: list[int] = []

    async def no_slot_once(s: SandboxStepInput) -> None:
        if not pending:
            pending.append(1)
            raise ApplicationError("no slot", 0.5, type="SandboxSlotPending", non_retryable=True)

    lost: list[int] = []

    async def sandbox_dies_at_turn_1(e: EnvStepInput) -> Any:
        if e.turn == 1 and not lost:
            lost.append(1)
            raise ApplicationError("container died", type="SandboxGone", non_retryable=True)
        return None

    fakes.sandbox_create_hook, fakes.env_hook = no_slot_once, sandbox_dies_at_turn_1
    inp = rollout_input(uid, env=EnvTraits(name="fake", uses_sandbox=True), sandbox=SandboxSpec())
    result = await run_rollout(ts_client, fakes, inp, uid)

    assert result.outcome == Outcome.COMPLETED and result.turns == 3
    assert len(fakes.calls["sandbox_create"]) == 2
    assert len(fakes.calls["prepare_rollout"]) == 1
    assert [g.prepare for g in fakes.calls["generate_turn"]] == [None, None, None]
    assert [r.turn for r in fakes.calls["sandbox_recover"]] == [1]
    assert fakes.calls["sandbox_destroy"] == [inp.rollout_id]
    rec = fakes.finalized(inp.rollout_id)[0]
    assert rec.uses_sandbox
    assert (rec.state.sandbox, rec.state.sandbox_slot_waits, rec.state.sandbox_replays) == (True, 1, 1)
