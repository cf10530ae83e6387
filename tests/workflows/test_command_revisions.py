"""What a rollout's input asks of its commands: its revision (no marker of the retired ops patch from
revision 1 on, while an input written before revisions still records it, as its histories expect) and
local model calls (each model call a marker, no activity task; the same record as with activities)."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from durable_rollouts.contracts.types import Outcome, RolloutResult
from durable_rollouts.workflows.rollout import RolloutWorkflow

from .fakes import Fakes, fake_worker, rollout_input


async def _history(client: Client, uid: str, **update: object) -> tuple[RolloutResult, Fakes, list]:
    fakes = Fakes()
    fakes.done_on_turn, fakes.reward = 3, 0.75
    inp = rollout_input(uid, **update)
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=tq)
        result: RolloutResult = await handle.result()
        history = await handle.fetch_history()
    return result, fakes, list(history.events)


def _markers(events: list) -> list[str]:
    return [
        e.marker_recorded_event_attributes.marker_name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
    ]


def _scheduled(events: list) -> list[str]:
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]


async def test_revision_1_records_no_patch_marker_and_revision_0_still_does(
    ts_client: Client, uid: str
) -> None:
    new, _, events_new = await _history(ts_client, uid + "n")
    old, _, events_old = await _history(ts_client, uid + "o", revision=0)
    assert "core_patch" not in _markers(events_new)
    assert "core_patch" in _markers(events_old)  # deprecate_patch(OPS): what 0.2.0's histories carry
    changes = [
        e for e in events_old if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
    ]
    assert len(events_old) - len(events_new) == 2 and changes  # the marker and its TemporalChangeVersion
    assert (new.outcome, new.reward, new.turns) == (old.outcome, old.reward, old.turns) == (
        Outcome.COMPLETED, 0.75, 3,
    )  # fmt: skip


async def test_local_model_calls_are_markers_with_the_same_record(ts_client: Client, uid: str) -> None:
    local, fakes_l, events_l = await _history(ts_client, uid + "l", local_model_calls=True)
    remote, fakes_r, events_r = await _history(ts_client, uid + "r")
    assert "generate_turn" not in _scheduled(events_l)
    assert _scheduled(events_r).count("generate_turn") == 3
    assert (
        _markers(events_l).count("core_local_activity") == _markers(events_r).count("core_local_activity") + 3
    )
    assert [g.turn for g in fakes_l.calls["generate_turn"]] == [0, 1, 2]
    (rec_l,) = fakes_l.finalized(local.rollout_id)
    (rec_r,) = fakes_r.finalized(remote.rollout_id)
    keep = ("outcome", "reason", "reward", "scorable", "turns")
    assert [getattr(rec_l, k) for k in keep] == [getattr(rec_r, k) for k in keep]
    assert rec_l.state.sampled_tokens == rec_r.state.sampled_tokens == 30
    assert len(events_l) < len(events_r)
