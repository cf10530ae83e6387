"""The run workflow's activities are regular activities (patch ``run-regular-activities``): a local
activity's result can reach a run in another activation on replay than it did live, beside the run's many
``group_done`` signals, and such a run then failed to replay (a nondeterminism error, seen on a 40 x 4
math run; temporalio 1.32-1.35). A run's history holds no local-activity marker and replays. On the real
dev server (the ``client`` fixture): the run polls every second in real time."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from durable_rollouts.config.models import AdmissionSection, Config, RolloutConfig, RunConfig
from durable_rollouts.contracts.dispatch import PollFleetInput
from durable_rollouts.contracts.types import RunInput, RunProgress
from durable_rollouts.workers.worker import WORKFLOWS
from durable_rollouts.workflows.patches import RUN_ACTIVITIES
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import Fakes, fake_worker


async def run_adaptive(
    client: Client, uid: str, num_groups: int
) -> tuple[Fakes, RunProgress, WorkflowHistory]:
    """An adaptive run of 1-turn rollouts (2 per group, 2 groups at a time) polling once a second."""
    fakes = Fakes()
    fakes.done_on_turn = 1
    cfg = Config(
        run=RunConfig(num_groups=num_groups, group_size=2, max_inflight_groups=2),
        rollout=RolloutConfig(max_turns=1),
        admission=AdmissionSection(enabled=True, poll_interval_s=1.0),
    )
    inp = RunInput(run_id=f"run-{uid}", config=cfg)
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        result: RunProgress = await handle.result()
        history = await handle.fetch_history()
    return fakes, result, history


async def test_an_adaptive_run_calls_regular_activities_and_replays(client: Client, uid: str) -> None:
    _, result, history = await run_adaptive(client, uid, num_groups=6)
    assert result.done and result.groups_done == 6
    events = list(history.events)
    marker = EventType.EVENT_TYPE_MARKER_RECORDED
    markers = [e.marker_recorded_event_attributes for e in events if e.event_type == marker]
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    assert [m.marker_name for m in markers if m.marker_name != "core_patch"] == []  # no local activity
    assert any(RUN_ACTIVITIES.id in str(m.details) for m in markers)  # the patch's marker
    assert "poll_fleet" in scheduled and "task_ids_at" in scheduled
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)


async def test_an_adaptive_run_writes_every_decision_and_a_final_one_after_its_last_group(
    client: Client, uid: str
) -> None:
    # Rollouts end within milliseconds and the run polls once a second: the last group ends while the run
    # waits between decisions, the path on which the last decision went unwritten and no final one was made.
    fakes, result, history = await run_adaptive(client, uid, num_groups=4)
    assert result.done and result.groups_done == 4
    polls: list[PollFleetInput] = fakes.calls["poll_fleet"]
    written = [p.log for p in polls if p.log is not None]
    assert [d.seq for d in written] == list(range(1, len(written) + 1)), "a decision went unwritten"
    assert written[-1].reasons[0] == "final" and written[-1].inflight == 0, written[-1]
    assert all(d.reasons[:1] != ["final"] for d in written[:-1])
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)
