"""The turn sequence of a rollout without a harness: the budget, the model turn, its verdicts and the
environment's step, turn after turn, until an outcome.

Written once for both ways a rollout runs: the rollout workflow (``workflows.rollout``: each step an
activity it awaits) and a batch of rollouts in one activity (``activities.batch``: each step the same
activity implementation awaited in process). Each caller supplies the steps (``TurnSteps``); the sequence
decides, from their results alone, what comes next and how the rollout ends.

Invariants:
- Every end is an ``Ended`` (completed with the verifier's reward, or truncated by the limit that ended it,
  scored by the environment only under ``RolloutInput.score_truncated``); the sequence never returns.
- Deterministic: no clock, no I/O of its own (workflow code runs it); only the steps act.
- A truncated turn (``turns.budget.turn_truncation``) is never stepped.
"""

from __future__ import annotations

from typing import Any, NoReturn, Protocol

from durable_rollouts.contracts.types import (
    EnvStepResult,
    Outcome,
    RolloutInput,
    RolloutState,
    TruncationReason,
    TurnResult,
)
from durable_rollouts.turns.budget import turn_budget, turn_truncation

OUTAGE_BACKOFF_MAX_S = 30.0
"""Longest wait between two tries of an engine that is out (the outage budget bounds the total)."""


def outage_wait(s: RolloutState, budget_s: float, now: float) -> tuple[float, float] | None:
    """The next wait of a rollout whose engine is out: (seconds to wait, seconds of ``budget_s`` left),
    counted in ``s`` from the outage's first sight at ``now``; None once the budget is spent. Pure, so the
    workflow (its clock) and the batch (the wall clock) wait alike."""
    if s.outage_since is None:
        s.outage_since = now
    left = budget_s - (now - s.outage_since)
    if left <= 0:
        return None
    s.outage_waits += 1
    return min(left, OUTAGE_BACKOFF_MAX_S, 2.0 ** min(s.outage_waits, 5)), left


class Ended(Exception):
    """Raised by the sequence when a limit or the environment ends the rollout."""

    def __init__(
        self, outcome: Outcome, reason: str | None = None, reward: float | None = None, details: Any = None
    ) -> None:
        super().__init__(reason)
        self.outcome, self.reason, self.reward, self.details = outcome, reason, reward, details


class TurnSteps(Protocol):
    """What a rollout's runner does at each step of the sequence."""

    async def generate(self, inp: RolloutInput, max_tokens: int, last: bool) -> TurnResult:
        """One model turn within ``max_tokens`` (its inline env step in ``TurnResult.env``); counts it in
        the rollout's state (tokens, sampled tokens, policy version)."""
        ...

    async def env_step(self, inp: RolloutInput, last: bool, score_only: bool = False) -> EnvStepResult:
        """The environment's step on the last turn, or (``score_only``) its score of the rollout as is."""
        ...

    async def await_newer_policy(self, inp: RolloutInput) -> None:
        """Partial rollouts: wait for the next published policy (``rollout.step_token_budget``)."""
        ...

    async def turn_done(self, inp: RolloutInput) -> None:
        """A turn ended and the rollout goes on (the workflow may continue as new here)."""
        ...


async def run_turns(inp: RolloutInput, s: RolloutState, steps: TurnSteps) -> NoReturn:
    """Turns until the rollout ends: raises its ``Ended``."""
    while True:
        if s.turn >= inp.max_turns:
            raise await score_truncated(inp, steps, TruncationReason.MAX_TURNS)
        if inp.step_token_budget and s.step_sampled >= inp.step_token_budget:
            await steps.await_newer_policy(inp)
        budget = turn_budget(s.tokens, inp.max_total_tokens, inp.sampling.max_tokens)
        if budget.truncated is not None:
            raise await score_truncated(inp, steps, budget.truncated)
        last = s.turn + 1 >= inp.max_turns
        turn = await steps.generate(inp, budget.max_tokens, last)
        ended = turn.truncated_reason or turn_truncation(turn.finish_reason, turn.end, inp.max_total_tokens)
        if ended is not None:
            raise await score_truncated(inp, steps, ended)
        step = turn.env if turn.env is not None else await steps.env_step(inp, last=last)
        s.turn += 1
        if step.done:
            raise Ended(Outcome.COMPLETED, None, step.reward)
        s.tokens += step.observation_tokens
        if step.truncated_reason is not None:
            raise await score_truncated(inp, steps, step.truncated_reason)
        await steps.turn_done(inp)


async def score_truncated(inp: RolloutInput, steps: TurnSteps, reason: TruncationReason) -> Ended:
    """A truncated rollout, scored by the environment only if the run asks for it."""
    if not inp.score_truncated:
        return Ended(Outcome.TRUNCATED, reason.value)
    step = await steps.env_step(inp, last=True, score_only=True)
    return Ended(Outcome.TRUNCATED, reason.value, step.reward)
