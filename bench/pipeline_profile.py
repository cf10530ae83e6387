"""Where a pipeline round's time goes on a real engine: the engine's occupancy, CPU per process, and the
batched pipeline's timeline from its histories and the run store (used by ``pipeline_vs_bare.py --profile``).

- `Occupancy`: samples an engine's /metrics (vLLM's ``num_requests_running`` and ``num_requests_waiting``)
  every ``interval_s`` while a round runs, and reads its request-latency histograms before and after: the
  mean number of model calls the engine held, and how long each took inside it.
- `tree_cpu_s`: CPU seconds of a process and all its descendants (vLLM's API server and its engine core).
- `batched_timeline`: for one batched run, the moments that bound its rollouts (run start, its load, the
  groups' starts, the batch activities, the groups' records and reports, the run's end) as seconds since
  the run's start, averaged or bounded over the groups.

Invariant: measurement only; nothing here changes what the drivers do (the sampler adds one HTTP GET per
interval to the engine's API server, in both drivers' rounds alike).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from typing import Any

import httpx
from harness import child_pids, cpu_s
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from durable_rollouts.store.runstore import RunStore

HISTOGRAMS = ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")
"""vLLM's per-request histograms whose ``_sum`` / ``_count`` deltas give a round's mean (seconds)."""
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name: value}, labelled series summed under their bare name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class Occupancy:
    """The engine's requests running and waiting over one round, sampled from its /metrics."""

    def __init__(self, url: str, interval_s: float = 0.05) -> None:
        self.url, self.interval_s = url, interval_s
        self.samples: list[tuple[float, float, float]] = []
        self._task: asyncio.Task[None] | None = None
        self._http = httpx.AsyncClient(timeout=5.0)
        self._before: dict[str, float] = {}

    async def _read(self) -> dict[str, float]:
        return parse_metrics((await self._http.get(f"{self.url}/metrics")).text)

    async def _loop(self) -> None:
        while True:
            m = await self._read()
            self.samples.append(
                (
                    time.perf_counter(),
                    m.get("vllm:num_requests_running", 0.0),
                    m.get("vllm:num_requests_waiting", 0.0),
                )
            )
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        self.samples = []
        self._before = await self._read()
        if self.interval_s > 0:  # 0: the histograms only (each sample costs the engine's API server CPU)
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        after = await self._read()
        run = [s[1] for s in self.samples]
        wait = [s[2] for s in self.samples]
        out: dict[str, Any] = {
            "samples": len(run),
            "mean_running": round(statistics.fmean(run), 2) if run else 0.0,
            "max_running": max(run, default=0.0),
            "mean_waiting": round(statistics.fmean(wait), 2) if wait else 0.0,
            "share_of_samples_idle": round(sum(1 for r in run if r == 0) / len(run), 3) if run else 0.0,
            "generate_requests": after.get("vllm:e2e_request_latency_seconds_count", 0.0)
            - self._before.get("vllm:e2e_request_latency_seconds_count", 0.0),
        }
        for h in HISTOGRAMS:
            n = after.get(f"{h}_count", 0.0) - self._before.get(f"{h}_count", 0.0)
            s = after.get(f"{h}_sum", 0.0) - self._before.get(f"{h}_sum", 0.0)
            out[f"mean_{h.split(':', 1)[1]}_ms"] = round(1000 * s / n, 1) if n else None
        return out

    async def aclose(self) -> None:
        await self._http.aclose()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(child_pids(p))
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants alive now."""
    return sum(cpu_s(p) for p in descendants(pid))


def _t(e: HistoryEvent) -> float:
    return e.event_time.ToNanoseconds() / 1e9


async def _events(client: Client, wf_id: str) -> list[HistoryEvent]:
    return [e async for e in client.get_workflow_handle(wf_id).fetch_history_events()]


def _activity_times(ev: list[HistoryEvent], name: str) -> tuple[float, float, float] | None:
    """(scheduled, started, completed) of the first activity ``name`` in a history."""
    et = EventType
    sched = next(
        (
            e
            for e in ev
            if e.event_type == et.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == name
        ),
        None,
    )
    if sched is None:
        return None
    started = completed = float("nan")
    for e in ev:
        started_ev = e.event_type == et.EVENT_TYPE_ACTIVITY_TASK_STARTED
        if started_ev and e.activity_task_started_event_attributes.scheduled_event_id == sched.event_id:
            started = _t(e)
        completed_ev = e.event_type == et.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        if completed_ev and e.activity_task_completed_event_attributes.scheduled_event_id == sched.event_id:
            completed = _t(e)
    return _t(sched), started, completed


GROUP_GAPS = (
    "start_to_batch_scheduled",
    "first_task_schedule_to_start",
    "first_task_start_to_complete",
    "batch_scheduled_to_started",
    "batch_completed_to_closed",
    "last_task_schedule_to_start",
    "last_task_start_to_complete",
)
"""A batched group's steps (its history's events), apart from its batch's own run: its start to its batch's
(its first workflow task: waiting for the worker to take it, then the worker's run of it), and its batch's
end to its close (its last workflow task: its record written, its report to the run sent)."""


def group_gaps(gev: list[HistoryEvent], batch: tuple[float, float, float]) -> dict[str, float]:
    """The seconds of each of a batched group's steps (`GROUP_GAPS`) from its history."""
    et = EventType
    tasks = [
        [_t(e) for e in gev if e.event_type == kind]
        for kind in (
            et.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
            et.EVENT_TYPE_WORKFLOW_TASK_STARTED,
            et.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
        )
    ]
    first, last = [t[0] for t in tasks], [t[-1] for t in tasks]
    return {
        "start_to_batch_scheduled": batch[0] - _t(gev[0]),
        "first_task_schedule_to_start": first[1] - first[0],
        "first_task_start_to_complete": first[2] - first[1],
        "batch_scheduled_to_started": batch[1] - batch[0],
        "batch_completed_to_closed": _t(gev[-1]) - batch[2],
        "last_task_schedule_to_start": last[1] - last[0],
        "last_task_start_to_complete": last[2] - last[1],
    }


def slot_idle(starts: list[float], scheduled: list[float], completed: list[float]) -> list[float]:
    """For each group started after another's batch ended (a slot turning over): its batch's schedule
    minus the latest batch end before the group's start (a lower bound of the slot's time without a batch:
    the ended group's record and report, the run's start of the next, its first workflow task)."""
    out = []
    for start, sched in zip(starts, scheduled, strict=True):
        before = [c for c in completed if c <= start]
        if before:
            out.append(sched - max(before))
    return out


def _marker_times(ev: list[HistoryEvent]) -> list[float]:
    return [_t(e) for e in ev if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]


async def batched_timeline(client: Client, store: RunStore, run_id: str) -> dict[str, Any]:
    """Seconds since the run's start of the moments that bound a batched run's rollouts (see module)."""
    et = EventType
    run_ev = await _events(client, run_id)
    t0 = _t(run_ev[0])
    rel = lambda t: round(t - t0, 3)  # noqa: E731
    load = _activity_times(run_ev, "load_run")
    markers = _marker_times(run_ev)  # local activities (task ids)
    initiated = [
        _t(e) for e in run_ev if e.event_type == et.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    ]
    started = [_t(e) for e in run_ev if e.event_type == et.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED]
    signals = [_t(e) for e in run_ev if e.event_type == et.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED]
    finish = _activity_times(run_ev, "finish_run")
    groups = sorted({r["group_id"] for r in store.rollouts(run_id)})
    per: dict[str, list[float]] = {k: [] for k in ("start", "batch_sched", "batch_start", "batch_done",
                                                   "closed")}  # fmt: skip
    gaps: dict[str, list[float]] = {k: [] for k in GROUP_GAPS}
    for gid in groups:
        gev = await _events(client, f"{run_id}/{gid}")
        b = _activity_times(gev, "run_batch")
        per["start"].append(_t(gev[0]))
        per["closed"].append(_t(gev[-1]))
        if b:
            per["batch_sched"].append(b[0])
            per["batch_start"].append(b[1])
            per["batch_done"].append(b[2])
            for k, v in group_gaps(gev, b).items():
                gaps[k].append(v)
    first_turn, ended = [], []
    model_s, queue_s, transfer_s = [], [], []
    for rec in store.rollouts(run_id):
        extra = json.loads(rec["extra_json"])
        first_turn.append(float(extra["started_at"]))
        ended.append(float(extra["ended_at"]))
        for s in store.segments(rec["rollout_id"]):
            if s.kind == "model":
                model_s.append(float(s.meta.get("model_s") or 0.0))
                queue_s.append(float(s.meta.get("queue_s") or 0.0))
                transfer_s.append(float(s.meta.get("transfer_s") or 0.0))

    def span(xs: list[float]) -> list[float]:
        return [rel(min(xs)), rel(max(xs))] if xs else []

    ms = lambda xs: round(1000 * statistics.fmean(xs), 1) if xs else None  # noqa: E731
    return {
        "run_closed": rel(_t(run_ev[-1])),
        "load_run": [rel(x) for x in load] if load else None,
        "run_local_activity_markers": [rel(x) for x in markers],
        "group_starts_initiated": span(initiated),
        "group_starts_done": span(started),
        "group_first_event": span(per["start"]),
        "batch_scheduled": span(per["batch_sched"]),
        "batch_started": span(per["batch_start"]),
        "rollout_started_at_wall": [round(min(first_turn) - t0, 3), round(max(first_turn) - t0, 3)],
        "rollout_ended_at_wall": [round(min(ended) - t0, 3), round(max(ended) - t0, 3)],
        "batch_completed": span(per["batch_done"]),
        "group_gaps_mean_ms": {k: ms(v) for k, v in gaps.items()},
        "slot_idle_mean_ms": ms(slot_idle(per["start"], per["batch_sched"], per["batch_done"])),
        "group_done_signals_at_run": span(signals),
        "groups_closed": span(per["closed"]),
        "finish_run": [rel(x) for x in finish] if finish else None,
        "mean_model_call_ms": ms(model_s),
        "mean_queue_ms": ms(queue_s),
        "mean_store_transfer_ms_per_turn": ms(transfer_s),
        "run_history_events": len(run_ev),
    }
