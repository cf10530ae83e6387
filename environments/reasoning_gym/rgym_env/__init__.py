"""The reasoning-gym environment: one question from a procedural generator, scored by its ``score_answer``.

A plug-in, as a user writes one: its own distribution (``durable-rollouts-reasoning-gym``), registered under
the entry-point group ``environments`` as ``reasoning_gym``, using only the core's public
API (``environments.base``, ``errors``). reasoning-gym itself (PyPI ``reasoning-gym``, pinned) is imported
lazily: listing the environments does not import it.

How one rollout goes:

1. ``load_tasks(spec)`` at submit: the run's ``task_file`` is a spec naming generators, seeds and sizes
   (`rgym_env.spec`); every entry becomes a task holding its question, answer and metadata and the
   generator's name, seed, size and config. The tasks are stored with the run.
2. ``prompt``: a system message (reasoning-gym's own ``SYSTEM_PROMPTS[...]``, which asks for the answer as
   ``<answer>...</answer>``, and a ``Task id: <id>`` line) and the question as the user message.
3. One turn. ``parse`` ends the rollout; ``score`` takes the answer the way reasoning-gym's examples do
   (``reasoning_gym.utils.extract_answer``: the last ``<answer>...</answer>``, stripped; None without one)
   and returns ``dataset.score_answer(answer, entry)`` of the re-created dataset, with ``entry`` the stored
   ``{question, answer, metadata}``.

Invariants:
- ``parse`` is pure; ``score`` runs no model code and is safe to repeat (same text, same reward).
- An exception raised inside reasoning-gym's code (creating the dataset, ``score_answer``) or a reward that
  is not a finite number is `EnvironmentFailure` (``environment: ...``), never infra and never a reward.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, ClassVar, cast

from pydantic import ConfigDict, Field, JsonValue

from durable_rollouts.environments.base import Environment, Prompt, Step, Task, TurnContext, until_end
from durable_rollouts.errors import EnvironmentFailure, TaskFileError

__all__ = ["ReasoningGymEnvironment", "RgTask", "extract", "score_entry"]


class RgTask(Task):
    """One reasoning-gym entry and the generator that made it (see `rgym_env.spec`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    generator: str = Field(min_length=1)
    """The dataset's registered name."""
    seed: int
    size: int = Field(ge=1)
    config: dict[str, JsonValue] = Field(default_factory=dict)
    """The dataset's config fields given in the spec (keyword arguments of ``create_dataset``)."""
    index: int = Field(ge=0)
    """The entry's index in the dataset."""
    system_prompt: str
    """The system message's text (resolved from the spec's ``system_prompt`` at submit)."""
    question: str = Field(min_length=1)
    answer: JsonValue
    """The entry's oracle answer (None for generators whose answers are checked otherwise)."""
    metadata: dict[str, JsonValue] = Field(default_factory=dict)

    @property
    def entry(self) -> dict[str, Any]:
        """The entry as ``score_answer`` takes it."""
        return {"question": self.question, "answer": self.answer, "metadata": self.metadata}


class ReasoningGymEnvironment(Environment):
    """reasoning-gym's generators, one turn, ``score_answer`` as the reward (see the module docstring)."""

    name: ClassVar[str] = "reasoning_gym"
    env_version: ClassVar[str] = "rgym-v1"
    verifier_version: ClassVar[str] = "rgym-score-answer-0.1.25-v1"
    task_model: ClassVar[type[Task]] = RgTask
    inline_steps: ClassVar[bool] = True

    def load_tasks(self, path: str | Path) -> list[Task]:
        """Generate the tasks of the spec at ``path`` (`rgym_env.spec`).

        Raises:
            TaskFileError: one line naming the file and the field at fault.
        """
        from rgym_env.spec import generate, read_spec

        p = Path(path)
        rows = generate(p, read_spec(p))
        tasks: list[Task] = []
        for row in rows:
            where = f"{p}: generator {row['generator']!r} entry {row['index']}"
            tasks.append(self.validate_task(row, where=where))
        if len({t.id for t in tasks}) != len(tasks):  # unreachable after read_spec's check; kept as a guard
            raise TaskFileError(f"{p}: field 'generators': duplicate task ids")
        return tasks

    def prompt(self, task: Task) -> Prompt:
        t = _rg(task)
        system = f"{t.system_prompt.rstrip()}\nTask id: {t.id}"
        return Prompt(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": t.question}]
        )

    def parse(self, ctx: TurnContext, text: str) -> Step:
        """Every turn is the answer: the rollout is done and ``score`` gives its reward."""
        return Step(done=True)

    async def score(self, ctx: TurnContext, text: str | None) -> float | None:
        if text is None:
            return None
        t = _rg(ctx.task)
        return await asyncio.to_thread(score_entry, t, extract(until_end(text)))


def extract(text: str) -> str | None:
    """The answer in a model turn, as reasoning-gym's examples take it: the last ``<answer>...</answer>``,
    stripped (``reasoning_gym.utils.extract_answer``); None when there is none."""
    from reasoning_gym.utils import extract_answer

    return cast(str | None, extract_answer(text))


def score_entry(task: RgTask, answer: str | None) -> float:
    """``score_answer(answer, entry)`` of the task's re-created dataset, as a float.

    Raises:
        EnvironmentFailure: reasoning-gym raised, or returned something other than a finite number.
    """
    from rgym_env.datasets import dataset

    try:
        ds = dataset(task.generator, task.seed, task.size, task.config)
        reward = ds.score_answer(answer, task.entry)
    except Exception as e:  # reasoning-gym's own code failed: the environment's fault, not infra
        msg = " ".join(str(e).split())[:300]
        raise EnvironmentFailure(
            f"task {task.id}: reasoning-gym {task.generator}.score_answer raised {type(e).__name__}: {msg}"
        ) from e
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvironmentFailure(
            f"task {task.id}: reasoning-gym {task.generator}.score_answer returned {reward!r}, not a number"
        )
    return float(reward)


def _rg(task: Task) -> RgTask:
    if isinstance(task, RgTask):
        return task
    obj = task.model_dump(mode="json")
    return cast(RgTask, ReasoningGymEnvironment().validate_task(obj, where=f"task {obj.get('id')!r}"))
