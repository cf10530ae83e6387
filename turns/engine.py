"""What a turn needs of an engine: token-in/token-out calls (``engines.client.EngineClient`` is one).

A protocol, so ``turns`` sits below ``engines`` (whose client computes its window through
``turns.budget``) and a test drives a turn with a fake engine.
"""

from __future__ import annotations

from typing import Protocol

from durable_rollouts.contracts.types import SamplingParams


class Sampled(Protocol):
    """What one model call produced (``engines.client.Generation``)."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[str | None]
    finish_reason: str
    model_s: float
    queue_s: float


class Engine(Protocol):
    """The engine calls of a turn; each raises ``errors.EngineError`` subclasses, never transport errors."""

    async def generate(
        self,
        base_url: str,
        model: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        request_id: str,
    ) -> Sampled: ...

    async def tokenize_chat(self, base_url: str, model: str, messages: list[dict[str, str]]) -> list[int]: ...

    async def detokenize(self, base_url: str, model: str, token_ids: list[int]) -> str: ...

    async def logprob_mode(self, base_url: str) -> str | None: ...
