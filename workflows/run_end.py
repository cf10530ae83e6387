"""How a run ends before its groups do: cancelled as a whole, or stopped by a streak of environment failures
(deterministic workflow code, called by RunWorkflow).

Either way every in-flight group is told ``cancel_all`` with the reason its running members are recorded
cancelled with, the run waits until each group has reported (one that cannot be told, its start cut short
or already ended, is accounted for by the run itself, as for a terminated group), and the store marks the
run with its status (``cancelled`` or ``stopped``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.rollout import RolloutActivities
    from durable_rollouts.contracts.activity_io import TerminatedGroupInput
    from durable_rollouts.contracts.types import GroupSlot, Outcome
    from durable_rollouts.workflows.calls import call
    from durable_rollouts.workflows.group import GroupWorkflow


Account = Callable[[TerminatedGroupInput, Outcome, str], Awaitable[None]]
"""The run's accounting for a group that cannot report (``RunWorkflow._account_for``)."""


async def cancel_groups(
    run_id: str, slots: dict[str, GroupSlot], account: Account, reason: str, status: str
) -> None:
    """Tell every group in ``slots`` (the run's groups in flight, emptied by its ``group_done``) to cancel
    its members with ``reason``, wait until each has reported, then mark the run ``status`` in the store."""
    for gid in sorted(slots):
        group = workflow.get_external_workflow_handle_for(GroupWorkflow.run, f"{run_id}/{gid}")
        try:
            await group.signal(GroupWorkflow.cancel_all, reason)
        except Exception as e:
            workflow.logger.info("run %s: group %s not told to cancel (%s)", run_id, gid, e)
            ask = TerminatedGroupInput(run_id=run_id, group_id=gid, reason=reason)
            await account(ask, Outcome.CANCELLED, reason)
    await workflow.wait_condition(lambda: not slots)
    await call(RolloutActivities.finish_run, run_id, status)
