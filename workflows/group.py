"""GroupWorkflow: N rollouts of one task under a group id separate from the task id.

Invariants:
- Children have deterministic ids ``<run>/<group>/<i>``; the group closes on count: every member ends
  (completed, truncated, failed or cancelled), and members that failed for infrastructure reasons count
  toward the size but stay out of the reward statistics and advantages.
- A member whose child workflow itself died still gets exactly one record (written here).
- The group reports its result to the run workflow by signal, so the run can continue-as-new while
  groups are in flight.
"""

from __future__ import annotations

import zlib
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, TypedSearchAttributes
from temporalio.exceptions import ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from workflows import search_attributes as sa
    from workflows.grpo import group_stats
    from workflows.rollout import FINALIZE_RETRY, RolloutWorkflow
    from workflows.types import (
        FinalizeGroupInput,
        FinalizeRolloutInput,
        GroupInput,
        GroupResult,
        Outcome,
        RolloutInput,
        RolloutResult,
        rollout_id,
    )


def member_seed(base: int | None, rid: str) -> int | None:
    """Distinct, reproducible seed per member (same run config and rollout id -> same seed)."""
    if base is None:
        return None
    return (base * 1_000_003 + zlib.crc32(rid.encode())) % (2**31 - 1)


@workflow.defn(name="GroupWorkflow")
class GroupWorkflow:
    def __init__(self) -> None:
        self._done = 0
        self._size = 0

    @workflow.query
    def progress(self) -> dict:
        return {"done": self._done, "size": self._size}

    @workflow.run
    async def run(self, inp: GroupInput) -> GroupResult:
        self._size = inp.size
        workflow.set_current_details(f"task={inp.task_id} members=0/{inp.size}")
        members = [self._member_input(inp, i) for i in range(inp.size)]
        handles = []
        for m in members:
            handles.append(
                await workflow.start_child_workflow(
                    RolloutWorkflow.run,
                    m,
                    id=m.rollout_id,
                    search_attributes=TypedSearchAttributes(
                        [
                            sa.RUN.value_set(inp.run_id),
                            sa.GROUP.value_set(inp.group_id),
                            sa.TASK.value_set(inp.task_id),
                            sa.ENV.value_set(m.env),
                            sa.PHASE.value_set("queued"),
                        ]
                    ),
                )
            )
        results: list[RolloutResult] = []
        for m, h in zip(members, handles, strict=True):
            try:
                results.append(await h)
            except ChildWorkflowError as e:
                results.append(await self._record_dead_member(m, e))
            self._done += 1
            workflow.set_current_details(f"task={inp.task_id} members={self._done}/{inp.size}")
        record, advantages = group_stats(
            inp.run_id, inp.group_id, inp.task_id, inp.size, results, inp.advantage_eps
        )
        await workflow.execute_local_activity(
            "finalize_group",
            FinalizeGroupInput(record=record, advantages=advantages),
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=FINALIZE_RETRY,
        )
        if inp.run_workflow_id:
            await workflow.get_external_workflow_handle(inp.run_workflow_id).signal("group_done", record)
        return record

    def _member_input(self, inp: GroupInput, i: int) -> RolloutInput:
        rid = rollout_id(inp.run_id, inp.group_id, i)
        sampling = inp.template.sampling.model_copy(
            update={"seed": member_seed(inp.template.sampling.seed, rid)}
        )
        return inp.template.model_copy(
            update={
                "run_id": inp.run_id,
                "group_id": inp.group_id,
                "rollout_id": rid,
                "task_id": inp.task_id,
                "sample_index": i,
                "sampling": sampling,
            }
        )

    async def _record_dead_member(self, m: RolloutInput, e: ChildWorkflowError) -> RolloutResult:
        """A member whose workflow died (terminated, timed out) is failed (infra) and still recorded."""
        reason = f"infra: child workflow {type(e.cause).__name__}: {e.cause}"[:500]
        await workflow.execute_activity(
            "finalize_rollout",
            FinalizeRolloutInput(
                run_id=m.run_id,
                group_id=m.group_id,
                rollout_id=m.rollout_id,
                task_id=m.task_id,
                sample_index=m.sample_index,
                env=m.env,
                outcome=Outcome.FAILED,
                reason=reason,
                reward=None,
                scorable=False,
                sampling=m.sampling,
                turns=0,
            ),
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30)),
        )
        return RolloutResult(
            rollout_id=m.rollout_id, sample_index=m.sample_index, outcome=Outcome.FAILED, reason=reason
        )
