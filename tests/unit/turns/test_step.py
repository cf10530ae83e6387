"""The environment's step without Temporal (turns/step.py): the action a turn parses to is recorded before
it runs, and a retried step returns what the first attempt stored instead of acting again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from durable_rollouts.contracts.activity_io import EnvStepInput
from durable_rollouts.contracts.types import RolloutRef
from durable_rollouts.environments.base import Environment, Prompt, Step, Task, TurnContext
from durable_rollouts.store import RunStore, Segment, model_segment, obs_segment
from durable_rollouts.turns.step import EnvSteps

RUN = "steps"


class CountingEnv(Environment):
    """Parses every turn to an action; acting counts, sees its own record, and observes."""

    name = "counting"

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.acts: list[Any] = []

    def prompt(self, task: Task) -> Prompt:
        return Prompt(token_ids=[1])

    def parse(self, ctx: TurnContext, text: str) -> dict[str, Any]:
        return {"cmd": text}

    async def act(self, ctx: TurnContext, action: dict[str, Any]) -> Step:
        seg = self.store.get_segment(ctx.rollout_id, model_segment(ctx.turn))
        assert seg is not None
        self.acts.append(seg.meta.get("action"))  # recorded before it runs
        return Step(observation="ran")


class Engine:
    async def detokenize(self, url: str, model: str, ids: list[int]) -> str:
        return "ls"

    async def tokenize_chat(self, url: str, model: str, messages: list[dict[str, str]]) -> list[int]:
        return [4, 4, 4]


def _stored_turn(tmp_path: Path, monkeypatch: Any, index: int) -> tuple[RunStore, CountingEnv, EnvStepInput]:
    """A store holding member ``index``'s prompt and its first model turn, the counting environment
    registered, and the input of that turn's step."""
    from durable_rollouts.environments import registry

    store = RunStore(tmp_path)
    store.put_tasks(RUN, [{"id": "t1"}])
    env = CountingEnv(store)
    monkeypatch.setattr(registry, "get", lambda name: env)
    ref = RolloutRef(
        run_id=RUN, group_id="g0", rollout_id=f"{RUN}/g0/{index}", task_id="t1", sample_index=index,
        env="counting", model="m",
    )  # fmt: skip
    store.put_segment(
        ref.rollout_id, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1])
    )
    turn = Segment(
        name=model_segment(0), kind="model", turn=0, start=1, token_ids=[5], meta={"finish_reason": "stop"}
    )
    store.put_segment(ref.rollout_id, turn)
    return store, env, EnvStepInput(ref=ref, turn=0, last_turn=False, engine_url="http://e")


async def test_the_action_is_recorded_before_it_runs_and_a_retry_does_not_act_again(
    tmp_path: Path, monkeypatch: Any
) -> None:
    store, env, inp = _stored_turn(tmp_path, monkeypatch, 0)
    steps = EnvSteps(store, Engine())  # type: ignore[arg-type]
    first = await steps.step(inp, attempt=1)
    assert env.acts == [{"cmd": "ls"}]
    assert (first.done, first.observation_tokens) == (False, 3)
    obs = store.get_segment(inp.rollout_id, obs_segment(0))
    assert obs is not None and obs.start == 2
    retry = await steps.step(inp, attempt=2)  # its record was lost: the stored observation answers
    assert env.acts == [{"cmd": "ls"}] and retry.observation_tokens == 3


async def test_an_observation_a_dead_worker_stored_is_kept_when_the_step_runs_again_as_a_first_attempt(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A local activity's attempt count starts again after its worker dies: the step then acts and
    observes again, and the observation already stored stays what it was."""
    store, _, inp = _stored_turn(tmp_path, monkeypatch, 1)
    obs = Segment(name=obs_segment(0), kind="observation", turn=0, start=2, token_ids=[8, 8, 8, 8, 8])
    store.put_segment(inp.rollout_id, obs)
    steps = EnvSteps(store, Engine())  # type: ignore[arg-type]
    again = await steps.step(inp, attempt=1)
    assert again.observation_tokens == 5  # the stored one (this engine would tokenize it to 3 tokens)
    stored = store.get_segment(inp.rollout_id, obs_segment(0))
    assert stored is not None and stored.token_ids == [8] * 5 and len(store.segments(inp.rollout_id)) == 3
