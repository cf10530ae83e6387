"""The reasoning-gym environment's prompt, answer extraction and reward (no pipeline: see
tests/integration/test_reasoning_gym.py for whole runs)."""

from __future__ import annotations

import pytest
from rgym_env import ReasoningGymEnvironment, RgTask, extract, score_entry
from rgym_env.datasets import dataset
from rgym_env.transcripts import SPEC, turns

from durable_rollouts.environments.base import Step, TurnContext
from durable_rollouts.errors import EnvironmentFailure

ENV = ReasoningGymEnvironment()
TASKS = [t for t in ENV.load_tasks(SPEC) if isinstance(t, RgTask)]


def ctx(task: RgTask) -> TurnContext:
    return TurnContext(task=task, rollout_id="r", turn=0, last_turn=False)


def test_prompt_is_reasoning_gyms_system_prompt_and_the_question() -> None:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    t = TASKS[0]
    system, user = ENV.prompt(t).messages or []
    assert system["content"].startswith(SYSTEM_PROMPTS["default"].rstrip())
    assert "<answer>answer here</answer>" in system["content"]
    assert system["content"].endswith(f"\nTask id: {t.id}")
    assert user == {"role": "user", "content": t.question}


def test_extract_takes_the_last_answer_tag_stripped() -> None:
    assert extract("think <answer>1</answer> then <answer> 2 </answer><|end|>") == "2"
    assert extract("no tags: 42") is None


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.id)
async def test_the_reward_is_score_answer_of_the_recreated_dataset(task: RgTask) -> None:
    ds = dataset(task.generator, task.seed, task.size, task.config)
    entry = ds[task.index]
    assert ENV.parse(ctx(task), "anything") == Step(done=True)  # one turn, scored by score
    for mode in ("reference", "wrong"):
        (text,) = turns(task, mode)
        reward = await ENV.score(ctx(task), text + "<|end|>")
        assert reward == ds.score_answer(extract(text), entry)
    assert await ENV.score(ctx(task), turns(task, "reference")[0]) == 1.0
    assert await ENV.score(ctx(task), "I do not know") == ds.score_answer(None, entry) == 0.0
    assert await ENV.score(ctx(task), None) is None


async def test_partial_credit_comes_from_the_generators_own_score_answer() -> None:
    spell = next(t for t in TASKS if t.id == "spell_backward-7-0")  # 'tuobnrut'
    assert await ENV.score(ctx(spell), "<answer>tuobnXXX</answer>") == pytest.approx(5 / 8)


async def test_an_exception_inside_reasoning_gym_is_an_environment_failure() -> None:
    # The base score_answer does `oracle in answer`, which raises TypeError when the oracle is None.
    task = next(t for t in TASKS if t.generator == "basic_arithmetic").model_copy(update={"answer": None})
    with pytest.raises(EnvironmentFailure, match=r"basic_arithmetic\.score_answer raised TypeError"):
        await ENV.score(ctx(task), "<answer>3</answer>")
    gone = TASKS[0].model_copy(update={"config": {"bogus_field": 1}})
    with pytest.raises(EnvironmentFailure, match="reasoning-gym basic_arithmetic"):
        score_entry(gone, "3")
