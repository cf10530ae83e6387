"""bench/pipeline_profile.py: the engine's /metrics read as sums per metric (labelled series added up, so
a multi-rank or per-reason gauge counts whole), and a batched group's steps measured from its history."""

from __future__ import annotations

import sys
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _profile():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the bench imports its siblings as a script does
    import pipeline_profile

    return pipeline_profile


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 1.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 6.0
not a metric line
"""


def test_metrics_are_summed_over_their_labels() -> None:
    m = _profile().parse_metrics(METRICS)
    assert m["vllm:num_requests_running"] == 7.0
    assert m["vllm:num_requests_waiting"] == 2.0
    assert m["vllm:e2e_request_latency_seconds_sum"] == 1.5
    assert m["vllm:e2e_request_latency_seconds_count"] == 6.0
    assert "not" not in m and "not a metric" not in m


def _event(kind: int, at: float) -> HistoryEvent:
    e = HistoryEvent(event_type=kind)
    e.event_time.FromNanoseconds(int(at * 1e9))
    return e


def test_group_gaps_are_the_steps_around_its_batch() -> None:
    et = EventType
    history = [
        _event(et.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED, 10.0),
        _event(et.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, 10.0),
        _event(et.EVENT_TYPE_WORKFLOW_TASK_STARTED, 10.125),
        _event(et.EVENT_TYPE_WORKFLOW_TASK_COMPLETED, 10.25),
        _event(et.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, 12.0),
        _event(et.EVENT_TYPE_WORKFLOW_TASK_STARTED, 12.25),
        _event(et.EVENT_TYPE_WORKFLOW_TASK_COMPLETED, 12.5),
        _event(et.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED, 12.5),
    ]
    gaps = _profile().group_gaps(history, (10.25, 10.3, 12.0))
    assert gaps["start_to_batch_scheduled"] == 0.25
    assert gaps["first_task_schedule_to_start"] == 0.125
    assert gaps["first_task_start_to_complete"] == 0.125
    assert round(gaps["batch_scheduled_to_started"], 6) == 0.05
    assert gaps["batch_completed_to_closed"] == 0.5
    assert gaps["last_task_schedule_to_start"] == 0.25
    assert gaps["last_task_start_to_complete"] == 0.25


def test_slot_idle_counts_only_groups_started_after_a_batch_ended() -> None:
    starts, scheduled, completed = [0.0, 0.0, 2.0, 2.5], [0.1, 0.2, 2.25, 3.0], [1.0, 1.5, 3.5, 4.0]
    assert _profile().slot_idle(starts, scheduled, completed) == [0.75, 1.5]
