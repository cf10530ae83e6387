"""The math environment: a prompt, a sampled answer, and a verifier reward of 1 or 0.

Multi-turn when the run allows more than one turn: a wrong answer gets the observation RETRY_PROMPT and
another attempt, until the answer is right or the attempts run out. The reward is the last attempt's.
Its step is pure and cheap, so it runs inside the model call's activity (``inline_steps``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from durable_rollouts.environments.base import Environment, Prompt, Step, Task, TurnContext, until_end
from durable_rollouts.errors import TaskFileError

ENV_VERSION = "math-v1"
"""Version of the environment's behaviour (prompt rendering, RETRY_PROMPT, turn rules); every record carries
it (``lineage.env_version``). Bump it whenever that behaviour changes."""
VERIFIER_VERSION = "math-exact-v1"
"""Version of the reward function (``normalize``/``verify``); recorded as ``lineage.verifier_version``.
Bump it whenever a reward could change."""
RETRY_PROMPT = "Wrong, try again."
REQUIRED = ("id", "prompt", "answer")


def normalize(text: str) -> str:
    """Compare answers without surrounding whitespace or a trailing period."""
    return text.strip().rstrip(".").strip()


def verify(output: str, answer: str) -> float:
    """1.0 if the model's output is exactly the answer (after normalization), else 0.0."""
    return 1.0 if normalize(output) == normalize(answer) else 0.0


class MathTask(Task):
    """One math task; other keys of the line are kept with the task (e.g. a source or difficulty)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    prompt: str = Field(min_length=1)
    """The question, sent as the user message."""
    answer: str = Field(min_length=1)
    """The exact answer the verifier compares with (after `normalize`)."""


class MathEnvironment(Environment):
    """Exact-answer math: one user message, the answer checked by `verify`."""

    name = "math"
    env_version = ENV_VERSION
    verifier_version = VERIFIER_VERSION
    task_model = MathTask
    inline_steps = True

    def validate_task(self, obj: dict[str, Any], where: str = "task") -> Task:
        for field in REQUIRED:
            if field not in obj:
                raise TaskFileError(f"{where}: missing field {field!r}")
            if not isinstance(obj[field], str) or not obj[field]:
                raise TaskFileError(f"{where}: field {field!r} must be a non-empty string")
        return super().validate_task(obj, where)

    def duplicate_id(self, where: str, task_id: str) -> TaskFileError:
        return TaskFileError(f"{where}: duplicate task id {task_id!r}")

    def prompt(self, task: Task) -> Prompt:
        assert isinstance(task, MathTask)
        return Prompt(messages=[{"role": "user", "content": task.prompt}])

    def parse(self, ctx: TurnContext, text: str) -> Step:
        assert isinstance(ctx.task, MathTask)
        reward = verify(until_end(text), ctx.task.answer)
        if reward == 1.0 or ctx.last_turn:
            return Step(done=True, reward=reward)
        return Step(observation=RETRY_PROMPT)

    async def score(self, ctx: TurnContext, text: str | None) -> float | None:
        assert isinstance(ctx.task, MathTask)
        return None if text is None else verify(until_end(text), ctx.task.answer)
