"""The token budget of a model call and the truncation verdicts: the only place they are computed.

A model call on a context of ``n`` tokens may sample at most ``sampling.max_tokens``, at most what the
rollout's token limit (``rollout.max_total_tokens``) leaves, and at most what the engine's context window
(its ``max_model_len``) leaves. Nothing left under the rollout's limit truncates the rollout
(``token_budget``) before the call; nothing left in the window truncates it (``context_length``); a turn
that stopped for length at the rollout's limit truncates it (``token_budget``) and is not stepped.

Callers: the rollout workflow (before each turn, and on each turn's result), ``turns.model`` (the call
itself), ``engines.client.EngineClient.generate`` (the window), ``cli/reproduce.py`` and the
benchmarks' bare loop (``bench/harness.py``); tests/unit/turns/test_budget.py fails on another copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from durable_rollouts.contracts.types import TruncationReason


@dataclass(frozen=True)
class Budget:
    """What the next model call may sample, or the limit that leaves it nothing."""

    max_tokens: int
    """Tokens the call may sample (at least 1 unless ``truncated``)."""
    truncated: TruncationReason | None = None
    """The limit that leaves nothing (the rollout ends truncated); None: the call may go ahead."""


def turn_budget(
    context_tokens: int, max_total_tokens: int, max_tokens: int, max_model_len: int | None = None
) -> Budget:
    """The budget of a model call on ``context_tokens`` tokens.

    ``max_total_tokens``: the rollout's token limit (0: none beyond ``max_tokens``); ``max_tokens``: the
    most one call may sample; ``max_model_len``: the engine's context window (None: not checked here)."""
    room = max_total_tokens - context_tokens if max_total_tokens else max_tokens
    if room <= 0:
        return Budget(0, TruncationReason.TOKEN_BUDGET)
    budget = min(max_tokens, room)
    if max_model_len is not None:
        window = max_model_len - context_tokens
        if window < 1:
            return Budget(0, TruncationReason.CONTEXT_LENGTH)
        budget = min(budget, window)
    return Budget(budget)


def turn_truncation(finish_reason: str, end: int, max_total_tokens: int) -> TruncationReason | None:
    """The verdict on a sampled turn ending at token ``end``: one that stopped for length at the rollout's
    limit truncates the rollout (``token_budget``, not stepped); None: the environment steps it."""
    if finish_reason == "length" and max_total_tokens and end >= max_total_tokens:
        return TruncationReason.TOKEN_BUDGET
    return None
