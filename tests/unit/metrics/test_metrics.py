"""Metric recording from a synthetic store: a record and its turns are counted once, at the first write,
with bounded labels; the dispatcher's poll and the trainer feed set theirs; the served exposition has them."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client import REGISTRY

from durable_rollouts import metrics
from durable_rollouts.activities.rollout import RolloutActivities
from durable_rollouts.contracts.activity_io import FinalizeRolloutInput
from durable_rollouts.contracts.types import (
    DispatchLog,
    EngineReading,
    FleetPoll,
    Outcome,
    QueueBacklog,
    RolloutState,
    SamplingParams,
)
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.metrics.serve import serve_metrics
from durable_rollouts.sandboxes.pool import PoolStatus
from durable_rollouts.store import RunStore, Segment

SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, seed=1, logprob_mode="processed_logprobs"
)


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _store_with_turns(tmp_path: Path, rid: str) -> RunStore:
    """A rollout of two model turns (with their times in the meta) and one observation."""
    store = RunStore(tmp_path)
    store.register_run("run-m", "{}", "h")
    store.put_segment(rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1, 2, 3]))
    t0 = {"queue_s": 0.02, "model_s": 0.3, "env_s": 0.004, "finish_reason": "stop", "engine": "e"}
    store.put_segment(
        rid, Segment(name="t00000.model", kind="model", turn=0, start=3, token_ids=[4, 5], meta=t0)
    )
    store.put_segment(rid, Segment(name="t00000.obs", kind="observation", turn=0, start=5, token_ids=[6]))
    t1 = {"queue_s": 0.01, "model_s": 0.2, "env_s": 0.003, "reward_s": 0.001, "finish_reason": "stop"}
    store.put_segment(
        rid, Segment(name="t00001.model", kind="model", turn=1, start=6, token_ids=[7, 8, 9], meta=t1)
    )
    return store


def _finalize_input(rid: str, outcome: Outcome, reason: str | None) -> FinalizeRolloutInput:
    return FinalizeRolloutInput(
        run_id="run-m", group_id="run-m/g000000", rollout_id=rid, task_id="t0", sample_index=0, env="math",
        outcome=outcome, reason=reason, reward=None, scorable=False, sampling=SAMPLING, turns=2,
        state=RolloutState(sandbox_slot_waits=3),
    )  # fmt: skip


def test_a_reason_label_keeps_the_kind_and_drops_the_free_text() -> None:
    assert metrics.reason_label(None) == ""
    assert metrics.reason_label("max_turns") == "max_turns"
    assert metrics.reason_label("admission") == "admission"
    assert metrics.reason_label("infra: EngineUnreachable: http://x:1 refused") == "infra: EngineUnreachable"
    assert metrics.reason_label("environment: the verifier crashed on line 3") == "environment"
    assert metrics.reason_label("stale: lag 3 > max_lag 2") == "stale"


async def test_finalize_counts_a_record_and_its_turns_once_even_when_retried(tmp_path: Path) -> None:
    rid = "run-m/g000000/0"
    store = _store_with_turns(tmp_path, rid)
    reason = "infra: EngineUnreachable: connection refused"
    rec = (
        "rollouts_records_total",
        {"env": "math", "outcome": "failed", "reason": "infra: EngineUnreachable"},
    )
    before = {
        "records": value(rec[0], **rec[1]),
        "turns": value("rollouts_turns_total", env="math"),
        "queue": value("rollouts_turn_queue_seconds_count", env="math"),
        "queue_sum": value("rollouts_turn_queue_seconds_sum", env="math"),
        "model": value("rollouts_turn_model_seconds_count", env="math"),
        "env": value("rollouts_turn_env_seconds_count", env="math"),
        "reward": value("rollouts_turn_reward_seconds_count", env="math"),
        "tokens": value("rollouts_tokens_generated_total", env="math"),
        "waits": value("rollouts_sandbox_slot_waits_total", env="math"),
    }
    engine = EngineClient()
    try:
        acts = RolloutActivities(store, engine)
        first = await acts.finalize_rollout(_finalize_input(rid, Outcome.FAILED, reason))
        again = await acts.finalize_rollout(_finalize_input(rid, Outcome.FAILED, reason))  # a retry
    finally:
        await engine.aclose()
    assert first.inserted and not again.inserted
    assert value(rec[0], **rec[1]) - before["records"] == 1
    assert value("rollouts_turns_total", env="math") - before["turns"] == 2
    assert value("rollouts_turn_queue_seconds_count", env="math") - before["queue"] == 2
    assert abs(value("rollouts_turn_queue_seconds_sum", env="math") - before["queue_sum"] - 0.03) < 1e-9
    assert value("rollouts_turn_model_seconds_count", env="math") - before["model"] == 2
    assert value("rollouts_turn_env_seconds_count", env="math") - before["env"] == 2
    assert value("rollouts_turn_reward_seconds_count", env="math") - before["reward"] == 1  # the scored turn
    assert value("rollouts_tokens_generated_total", env="math") - before["tokens"] == 5  # model tokens only
    assert value("rollouts_sandbox_slot_waits_total", env="math") == before["waits"]  # math uses no sandbox


def test_a_poll_sets_the_cap_engines_pool_and_counts_an_engine_without_a_reading() -> None:
    reading = EngineReading(
        engine_id="http://e1", at=1.0, kv_usage=0.42, running=3, waiting_capacity=1, preemptions_total=7,
        kv_capacity_tokens=4096,
    )  # fmt: skip
    pool = PoolStatus(ready=2, starting=1, in_use=1, max_size=8, waiting=4)
    log = DispatchLog(
        run_id="run-p", seq=1, at=1.0, cap=24, inflight=20, admitted=4, cancelled=0, kv_usage=0.4, healthy=[],
        kv_cap=48,
    )  # fmt: skip
    backlog = QueueBacklog(task_queue="q", at=123.0, count=9, age_s=2.5, latency_s=0.75)
    poll = FleetPoll(at=123.0, readings=[reading], pool=pool, unconsumed_groups=5, backlog=backlog)
    errors_before = value("rollouts_engine_poll_errors_total", engine="http://e2")
    metrics.record_poll("run-p", log, poll, ["http://e1", "http://e2"], feed_counted=True)
    assert value("rollouts_admission_cap", run="run-p") == 24
    assert value("rollouts_admission_inflight", run="run-p") == 20
    assert value("rollouts_admission_kv_cap", run="run-p") == 48
    assert value("rollouts_workflow_task_wait_seconds", run="run-p", source="queue") == 2.5
    assert value("rollouts_workflow_task_wait_seconds", run="run-p", source="own") == 0.75
    assert value("rollouts_poll_timestamp_seconds", run="run-p") == 123.0
    assert value("rollouts_engine_kv_usage", engine="http://e1") == 0.42
    assert value("rollouts_engine_running", engine="http://e1") == 3
    assert value("rollouts_engine_waiting", engine="http://e1") == 1
    assert value("rollouts_engine_preemptions", engine="http://e1") == 7
    assert value("rollouts_engine_poll_errors_total", engine="http://e2") - errors_before == 1
    slots = {
        s: value("rollouts_sandbox_slots", state=s)
        for s in ("ready", "starting", "in_use", "waiting", "limit")
    }
    assert slots == {"ready": 2, "starting": 1, "in_use": 1, "waiting": 4, "limit": 8}
    assert value("rollouts_feed_waiting_groups", run="run-p") == 5


def test_the_feed_counts_consumed_and_discarded_groups_with_their_lag() -> None:
    lag_count = value("rollouts_feed_lag_count")
    consumed = value("rollouts_feed_tokens_total", state="consumed")
    stale = value("rollouts_feed_groups_total", state="discarded", reason="stale")
    metrics.record_feed([(0, 4, 40), (2, 4, 30)], [("stale: lag 3 > max_lag 2", 4, 25)])
    assert value("rollouts_feed_lag_count") - lag_count == 2
    assert value("rollouts_feed_tokens_total", state="consumed") - consumed == 70
    assert value("rollouts_feed_groups_total", state="discarded", reason="stale") - stale == 1


def test_phases_of_activities_and_the_served_exposition(tmp_path: Path) -> None:
    assert metrics.phase_of("generate_turn") == "generate" and metrics.phase_of("load_run") == "run"
    with serve_metrics(None) as off:
        assert off is None
    with serve_metrics(0) as port:
        assert port is not None
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "# TYPE rollouts_records_total counter" in body
    assert "# TYPE rollouts_turn_model_seconds histogram" in body
