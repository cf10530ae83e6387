"""The cost benchmark's arithmetic (bench/cost_stats.py): events counted by type from Temporal's names,
a run's counts per rollout (its share of the group's and the run's histories), the price of one extra
turn, CPU per rollout per process, the accepted rate without ramp-up and drain, and the before/after rows.
The benchmark itself (bench/orchestration_cost.py) is not run here."""

from __future__ import annotations

import pytest

from bench.cost_stats import (
    accepted_rate,
    add_counts,
    compare,
    count_events,
    cpu_ms_per_rollout,
    mean_counts,
    per_extra_turn,
    per_rollout,
)

WFT = [
    "EVENT_TYPE_WORKFLOW_TASK_SCHEDULED",
    "EVENT_TYPE_WORKFLOW_TASK_STARTED",
    "EVENT_TYPE_WORKFLOW_TASK_COMPLETED",
]
ACT = [
    "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED",
    "EVENT_TYPE_ACTIVITY_TASK_STARTED",
    "EVENT_TYPE_ACTIVITY_TASK_COMPLETED",
]


def _rollout(turns: int) -> list[str]:
    """A rollout history: started, a workflow task with a local activity, then per turn an activity and
    the workflow task it wakes, then completed."""
    events = ["EVENT_TYPE_WORKFLOW_EXECUTION_STARTED", *WFT, "EVENT_TYPE_MARKER_RECORDED"]
    for _ in range(turns):
        events += [*ACT, *WFT]
    return [*events, "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"]


def test_count_events_by_type_and_the_kept_counts() -> None:
    c = count_events(_rollout(3))
    assert c["events"] == 2 + 4 + 3 * 6
    assert c["workflow_tasks"] == 4
    assert c["activities"] == 3
    assert c["local_activities"] == 1
    assert c["child_workflows"] == c["signals"] == c["timers"] == 0
    assert c["by_type"]["ACTIVITY_TASK_STARTED"] == 3
    assert "EVENT_TYPE_ACTIVITY_TASK_STARTED" not in c["by_type"]


def test_add_and_mean_counts() -> None:
    one, three = count_events(_rollout(1)), count_events(_rollout(3))
    total = add_counts([one, three])
    assert total["events"] == one["events"] + three["events"]
    assert total["by_type"]["WORKFLOW_TASK_COMPLETED"] == 2 + 4
    mean = mean_counts([one, three])
    assert mean["events"] == (one["events"] + three["events"]) / 2
    assert mean["activities"] == 2 and mean["n"] == 2
    assert mean["by_type"]["ACTIVITY_TASK_SCHEDULED"] == 2
    with pytest.raises(ValueError):
        mean_counts([])


def test_per_rollout_adds_the_group_and_run_shares() -> None:
    rollout = {k: 0.0 for k in ("activities", "local_activities", "child_workflows", "signals", "timers")}
    rollout |= {"events": 20.0, "workflow_tasks": 3.0}
    group = {**rollout, "events": 40.0, "workflow_tasks": 8.0}
    run = {**rollout, "events": 1000.0, "workflow_tasks": 100.0}
    got = per_rollout(rollout, group, run, group_size=4, rollouts=200)
    assert got["events"] == 20 + 10 + 5
    assert got["workflow_tasks"] == 3 + 2 + 0.5
    with pytest.raises(ValueError):
        per_rollout(rollout, group, run, group_size=0, rollouts=200)


def test_per_extra_turn_is_the_slope_between_two_shapes() -> None:
    short = {"cpu_ms": 100.0, "events": 31.0, "only_short": 1.0}
    long = {"cpu_ms": 370.0, "events": 85.0}
    got = per_extra_turn(short, long, 1, 10)
    assert got == {"cpu_ms": 30.0, "events": 6.0}
    with pytest.raises(ValueError):
        per_extra_turn(short, long, 3, 3)


def test_cpu_ms_per_rollout_per_process_and_orchestration() -> None:
    before = {"worker_0": 10.0, "worker_1": 5.0, "temporal_server": 20.0, "engine": 1.0}
    after = {"worker_0": 13.0, "worker_1": 7.0, "temporal_server": 30.0, "engine": 1.5}
    got = cpu_ms_per_rollout(before, after, rollouts=100)
    assert got["worker_0"] == 30.0 and got["worker_1"] == 20.0
    assert got["workers"] == 50.0
    assert got["orchestration"] == 150.0  # workers + server; the engine apart
    assert got["engine"] == 5.0


def test_accepted_rate_leaves_out_ramp_up_and_drain() -> None:
    # 5 closes in the first 10 s (ramp), then 2 per second for 40 s, then a long drain
    ramp = [2.0 * i for i in range(5)]
    steady = [10 + 0.5 * i for i in range(80)]
    drain = [60.0 + 5 * i for i in range(5)]
    rate = accepted_rate(ramp + steady + drain)
    assert rate == pytest.approx(2.0, rel=0.05)
    assert len(ramp + steady + drain) / (drain[-1] - ramp[0]) < 1.5  # the whole span would understate it
    assert accepted_rate([1.0, 2.0]) == 0.0
    assert accepted_rate([5.0, 5.0, 5.0, 5.0]) == 0.0


def test_compare_rows() -> None:
    rows = compare({"cpu_ms": 200.0, "zero": 0.0, "gone": 1.0}, {"cpu_ms": 100.0, "zero": 3.0})
    assert rows == {"cpu_ms": [200.0, 100.0, 0.5], "zero": [0.0, 3.0, None]}
