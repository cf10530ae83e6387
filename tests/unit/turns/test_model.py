"""A model turn without Temporal (turns/model.py): a real run store, the math environment and a fake
engine. The prompt is stored once, a turn samples within its budget and is stored under (rollout id, turn)
so a retry samples nothing again, a limit ends a turn without a sample, an inline env step runs inside the
turn as a plain call, and a sample under a version nobody published is refused, not stored."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from durable_rollouts.contracts.activity_io import EnvStepInput, GenerateInput, PrepareInput
from durable_rollouts.contracts.types import RolloutRef, SamplingParams, TruncationReason
from durable_rollouts.errors import ContextLengthExceeded, EngineUnavailable
from durable_rollouts.store import RunStore, model_segment, obs_segment
from durable_rollouts.turns.model import ModelTurns, call_model
from durable_rollouts.turns.step import EnvSteps

RUN = "turns"
REF = RolloutRef(
    run_id=RUN, group_id="g000000", rollout_id=f"{RUN}/g000000/0", task_id="t1", sample_index=0, env="math",
    model="tiny",
)  # fmt: skip
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, seed=1, logprob_mode="raw")
PROMPT = [1, 2, 3, 4, 5, 6]


@dataclass
class Gen:
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[str | None]
    finish_reason: str
    model_s: float = 0.01
    queue_s: float = 0.0


@dataclass
class FakeEngine:
    """The engine calls of a turn: samples ``max_tokens`` tokens of 7 ("length") unless told to stop."""

    answer: str = "wrong"
    version: str | None = "v1"
    refuse_context: bool = False
    asks: list[int] = field(default_factory=list)
    """max_tokens of every generate call."""

    async def generate(self, url, model, prompt_ids, sampling, max_tokens, request_id):  # type: ignore[no-untyped-def]
        self.asks.append(max_tokens)
        if self.refuse_context:
            raise ContextLengthExceeded("prompt too long")
        n = max_tokens
        return Gen([7] * n, [-0.5] * n, [self.version] * n, "length")

    async def tokenize_chat(self, url, model, messages):  # type: ignore[no-untyped-def]
        return PROMPT if messages[0]["role"] == "user" and messages[0]["content"] == "1+1" else [9, 9]

    async def detokenize(self, url, model, token_ids):  # type: ignore[no-untyped-def]
        return self.answer

    async def logprob_mode(self, url):  # type: ignore[no-untyped-def]
        return None


def _turns(tmp_path: Path, engine: FakeEngine) -> tuple[RunStore, ModelTurns]:
    store = RunStore(tmp_path)
    store.put_tasks(RUN, [{"id": "t1", "prompt": "1+1", "answer": "2"}])
    return store, ModelTurns(store, engine, EnvSteps(store, engine))


def _turn(turn: int, total: int = 100, inline: bool = True, max_tokens: int = 8) -> GenerateInput:
    step = EnvStepInput(ref=REF, turn=turn, last_turn=False, engine_url="http://e") if inline else None
    return GenerateInput(
        ref=REF, turn=turn, engine_url="http://e", sampling=SAMPLING, max_tokens=max_tokens,
        max_total_tokens=total, env_after=step,
        prepare=PrepareInput(ref=REF, engine_url="http://e") if turn == 0 else None,
    )  # fmt: skip


async def test_a_turn_stores_its_prompt_and_sample_and_steps_inline_once(tmp_path: Path) -> None:
    engine = FakeEngine()
    store, turns = _turns(tmp_path, engine)
    first = await turns.turn(_turn(0), attempt=1, queued_s=0.25)
    assert (first.start, first.end, first.finish_reason, first.policy_version) == (6, 14, "length", "v1")
    assert first.env is not None and not first.env.done and first.env.observation_tokens == 2
    seg = store.get_segment(REF.rollout_id, model_segment(0))
    assert seg is not None and seg.token_ids == [7] * 8
    assert seg.meta["attempt"] == 1 and seg.meta["queue_s"] == 0.25
    assert seg.meta["env_s"] >= 0 and store.get_segment(REF.rollout_id, obs_segment(0)) is not None
    assert store.token_ids(REF.rollout_id) == PROMPT + [7] * 8 + [9, 9]

    again = await turns.turn(_turn(0), attempt=2)  # a retried call: nothing sampled, stepped or stored twice
    assert engine.asks == [8]
    assert (again.start, again.end) == (first.start, first.end) and again.env is not None
    assert (again.env.done, again.env.observation_tokens) == (False, 2)  # the stored observation answers
    assert len(store.segments(REF.rollout_id)) == 3


async def test_the_call_samples_what_the_rollout_limit_leaves_and_a_turn_at_the_limit_is_not_stepped(
    tmp_path: Path,
) -> None:
    engine = FakeEngine()
    store, turns = _turns(tmp_path, engine)
    turn = await turns.turn(_turn(0, total=10))
    assert engine.asks == [4]  # 10 - 6 prompt tokens
    assert (turn.end, turn.finish_reason, turn.env, turn.truncated_reason) == (10, "length", None, None)
    assert store.get_segment(REF.rollout_id, obs_segment(0)) is None


async def test_a_prompt_that_fills_the_limit_ends_the_turn_without_asking_the_engine(tmp_path: Path) -> None:
    engine = FakeEngine()
    _, turns = _turns(tmp_path, engine)
    turn = await turns.turn(_turn(0, total=6))
    assert engine.asks == []
    assert (turn.start, turn.end, turn.finish_reason) == (6, 6, "length")
    assert turn.truncated_reason == TruncationReason.TOKEN_BUDGET


async def test_an_engine_that_refuses_the_context_ends_the_turn_as_context_length(tmp_path: Path) -> None:
    engine = FakeEngine(refuse_context=True)
    store, turns = _turns(tmp_path, engine)
    turn = await turns.turn(_turn(0))
    assert (turn.finish_reason, turn.truncated_reason) == ("context_length", TruncationReason.CONTEXT_LENGTH)
    assert store.get_segment(REF.rollout_id, model_segment(0)) is None


async def test_a_sample_under_an_unpublished_version_is_refused_and_not_stored(tmp_path: Path) -> None:
    engine = FakeEngine(version="default")
    store, turns = _turns(tmp_path, engine)
    store.put_policy("v1", "hash", "/weights", ["http://e"])
    with pytest.raises(EngineUnavailable, match="never published"):
        await turns.turn(_turn(0))
    assert store.get_segment(REF.rollout_id, model_segment(0)) is None


async def test_a_right_answer_ends_the_rollout_inside_the_turn(tmp_path: Path) -> None:
    engine = FakeEngine(answer="2")
    store, turns = _turns(tmp_path, engine)
    turn = await turns.turn(_turn(0))
    assert turn.env is not None and (turn.env.done, turn.env.reward) == (True, 1.0)
    seg = store.get_segment(REF.rollout_id, model_segment(0))
    assert seg is not None and seg.meta["step"] == {"done": True, "reward": 1.0}


async def test_a_turn_hops_to_the_store_thread_six_times_and_a_later_turn_four(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's cost per turn is mostly its store calls and their thread hand-offs: the first turn
    reads and writes the prompt, reads the context, writes the sample and the observation, and records the
    step; a later
    turn reads the context, writes the sample and the observation, and records the step. The task is read
    once (cached by the store object) and the stepped segment is handed over, not read back."""
    engine = FakeEngine(version=None)  # a run outside any publish history: no policy versions to check
    store, turns = _turns(tmp_path, engine)
    store.get_task(RUN, "t1")  # another rollout of the task ran on this worker
    hops: list[str] = []
    to_thread = asyncio.to_thread

    async def counted(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        hops.append(getattr(fn, "__name__", "?"))
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    first = await turns.turn(_turn(0))
    assert first.env is not None and not first.env.done
    first_hops = ["get_segment", "put_segment", "_stored_or_context", "put_segment", "put_segment"]
    assert hops == [*first_hops, "update_segment_meta"], hops
    hops.clear()
    second = await turns.turn(_turn(1))
    assert second.env is not None and second.start == first.end + 2  # after the first observation
    assert hops == ["_stored_or_context", "put_segment", "put_segment", "update_segment_meta"]


async def test_call_model_is_the_budgeted_call_without_a_store() -> None:
    engine = FakeEngine()
    gen = await call_model(engine, "http://e", "tiny", PROMPT, SAMPLING, 8, 10, "r/0/1")
    assert not isinstance(gen, TruncationReason) and gen.token_ids == [7] * 4
    assert await call_model(engine, "http://e", "tiny", PROMPT, SAMPLING, 8, 6, "r/0/1") == (
        TruncationReason.TOKEN_BUDGET
    )
    assert engine.asks == [4]
