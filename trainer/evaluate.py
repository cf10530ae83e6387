"""Math accuracy of the policy an engine serves, measured through the same path as the rollouts.

Invariants:
- Same path as a math rollout: the prompt is rendered by the engine's chat template (``/tokenize``), the
  answer sampled by ``/inference/v1/generate`` with the run's temperature/top-p/top-k and max tokens, the
  text detokenized by the engine, cut at ``<|end|>`` and scored by ``envs.math.verify``.
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

from contracts.types import SamplingParams
from engines.client import EngineClient
from envs import math as math_env


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


async def math_accuracy(
    engine_url: str,
    model: str,
    tasks: list[dict[str, Any]],
    sampling: SamplingParams,
    samples_per_task: int,
    seed: int = 0,
    concurrency: int = 32,
) -> EvalResult:
    """Sample ``samples_per_task`` answers per task from the engine and score them exactly.

    Raises:
        EvalError: No tasks, or the engine's weight version changed during the evaluation.
    """
    if not tasks or samples_per_task < 1:
        raise EvalError("evaluation needs at least one task and one sample per task")
    async with httpx.AsyncClient(timeout=30) as http:
        before = (await http.get(f"{engine_url}/weight_info")).json()["weight_version"]
    client = EngineClient(timeout_s=300)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, task: dict[str, Any], prompt: list[int], k: int) -> float:
        params = sampling.model_copy(update={"seed": _seed(seed, i, k)})
        async with gate:
            gen = await client.generate(
                engine_url, model, prompt, params, sampling.max_tokens, f"eval-{seed}-{i}-{k}-{before}"
            )
            text = await client.detokenize(engine_url, model, gen.token_ids)
        return math_env.verify(text.split("<|end|>", 1)[0], str(task["answer"]))

    try:
        prompts = await asyncio.gather(
            *(
                client.tokenize_chat(engine_url, model, [{"role": "user", "content": t["prompt"]}])
                for t in tasks
            )
        )
        scores = await asyncio.gather(
            *(one(i, t, p, k) for i, (t, p) in enumerate(zip(tasks, prompts, strict=True))
              for k in range(samples_per_task))
        )  # fmt: skip
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
