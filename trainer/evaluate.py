"""Accuracy of the policy an engine serves on an environment's tasks (math, for the example trainer),
measured through the same path as the rollouts.

Invariants:
- Same path as a one-turn rollout: the environment's prompt is rendered by the engine's chat template
  (``/tokenize``), the answer sampled by ``/inference/v1/generate`` with the run's temperature/top-p/top-k
  and max tokens, the text detokenized by the engine and scored by the environment's ``score`` (no
  sandbox: only environments whose steps are inline, ``inline_steps``, can be evaluated so).
- A fixed set: every task is answered ``samples_per_task`` times, each with its own seed derived from
  ``seed``, the task index and the sample index, so two evaluations of different weights draw the same
  random numbers (common random numbers: the difference is less noisy than either accuracy).
- The engine must report the same weight version before and after; otherwise the result is refused.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments.base import Environment, Score, TurnContext


class EvalError(RuntimeError):
    """The evaluation could not be measured as asked (one line)."""


@dataclass(frozen=True)
class EvalResult:
    """Accuracy of ``version`` on ``samples`` sampled answers (``stderr``: binomial standard error)."""

    version: str
    accuracy: float
    correct: int
    samples: int
    tasks: int
    temperature: float
    stderr: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _seed(base: int, task_index: int, sample: int) -> int:
    return (base * 1_000_003 + task_index * 1_009 + sample) % (2**31 - 1)


async def accuracy(
    engine_url: str,
    model: str,
    env: Environment,
    tasks: list[dict[str, Any]],
    sampling: SamplingParams,
    samples_per_task: int,
    seed: int = 0,
    concurrency: int = 32,
) -> EvalResult:
    """Sample ``samples_per_task`` answers per task from the engine and score each with ``env.score``
    (a reward of 1 counts as correct; an unscorable answer as wrong).

    Raises:
        EvalError: No tasks, or ``env`` needs a sandbox, or the engine's weight version changed during the
            evaluation.
    """
    if not tasks or samples_per_task < 1:
        raise EvalError("evaluation needs at least one task and one sample per task")
    if not env.inline_steps:
        raise EvalError(f"environment {env.name!r} steps in a sandbox; evaluation scores inline steps only")
    items = [env.validate_task(t) for t in tasks]
    async with httpx.AsyncClient(timeout=30) as http:
        before = (await http.get(f"{engine_url}/weight_info")).json()["weight_version"]
    client = EngineClient(timeout_s=300)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: list[int], k: int) -> float:
        params = sampling.model_copy(update={"seed": _seed(seed, i, k)})
        rid = f"eval-{seed}-{i}-{k}-{before}"
        async with gate:
            gen = await client.generate(engine_url, model, prompt, params, sampling.max_tokens, rid)
            text = await client.detokenize(engine_url, model, gen.token_ids)
        ctx = TurnContext(task=items[i], rollout_id=rid, turn=0, last_turn=True)
        score = await env.score(ctx, text)
        reward = score.reward if isinstance(score, Score) else score
        return 1.0 if reward == 1.0 else 0.0

    async def render(i: int) -> list[int]:
        prompt = env.prompt(items[i])
        return prompt.token_ids or await client.tokenize_chat(engine_url, model, prompt.messages or [])

    try:
        prompts = await asyncio.gather(*(render(i) for i in range(len(items))))
        scores = await asyncio.gather(
            *(one(i, p, k) for i, p in enumerate(prompts) for k in range(samples_per_task))
        )
    finally:
        await client.aclose()
    async with httpx.AsyncClient(timeout=30) as http:
        after = (await http.get(f"{engine_url}/weight_info")).json()["weight_version"]
    if before != after:
        raise EvalError(f"{engine_url}: weight version changed from {before} to {after} during evaluation")
    n, correct = len(scores), int(sum(scores))
    acc = correct / n
    return EvalResult(
        version=before,
        accuracy=acc,
        correct=correct,
        samples=n,
        tasks=len(tasks),
        temperature=sampling.temperature,
        stderr=math.sqrt(acc * (1 - acc) / n),
    )
