"""The time decomposition: arithmetic (records/timing.py), the exported ``time`` object and turn
``transfer_s``, the trainer wait from the feed's marks, the env step's disjoint times, the status table.

Drives the real export and store (temp RunStore, public methods) and the real env step activity with a
fake engine (detokenize, tokenize) in an activity environment.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from durable_rollouts.cli.progress import run_totals, time_table
from durable_rollouts.records.export import iter_run, rollout_times
from durable_rollouts.records.timing import COMPONENTS, Totals, rollout_time, totals_by_env, turn_times
from durable_rollouts.store.runstore import RunStore, Segment

RUN = "tim"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 1}
TURN = {"engine": "http://e", "finish_reason": "stop", "queue_s": 0.5, "model_s": 1.5, "attempt": 1}


def test_rollout_time_sums_turns_and_adds_the_per_rollout_entries() -> None:
    turns = [
        {**TURN, "env_s": 0.25, "transfer_s": 0.01},
        {**TURN, "env_s": 1.0, "reward_s": 2.0, "transfer_s": 0.02},
    ]
    extra = {"started_at": 100.0, "ended_at": 112.0, "sandbox_s": 3.0, "record_transfer_s": 0.03}
    t = rollout_time(turns, extra)
    assert t["generation_s"] == pytest.approx(4.0)
    assert t["environment_s"] == pytest.approx(1.25 + 3.0) and t["sandbox_s"] == 3.0
    assert t["reward_s"] == 2.0 and t["transfer_s"] == pytest.approx(0.06)
    assert (t["wall_s"], t["started_at"], t["ended_at"]) == (12.0, 100.0, 112.0)
    assert "trainer_wait_s" not in t  # unknown until a trainer took the group
    assert rollout_time(turns, extra, trainer_wait_s=7.5)["trainer_wait_s"] == 7.5


def test_records_stored_before_the_decomposition_get_zeros_and_null_wall_time() -> None:
    t = rollout_time([{"queue_s": 0.1, "model_s": 0.2, "env_s": 0.3, "reward_s": 0.0}], {})
    assert t["wall_s"] is None and t["transfer_s"] == 0.0 and t["sandbox_s"] == 0.0
    assert turn_times({})["transfer_s"] == 0.0


@given(
    st.lists(st.tuples(*(st.floats(0, 100) for _ in range(5))), max_size=8),
    st.floats(0, 100),
    st.floats(0, 1000),
)
def test_shares_of_disjoint_components_add_up_to_one_with_other(turns, sandbox, slack) -> None:
    keys = ("queue_s", "model_s", "env_s", "reward_s", "transfer_s")
    metas = [dict(zip(keys, t, strict=True)) for t in turns]
    busy = sum(sum(t) for t in turns) + sandbox
    t = rollout_time(metas, {"started_at": 0.0, "ended_at": busy + slack, "sandbox_s": sandbox})
    assert sum(t[k] for k in COMPONENTS) == pytest.approx(busy)
    total = Totals()
    total.add(t)
    assert total.other_s == pytest.approx(slack, abs=1e-6)
    shares = total.shares()
    if total.wall_s:
        assert sum(v for v in shares.values() if v is not None) == pytest.approx(1.0)
        assert all(v is not None and v >= -1e-9 for v in shares.values())


def test_totals_per_env_and_for_all() -> None:
    a = {"generation_s": 1.0, "environment_s": 2.0, "reward_s": 0.0, "transfer_s": 0.5, "wall_s": 4.0}
    b = {**a, "wall_s": None, "trainer_wait_s": 3.0}
    totals = totals_by_env([("math", a), ("coding", b), ("coding", a)])
    assert set(totals) == {"math", "coding", "all"}
    assert totals["coding"].rollouts == 2 and totals["coding"].timed == 1
    assert totals["coding"].wall_s == 4.0 and totals["coding"].mean_trainer_wait_s == 3.0
    assert totals["all"].seconds["environment_s"] == 6.0
    assert totals["math"].shares()["generation_s"] == 0.25
    assert Totals().shares()["generation_s"] is None
    assert set(totals_by_env([("math", a)])) == {"math"}


def put_rollout(store: RunStore, k: int, env: str = "math", extra: dict | None = None, turns: int = 2) -> str:
    rid = f"{RUN}/g0/{k}"
    store.put_segment(rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1, 2]))
    pos = 2
    for t in range(turns):
        meta = {**TURN, "env_s": 0.2, "reward_s": 0.1 if t == turns - 1 else 0.0, "transfer_s": 0.01}
        store.put_segment(rid, Segment(name=f"t{t:05d}.model", kind="model", turn=t, start=pos,
                                       token_ids=[5, 6], logprobs=[-1.0, -1.0], policy_versions=["v1", "v1"],
                                       meta=meta))  # fmt: skip
        pos += 2
    store.put_rollout({
        "rollout_id": rid, "run_id": RUN, "group_id": "g0", "task_id": "t1", "sample_index": k, "env": env,
        "outcome": "completed", "reason": None, "reward": 1.0, "scorable": 1, "advantage": 0.0,
        "prompt_length": 2, "num_tokens": pos, "sampling_json": json.dumps(SAMPLING),
        "extra_json": json.dumps(extra if extra is not None else {
            "started_at": 10.0, "ended_at": 20.0, "sandbox_s": 1.0, "record_transfer_s": 0.05}),
    })  # fmt: skip
    return rid


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    store = RunStore(tmp_path)
    store.register_run(RUN, json.dumps({"run": {"env": "math"}}), "h")
    put_rollout(store, 0)
    put_rollout(store, 1, extra={})  # stored before the decomposition existed
    store.put_group(RUN, "g0", "t1", {
        "run_id": RUN, "group_id": "g0", "task_id": "t1", "size": 2, "scorable": 2, "failed": 0,
        "reward_mean": 1.0, "reward_std": 0.0, "zero_variance": True,
    })  # fmt: skip
    return store


def test_the_export_carries_per_turn_transfer_and_the_summed_time(store: RunStore) -> None:
    rec, old, group = list(iter_run(store, RUN))
    assert [t["transfer_s"] for t in rec["turns"]] == [0.01, 0.01]
    assert rec["time"] == {
        "generation_s": pytest.approx(4.0), "environment_s": pytest.approx(1.4), "reward_s": 0.1,
        "transfer_s": pytest.approx(0.07), "sandbox_s": 1.0, "wall_s": 10.0, "started_at": 10.0,
        "ended_at": 20.0,
    }  # fmt: skip
    assert old["time"]["wall_s"] is None and "trainer_wait_s" not in old["time"]
    assert "trainer_wait_s" not in group
    per_turn = sum(sum(turn_times({**t}).values()) for t in rec["turns"]) + rec["time"]["sandbox_s"]
    assert per_turn <= rec["time"]["wall_s"]


def test_the_trainer_wait_is_the_feed_mark_time_minus_the_group_record_time(store: RunStore) -> None:
    before = time.time()
    store.put_feed_marks(RUN, [{"group_id": "g0", "state": "consumed", "records": 2, "tokens": 8, "lag": 0}])
    waits = store.trainer_waits(RUN)
    assert 0.0 <= waits["g0"] <= time.time() - before + 1.0
    rec, _, group = list(iter_run(store, RUN))
    assert rec["time"]["trainer_wait_s"] == waits["g0"] == group["trainer_wait_s"]
    from durable_rollouts.records.export import rollout_record

    assert rollout_record(store, store.rollout(f"{RUN}/g0/0"))["time"]["trainer_wait_s"] == waits["g0"]  # type: ignore[arg-type]
    assert next(t for _, t in rollout_times(store, RUN)) == rec["time"]


def test_a_discarded_group_has_no_trainer_wait(store: RunStore) -> None:
    store.put_feed_marks(RUN, [{"group_id": "g0", "state": "discarded", "reason": "zero_variance",
                                "records": 2, "tokens": 8, "lag": 0}])  # fmt: skip
    assert store.trainer_waits(RUN) == {}


def test_status_shows_totals_and_shares_by_env(store: RunStore) -> None:
    put_rollout(store, 2, env="coding")
    totals = run_totals(store, RUN)
    assert set(totals) == {"math", "coding", "all"}
    console = Console(width=200, record=True)
    console.print(time_table(RUN, totals))
    text = console.export_text()
    for word in ("generation", "environment", "reward", "transfer", "other", "coding", "all"):
        assert word in text
    assert "40%" in text  # math generation: 4.0 s of 10 s wall


class FakeEngine:
    """detokenize / tokenize_chat of the engine client, without an engine."""

    async def detokenize(self, url: str, model: str, ids: list[int]) -> str:
        return "x"

    async def tokenize_chat(self, url: str, model: str, messages: list[dict[str, Any]]) -> list[int]:
        return [9, 9]


async def test_the_env_step_records_disjoint_env_reward_and_transfer_times(tmp_path: Path) -> None:
    """A real env step (math): env_s excludes the store calls, transfer_s adds them to the model call's
    (plus the model call's own write handed over), and a scoring afterwards adds its times beside them."""
    from temporalio.testing import ActivityEnvironment

    from durable_rollouts.activities.environment import EnvironmentActivities
    from durable_rollouts.contracts.activity_io import EnvStepInput

    store = RunStore(tmp_path)
    store.put_tasks(RUN, [{"id": "t1", "prompt": "1+1", "answer": "2"}])
    rid = f"{RUN}/g0/0"
    store.put_segment(rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1]))
    meta = {**TURN, "transfer_s": 0.5}
    store.put_segment(rid, Segment(name="t00000.model", kind="model", turn=0, start=1, token_ids=[5],
                                   logprobs=[-1.0], policy_versions=["v1"], meta=meta))  # fmt: skip
    steps = EnvironmentActivities(store, FakeEngine(), sandboxes=None)  # type: ignore[arg-type]
    inp = EnvStepInput(run_id=RUN, rollout_id=rid, task_id="t1", env="math", turn=0, last_turn=False,
                       engine_url="http://e", model="m", transfer_s=0.25)  # fmt: skip
    t0 = time.monotonic()
    res = await ActivityEnvironment().run(steps.env_step, inp)
    elapsed = time.monotonic() - t0
    m = store.get_segment(rid, "t00000.model").meta  # type: ignore[union-attr]
    assert not res.done and m["env_s"] == res.env_s > 0
    own = m["transfer_s"] - 0.75
    assert own > 0 and m["env_s"] + own <= elapsed
    score = inp.model_copy(update={"score_only": True, "last_turn": True, "transfer_s": 0.0})
    for _ in range(2):  # a retried scoring overwrites its times, never adds them twice
        await ActivityEnvironment().run(steps.env_step, score)
        s = store.get_segment(rid, "t00000.model").meta  # type: ignore[union-attr]
        assert s["env_s"] == pytest.approx(m["env_s"] + s["score_env_s"])
        assert s["transfer_s"] == pytest.approx(m["transfer_s"] + s["score_transfer_s"])
        assert s["reward_s"] == pytest.approx(s["score_reward_s"])
