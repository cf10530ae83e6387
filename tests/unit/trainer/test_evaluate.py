"""The trainer's evaluation (trainer/evaluate.py) scores through the environment it is given: its prompt,
its ``score`` on the detokenized turn; a reward of 1 is correct, anything else (a partial reward, None) is
not. An environment that steps in a sandbox is refused in one line. Served by the simulated engine (random
policy), so only the plumbing and the counting are checked, not a model's accuracy."""

from __future__ import annotations

from typing import Any

import pytest

from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.environments.base import Environment, Prompt, Score, Step, Task, TurnContext
from durable_rollouts.simengine import PolicyName, SimEngine, SimSettings
from durable_rollouts.trainer.evaluate import EvalError, accuracy


class JudgedTask(Task):
    prompt: str
    verdict: str


class Judged(Environment):
    """Scores each task by its ``verdict``: ``right`` 1 (as a Score), ``half`` 0.5, ``none`` unscorable."""

    name = "judged"
    env_version = "judged-v1"
    verifier_version = "judged-v1"
    task_model = JudgedTask
    inline_steps = True

    def __init__(self) -> None:
        self.scored: list[tuple[str, str | None]] = []

    def prompt(self, task: Task) -> Prompt:
        assert isinstance(task, JudgedTask)
        return Prompt(messages=[{"role": "user", "content": task.prompt}])

    def parse(self, ctx: TurnContext, text: str) -> Step:
        return Step(done=True)

    async def score(self, ctx: TurnContext, text: str | None) -> float | Score | None:
        assert isinstance(ctx.task, JudgedTask) and ctx.last_turn and ctx.sandbox is None
        self.scored.append((ctx.task.id, text))
        return {"right": Score(reward=1.0), "half": 0.5, "none": None}[ctx.task.verdict]


class Sandboxed(Judged):
    name = "sandboxed"
    inline_steps = False


TASKS: list[dict[str, Any]] = [
    {"id": "a", "prompt": "1+1=", "verdict": "right"},
    {"id": "b", "prompt": "2+2=", "verdict": "half"},
    {"id": "c", "prompt": "3+3=", "verdict": "none"},
    {"id": "d", "prompt": "4+4=", "verdict": "right"},
]
SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, seed=None, logprob_mode="processed_logprobs"
)


async def test_accuracy_counts_the_environments_full_rewards_on_every_sample() -> None:
    env = Judged()
    async with SimEngine(SimSettings(policy=PolicyName.RANDOM, tasks=None)).serve(port=0) as url:
        res = await accuracy(url, "tiny", env, TASKS, SAMPLING, samples_per_task=3, seed=7)
    assert (res.samples, res.tasks, res.correct) == (12, 4, 6)
    assert res.accuracy == 0.5 and res.temperature == 1.0 and res.version
    assert sorted(task_id for task_id, _ in env.scored) == sorted("abcd" * 3)
    assert all(isinstance(text, str) for _, text in env.scored)


async def test_an_environment_that_steps_in_a_sandbox_is_refused_in_one_line() -> None:
    async with SimEngine(SimSettings(policy=PolicyName.RANDOM, tasks=None)).serve(port=0) as url:
        with pytest.raises(EvalError, match="'sandboxed' steps in a sandbox") as info:
            await accuracy(url, "tiny", Sandboxed(), TASKS, SAMPLING, samples_per_task=1)
    assert "\n" not in str(info.value)
