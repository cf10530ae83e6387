"""A run's continue-as-new with its groups' reports arriving around it (patch ``quiet-segment-end``, input
revision 3).

A group reports by the run's ``group_report`` update (sent by its closing local activity) and then closes;
a group of the segment that started it adds its close (``ChildWorkflowExecutionCompleted``) to the run's
history one workflow task of its own after its report. An event that reaches the run while the workflow
task carrying its continue-as-new is in flight has the server reject that task (``UNHANDLED_COMMAND``, as a
``group_done`` signal did); an update sent then is no event: the server hands it to the next run. While it
drains for the continue-as-new the run refuses the reports of its own segment's groups (no new close can
start), waits for the closes of those that reported, and stops its checks of carried groups (no timer or
activity of its own can land either). The tests hold that workflow task in the worker (`Boundary`, as a
loaded worker may take long) and time the groups' reports against it:

- reports sent while it is held (dev server; the time-skipping test server, unlike Temporal's, rejects a
  task that closes a run with an update pending): each group is counted once, by the run whose
  history holds its report, none lost, none counted again after the continue-as-new, and no task rejected
  (with the signal: at least one);
- a report just before it (dev server): the run waits for that group's close before it continues as new
  (and for its last groups' closes before it ends), so no event lands in the task and none is rejected
  (without the wait, the close lands in it: one rejection).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client
from temporalio.worker._workflow_instance import _WorkflowInstanceImpl

from durable_rollouts.config.models import Config, RolloutConfig, RunConfig
from durable_rollouts.contracts.activity_io import FinalizeGroupInput
from durable_rollouts.contracts.types import GroupResult, RunInput, RunProgress, RunState, group_id
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import Fakes, fake_worker, wait_for
from .test_continue_as_new import assert_every_group_ran_once

HOLD_S = 1.2
"""At most this long the worker holds a run's continue-as-new task until a group's report reaches the run,
and a group's closing task until a continue-as-new task is made (the deadlock detector allows 2 s)."""
LAND_S = 0.4
"""Then this long again, for the group's close to reach the run too."""


class Boundary:
    """The worker's activations, patched. The first workflow task of each run that continues as new is held
    until a group's report reaches the run (the worker makes a group's closing task once its signal was
    delivered) plus `LAND_S`, or `HOLD_S`; ``on_can`` is called as it is made. The closing task of a group
    in ``close_after_can`` is held until a continue-as-new task is made, or `HOLD_S`."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, close_after_can: frozenset[str] = frozenset()
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.runs: list[str] = []
        """Temporal run ids of the runs whose continue-as-new task the worker made, in order."""
        self.on_can: Callable[[], None] = lambda: None
        original = _WorkflowInstanceImpl.activate
        held: set[str] = set()
        can_made, reported = threading.Event(), threading.Event()

        def activate(inst: _WorkflowInstanceImpl, act: Any) -> Any:
            completion = original(inst, act)
            info = inst._info
            commands = completion.successful.commands if completion.HasField("successful") else []
            if info.workflow_type == "RunWorkflow":
                if info.run_id not in held and any(
                    c.HasField("continue_as_new_workflow_execution") for c in commands
                ):
                    held.add(info.run_id)  # a rejected task's retry is not held again
                    reported.clear()
                    can_made.set()
                    self.loop.call_soon_threadsafe(self._seen, info.run_id)
                    if reported.wait(HOLD_S):
                        time.sleep(LAND_S)
            elif info.workflow_type == "GroupWorkflow" and any(
                c.HasField("complete_workflow_execution") for c in commands
            ):
                if info.workflow_id.rsplit("/", 1)[-1] in close_after_can:
                    can_made.wait(HOLD_S)
                reported.set()
            return completion

        monkeypatch.setattr(_WorkflowInstanceImpl, "activate", activate)

    def _seen(self, run_id: str) -> None:
        self.runs.append(run_id)
        self.on_can()


class GatedFakes(Fakes):
    """Fakes whose groups wait, all members recorded, before writing their record (then they report)."""

    def __init__(self, num_groups: int) -> None:
        super().__init__()
        self.gates = {group_id(i): asyncio.Event() for i in range(num_groups)}

    @activity.defn(name="finalize_group")
    async def finalize_group(self, inp: FinalizeGroupInput) -> bool:
        await self.gates[inp.record.group_id].wait()
        return await super().finalize_group(inp)


def fixed_run(uid: str, num_groups: int, inflight: int, segment: int) -> RunInput:
    cfg = Config(
        run=RunConfig(
            num_groups=num_groups, group_size=2, max_inflight_groups=inflight, groups_per_run_segment=segment
        ),
        rollout=RolloutConfig(max_turns=3),
    )
    return RunInput(run_id=f"run-{uid}", config=cfg)


class Segment:
    """One run (segment) of the chain, read from its history."""

    def __init__(self, client: Client, events: list[Any]) -> None:
        conv = client.data_converter.payload_converter
        started = events[0].workflow_execution_started_event_attributes
        [inp] = conv.from_payloads(started.input.payloads, [RunInput])
        self.carried_in = set(inp.state.slots) if inp.state is not None else set()
        self.started = {
            e.start_child_workflow_execution_initiated_event_attributes.workflow_id.rsplit("/", 1)[-1]
            for e in events
            if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
        }
        self.reports: list[str] = []
        for e in events:
            attrs = e.workflow_execution_signaled_event_attributes
            request = e.workflow_execution_update_accepted_event_attributes.accepted_request.input
            if (
                e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                and attrs.signal_name == "group_done"
            ):
                [record] = conv.from_payloads(attrs.input.payloads, [GroupResult])
                self.reports.append(record.group_id)
            elif (
                e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
                and request.name == "group_report"
            ):
                [record] = conv.from_payloads(request.args.payloads, [GroupResult])
                self.reports.append(record.group_id)
        self.rejected = sum(
            1
            for e in events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
            and e.workflow_task_failed_event_attributes.cause
            == WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND
        )
        last = events[-1]
        self.next_run_id: str | None = None
        self.state: RunState | None = None  # the state it continued as new with
        if last.HasField("workflow_execution_continued_as_new_event_attributes"):
            attrs = last.workflow_execution_continued_as_new_event_attributes
            [out] = conv.from_payloads(attrs.input.payloads, [RunInput])
            self.state, self.next_run_id = out.state, attrs.new_execution_run_id
        self.carried_out = set(self.state.slots) if self.state is not None else set()


async def segments(client: Client, workflow_id: str, first_run_id: str) -> list[Segment]:
    out: list[Segment] = []
    run_id: str | None = first_run_id
    while run_id is not None:
        events = [
            e async for e in client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history_events()
        ]
        out.append(Segment(client, events))
        run_id = out[-1].next_run_id
    return out


def assert_each_report_counted_once(segs: list[Segment], num_groups: int) -> None:
    """Every group reported once, and was counted by the run whose history holds its report: the groups a
    run carries over are those it had in flight (carried in or started) less those whose report it holds.
    """
    everyone = [group_id(i) for i in range(num_groups)]
    assert sorted(g for s in segs for g in s.reports) == everyone, "a group reported twice, or not at all"
    done = 0
    for k, s in enumerate(segs):
        assert s.carried_in == (segs[k - 1].carried_out if k else set())
        assert set(s.reports) <= s.carried_in | s.started, (
            f"segment {k} took a report of a group not in flight"
        )
        assert s.carried_out == (s.carried_in | s.started) - set(s.reports), f"segment {k}: a report lost"
        done += len(s.reports)
        if s.state is not None:
            assert s.state.groups_done == done, f"segment {k} carried {s.state.groups_done} groups done"
            assert sum(s.state.outcomes.values()) == 2 * done


async def test_reports_sent_during_the_continue_as_new_task_are_each_counted_once_and_reject_nothing(
    client: Client, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 2, 4 in flight, a segment every 3 groups, 9 groups: every segment ends with its groups in
    flight, waiting to report. When a run's continue-as-new task is made, the groups of that segment (but
    its last one, which reports in the next segment's task, and the last group of the run) and the one
    carried into it report while the task is held: as signals they landed in it and had it rejected."""
    n, segment = 9, 3
    boundary = Boundary(monkeypatch)
    fakes = GatedFakes(n)

    def release() -> None:
        k = len(boundary.runs)
        for i in range(n):
            later = i % segment == segment - 1 and i < n - 1  # carried into the next segment
            if k >= i // segment + 1 + later:
                fakes.gates[group_id(i)].set()

    boundary.on_can = release
    inp = fixed_run(uid, n, inflight=4, segment=segment)
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        result: RunProgress = await handle.result()
    assert handle.first_execution_run_id is not None
    segs = await segments(client, inp.run_id, handle.first_execution_run_id)

    assert (result.groups_done, result.groups_inflight, result.done) == (n, 0, True)
    assert result.outcomes == {"completed": 2 * n}
    assert result.segment == len(segs) - 1 == 3, "the run continued as new after each of its 3 segments"
    assert_every_group_ran_once(fakes, inp)
    assert_each_report_counted_once(segs, n)
    assert group_id(2) in segs[1].carried_in, "held past the first boundary, group 2 reported to a later run"
    assert sum(len(s.reports) for s in segs[1:]) >= 2, "reports sent during a held task reached later runs"
    assert [s.rejected for s in segs] == [0] * len(segs), "a continue-as-new task was rejected"


async def test_a_report_just_before_the_boundary_no_longer_rejects_the_continue_as_new(
    client: Client, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dev server. 2 groups in flight, a segment every 3 groups: group 0 reports, the run starts group 2,
    the segment is full. Group 0's closing task is held until a continue-as-new task is made: its close
    lands in that task unless the run waits for it. Groups 1 and 2 report after the continue-as-new, to the
    next run, which starts group 3 and ends after it (its completing task no more rejected than the
    continue-as-new's)."""
    n, segment = 4, 3
    g0 = group_id(0)
    boundary = Boundary(monkeypatch, close_after_can=frozenset({g0}))
    fakes = GatedFakes(n)
    for g in (g0, group_id(3)):
        fakes.gates[g].set()
    inp = fixed_run(uid, n, inflight=2, segment=segment)
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        first = handle.first_execution_run_id
        latest = client.get_workflow_handle(inp.run_id)

        async def continued() -> bool:
            return (await latest.describe()).run_id != first

        for _ in range(200):  # the run continues as new (real time: up to 20 s)
            if await continued():
                break
            await asyncio.sleep(0.1)
        await wait_for(lambda: len(boundary.runs) == 1, what="the continue-as-new task")
        for g in (group_id(1), group_id(2)):
            fakes.gates[g].set()
        result: RunProgress = await handle.result()
    assert first is not None
    segs = await segments(client, inp.run_id, first)

    assert (result.groups_done, result.done, result.segment) == (n, True, 1)
    assert_every_group_ran_once(fakes, inp)
    assert_each_report_counted_once(segs, n)
    assert segs[0].reports == [g0] and segs[0].carried_out == {group_id(1), group_id(2)}
    assert [s.rejected for s in segs] == [0, 0], "a continue-as-new task was rejected (UNHANDLED_COMMAND)"
