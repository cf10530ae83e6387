"""A group that cannot report itself: what the run records for it instead (deterministic workflow code).

A group terminated by hand (``rollouts terminate``), one that closed without reporting (terminated from the
web UI or the ``temporal`` CLI, failed, timed out: the run notices it, workflows/closed_groups.py), or one a
cancelled run cannot tell to cancel, never sends ``group_done``. The run then reads what the store holds of
it and which of its member attempts Temporal holds that did not complete (`DispatchActivities.
terminated_group`, read-only) and, unless the group wrote its own record before it ended, records every
member attempt without a record (those, the ones the caller names and every slot without an attempt) with
the given outcome and reason, and writes the group's record from them. Both writes
are the store's idempotent finalize activities, keyed by rollout and group id, so a retried or replayed
accounting writes nothing twice.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.dispatch import DispatchActivities
    from durable_rollouts.activities.rollout import RolloutActivities
    from durable_rollouts.contracts.activity_io import StoredOutcome, TerminatedGroup, TerminatedGroupInput
    from durable_rollouts.contracts.types import (
        GroupInput,
        GroupResult,
        GroupSlot,
        Outcome,
        RolloutInput,
        RolloutResult,
    )
    from durable_rollouts.workflows import patches
    from durable_rollouts.workflows.calls import call
    from durable_rollouts.workflows.group import close_group, finalize_input, member_input, slot_of
    from durable_rollouts.workflows.rollout_record import finalize_rollout_input


async def record_unreported(
    inp: TerminatedGroupInput,
    slot: GroupSlot,
    task_index: int,
    template: RolloutInput,
    advantage_eps: float,
    outcome: Outcome,
    reason: str,
) -> GroupResult:
    """The record of the group ``inp`` names (run ``template.run_id``), written from the store: its own if it
    wrote one, else one over its recorded attempts and its unrecorded members, recorded now as ``outcome``
    with ``reason`` (the members ``inp`` lists, those Temporal holds that did not complete, and every slot of
    ``slot.size`` without an attempt)."""
    run_id = template.run_id
    ask = inp.model_copy(update={"run_id": run_id, "task_index": task_index, "size": slot.size})
    local = patches.run_local()  # the run's activities: regular under RUN_ACTIVITIES (patches.py)
    seen: TerminatedGroup = await call(DispatchActivities.terminated_group, ask, local=local)
    if seen.record is not None:
        return seen.record
    members = list(dict.fromkeys([*inp.members, *seen.unended]))
    ginp = GroupInput(
        run_id=run_id,
        group_id=inp.group_id,
        task_id=seen.task_id,
        size=slot.size,
        advantage_eps=advantage_eps,
        template=template,
        engine=slot.engine or None,
    )
    attempts = list(seen.members)
    recorded = {r.rollout_id for r in attempts}
    slots_seen = {r.sample_index for r in attempts} | {slot_of(m)[0] for m in members}
    dead = [m for m in members if m not in recorded]
    dead += [f"{run_id}/{inp.group_id}/{i}" for i in range(slot.size) if i not in slots_seen]
    for rid in dead:
        i, attempt = slot_of(rid)
        m = member_input(ginp, i, attempt)
        stored: StoredOutcome = await call(
            RolloutActivities.finalize_rollout, finalize_rollout_input(m, outcome, reason), local=local
        )
        attempts.append(
            RolloutResult(
                rollout_id=rid, sample_index=i, outcome=stored.outcome, reason=stored.reason,
                reward=stored.reward, scorable=stored.scorable, wasted_tokens=stored.wasted_tokens,
            )
        )  # fmt: skip
    record, advantages = close_group(run_id, inp.group_id, seen.task_id, slot.size, attempts, advantage_eps)
    await call(RolloutActivities.finalize_group, finalize_input(record, advantages, attempts), local=local)
    return record
