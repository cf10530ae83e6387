"""What the two runners of a rollout share above the turn layer (its workflow, ``workflows.rollout``, and its
batch, ``activities.batch``): its replicas in preference order and the one builder of its record's input.

Invariant: pure and deterministic (workflow code calls it): no I/O, no clock, no Temporal.
"""

from __future__ import annotations

from typing import Any

from durable_rollouts.admission.controller import CANCEL_REASON
from durable_rollouts.admission.replicas import replica_order
from durable_rollouts.contracts.activity_io import FinalizeRolloutInput
from durable_rollouts.contracts.types import RAN_TO_END, Outcome, RolloutInput, RolloutRef, RolloutState


def rollout_replicas(inp: RolloutInput) -> list[str]:
    """The rollout's replicas in preference order: the dispatcher's choice for its group first, then the
    rest in the rollout's own hash order (its failovers)."""
    order = replica_order(inp.engine.urls, inp.rollout_id)
    if inp.preferred_engine in order:
        order.remove(inp.preferred_engine)
        order.insert(0, inp.preferred_engine)
    return order


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
