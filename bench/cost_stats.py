"""The cost benchmark's arithmetic (`orchestration_cost.py`), kept apart so the unit tests exercise it
without a stack: history events counted by type, a run's events and workflow tasks per rollout (its
rollouts', groups' and run's histories added up), the cost of one extra turn from two shapes, CPU per
rollout from /proc readings taken before and after a window, the accepted rate from rollout close times,
and the before/after table of two code versions.

Event types are the names Temporal gives them without the ``EVENT_TYPE_`` prefix
(``WORKFLOW_TASK_COMPLETED``). A workflow task is counted by its ``WORKFLOW_TASK_COMPLETED`` event; a
local activity by its ``MARKER_RECORDED`` event (the SDK records one marker per completed local activity;
version markers of ``workflow.patched`` are markers too and are counted with them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

KEYS = ("events", "workflow_tasks", "activities", "local_activities", "child_workflows", "signals", "timers")
"""The counts kept per history (and per rollout, per extra turn)."""

_BY_TYPE = {
    "workflow_tasks": "WORKFLOW_TASK_COMPLETED",
    "activities": "ACTIVITY_TASK_SCHEDULED",
    "local_activities": "MARKER_RECORDED",
    "child_workflows": "START_CHILD_WORKFLOW_EXECUTION_INITIATED",
    "signals": "WORKFLOW_EXECUTION_SIGNALED",
    "timers": "TIMER_STARTED",
}


def event_name(name: str) -> str:
    """``EVENT_TYPE_WORKFLOW_TASK_COMPLETED`` -> ``WORKFLOW_TASK_COMPLETED``."""
    return name.removeprefix("EVENT_TYPE_")


def count_events(types: Iterable[str]) -> dict[str, Any]:
    """One history's counts: every key of `KEYS` and ``by_type`` (events per type name)."""
    by_type = Counter(event_name(t) for t in types)
    out: dict[str, Any] = {"events": sum(by_type.values())}
    for key, name in _BY_TYPE.items():
        out[key] = by_type.get(name, 0)
    out["by_type"] = dict(sorted(by_type.items()))
    return out


def add_counts(counts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several histories' counts summed (a run's segments: one history each)."""
    by_type: Counter[str] = Counter()
    for c in counts:
        by_type.update(c["by_type"])
    out: dict[str, Any] = {k: sum(c[k] for c in counts) for k in KEYS}
    out["by_type"] = dict(sorted(by_type.items()))
    return out


def mean_counts(counts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The mean of several histories' counts (a sample of rollouts, or of groups); ``n``: how many."""
    if not counts:
        raise ValueError("no histories to average")
    n = len(counts)
    total = add_counts(counts)
    out: dict[str, Any] = {k: round(total[k] / n, 2) for k in KEYS}
    out["by_type"] = {t: round(v / n, 2) for t, v in total["by_type"].items()}
    out["n"] = n
    return out


def per_rollout(
    rollout: Mapping[str, Any],
    group: Mapping[str, Any],
    run: Mapping[str, Any],
    group_size: int,
    rollouts: int,
) -> dict[str, float]:
    """A run's counts per rollout: a rollout's own (mean), its share of its group's (mean over groups,
    divided by the group size) and its share of the run's (all segments, divided by the rollouts)."""
    if group_size < 1 or rollouts < 1:
        raise ValueError(f"group_size {group_size} and rollouts {rollouts} must be positive")
    return {k: round(rollout[k] + group[k] / group_size + run[k] / rollouts, 2) for k in KEYS}


def per_extra_turn(
    short: Mapping[str, float], long: Mapping[str, float], short_turns: float, long_turns: float
) -> dict[str, float]:
    """What one more turn costs: the difference between two shapes' per-rollout numbers divided by the
    difference of their turns per rollout (keys present in both)."""
    if long_turns == short_turns:
        raise ValueError(f"both shapes take {short_turns} turns: no extra turn to price")
    span = long_turns - short_turns
    return {k: round((long[k] - short[k]) / span, 3) for k in short if k in long}


def cpu_ms_per_rollout(
    before: Mapping[str, float], after: Mapping[str, float], rollouts: int
) -> dict[str, float]:
    """CPU milliseconds per rollout per process (CPU seconds read before and after the window), with
    ``orchestration`` = worker(s) + Temporal server (the engine, if read, is kept apart)."""
    if rollouts < 1:
        raise ValueError(f"rollouts {rollouts} must be positive")
    out = {k: round(1000 * (after[k] - before[k]) / rollouts, 1) for k in before}
    workers = sum(v for k, v in out.items() if k.startswith("worker"))
    out["workers"] = round(workers, 1)
    out["orchestration"] = round(workers + out.get("temporal_server", 0.0), 1)
    return out


def accepted_rate(close_times: Sequence[float], lo: float = 0.1, hi: float = 0.9) -> float:
    """Rollouts closed per second between the ``lo`` and ``hi`` quantiles of their close times (the run's
    ramp-up and drain left out); 0.0 with fewer than three closes or no time between them."""
    ts = sorted(close_times)
    if len(ts) < 3:
        return 0.0
    i, j = int(lo * (len(ts) - 1)), int(hi * (len(ts) - 1))
    span = ts[j] - ts[i]
    return round((j - i) / span, 2) if j > i and span > 0 else 0.0


def compare(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Rows ``{measure: [before, after, after/before]}`` for the measures both have (ratio None at 0)."""
    rows: dict[str, Any] = {}
    for k, b in before.items():
        if k in after and isinstance(b, int | float) and isinstance(after[k], int | float):
            rows[k] = [b, after[k], round(after[k] / b, 3) if b else None]
    return rows
