"""The data of harness rollouts crossing Temporal: the harness's run, one gateway call, their results.

Invariant: as in ``contracts.types``, only keys, counts and small scalars cross history; the requests,
answers and tokens live in the store (``gateway_calls``, ``segments``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from durable_rollouts.contracts.ref import RolloutRef
from durable_rollouts.contracts.types import SamplingParams, TruncationReason


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HarnessRunInput(_Data):
    """Run the task's harness in the rollout's sandbox and wait for it to exit (its calls served)."""

    ref: RolloutRef
    """The rollout (its ``model`` is what the harness is told; its requests may name any)."""


class HarnessExit(_Data):
    """How the harness ended."""

    exit_code: int
    tail: str
    """Its last output lines (stdout and stderr), for an ``environment:`` failure's message."""


class GatewayCallInput(_Data):
    """Answer call ``index`` of a rollout's harness: render, check, sample, store, answer."""

    ref: RolloutRef
    index: int
    engine_url: str
    sampling: SamplingParams
    max_tokens: int
    """The most this call may sample (``sampling.max_tokens``)."""
    max_total_tokens: int
    """The rollout's token limit over all its sequences (0: none)."""
    limit: TruncationReason | None = None
    """A limit already reached (``max_turns``: the call limit): answer without sampling, the rollout ends."""
    stall_timeout_s: float | None = None


class GatewayCallResult(_Data):
    """One answered call: its sampled tokens are the store's segment ``t<index>.model``."""

    index: int
    start: int
    end: int
    """The rollout's stored tokens after this call (all sequences)."""
    finish_reason: str
    policy_version: str | None = None
    truncated_reason: TruncationReason | None = None
    """A limit this call reached: the harness is stopped and the rollout ends truncated."""
    rewrite: bool = False
    """The harness rewrote its history: this call began a new token sequence."""
    attempt: int = 1
