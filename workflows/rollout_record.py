"""The record of one rollout: the one builder of `FinalizeRolloutInput`, used by the rollout at its end and by
its group (or the run) for a member whose workflow died or never ran. Deterministic (workflow code)."""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.admission.controller import CANCEL_REASON
    from durable_rollouts.contracts.activity_io import FinalizeRolloutInput
    from durable_rollouts.contracts.types import RAN_TO_END, Outcome, RolloutInput, RolloutRef, RolloutState


def finalize_rollout_input(
    inp: RolloutInput,
    outcome: Outcome,
    reason: str | None,
    *,
    ref: RolloutRef | None = None,
    reward: float | None = None,
    state: RolloutState | None = None,
    ended_at: float | None = None,
    failure: dict[str, Any] | None = None,
) -> FinalizeRolloutInput:
    """The input of the record of member ``inp`` (the one builder: the rollout's own end, and a member its
    group records because its workflow died or never ran, which has no ``state``: no turns, no reward, no
    sandbox counters). Only a rollout that ran to its end with a reward is scorable."""
    scorable = reward is not None and outcome in RAN_TO_END and state is not None
    s = state or RolloutState()
    return FinalizeRolloutInput(
        ref=ref or inp.ref(),
        outcome=outcome,
        reason=reason,
        reward=reward if scorable else None,
        scorable=scorable,
        sampling=inp.sampling,
        turns=s.turn,
        state=s,
        uses_sandbox=inp.env.uses_sandbox and state is not None,
        score_truncated=inp.score_truncated if outcome == Outcome.TRUNCATED and state is not None else None,
        wasted_tokens=s.sampled_tokens if reason == CANCEL_REASON and state is not None else None,
        ended_at=ended_at,
        failure=failure,
    )
