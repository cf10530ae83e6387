"""The run notices a group that closed without reporting (deterministic workflow code).

A group reports by signal (``group_done``). One terminated from outside (the web UI, ``temporal workflow
terminate``, ``rollouts terminate``), or one that failed, timed out or was cancelled, never does; the run
finds out by itself and accounts for it as for ``rollouts terminate`` (``RunWorkflow._account_for``,
workflows/unreported.py: members without a record recorded failed, reason `reason_of`, the group's record
written from the store, the group counted):

- Within the segment that started it, the run holds the group's child handle: the handle's failure (the
  server adds the child's close to the run's history, which wakes the run anyway) starts the accounting at
  once, and retrieves the exception. A group that completed leaves nothing to do: no workflow task, timer or
  activity per group.
- A continue-as-new does not carry handles. Groups in flight when a segment begins (``carried``) are asked
  about instead: while one of them is still in flight, every ``interval`` (``admission.poll_interval_s``
  with adaptive admission, else ``run.closed_group_check_s``) one local activity describes them
  (`DispatchActivities.closed_groups`). The first check comes one interval into the segment, so carried
  groups that report within it cost nothing; once none is in flight the checks stop.

Both paths are behind the `notice-closed-groups` patch (histories of earlier releases replay without
them). The accounting is idempotent: a group noticed here and then signalled ``group_terminated`` (or
the other way round), or noticed by both paths, is accounted once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable

from temporalio import workflow
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    TerminatedError,
)
from temporalio.exceptions import TimeoutError as WorkflowTimeoutError

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.dispatch import DispatchActivities
    from durable_rollouts.config.models import Config
    from durable_rollouts.contracts.activity_io import ClosedGroupsInput, TerminatedGroupInput
    from durable_rollouts.contracts.types import FailureKind, GroupSlot, Outcome
    from durable_rollouts.workflows import patches
    from durable_rollouts.workflows.calls import call
    from durable_rollouts.workflows.patches import NOTICE_CLOSED_GROUPS
    from durable_rollouts.workflows.run_end import Account


OUTSIDE = "web UI or CLI"
"""Who terminated a group the run noticed itself (Temporal does not tell the run who did)."""

_WHY = {
    "TERMINATED": ("WorkflowTerminated", f"group terminated ({OUTSIDE})"),
    "FAILED": ("WorkflowFailed", "group failed"),
    "TIMED_OUT": ("WorkflowTimedOut", "group timed out"),
    "CANCELED": ("WorkflowCancelled", "group cancelled"),
    "COMPLETED": ("WorkflowClosed", "group closed without reporting"),
}


def reason_of(status: str) -> str:
    """The failure reason a member without a record gets when its group closed with ``status`` (a
    ``WorkflowExecutionStatus`` name)."""
    kind, what = _WHY.get(status, ("WorkflowClosed", f"group closed ({status.lower()})"))
    return f"{FailureKind.INFRA.value}: {kind}: {what}"


def status_of(e: BaseException) -> str:
    """The close status a child handle's failure stands for."""
    cause = e.cause if isinstance(e, ChildWorkflowError) else e
    if isinstance(cause, TerminatedError):
        return "TERMINATED"
    if isinstance(cause, WorkflowTimeoutError):
        return "TIMED_OUT"
    if isinstance(cause, CancelledError):
        return "CANCELED"
    return "FAILED"


class ClosedGroups:
    """One segment's watch over its groups (nothing here is carried across continue-as-new)."""

    def __init__(self, run_id: str, carried: Iterable[str], account: Account) -> None:
        self.run_id = run_id
        self.account = account
        """``RunWorkflow._account_for``: the one way a group that cannot report is closed."""
        self.carried = set(carried)
        """Groups in flight when this segment began: no handle here, so they are asked about."""
        self.why: dict[str, str] = {}
        """Groups being accounted for now (by any path), with the reason their members get."""
        self.handles: dict[str, workflow.ChildWorkflowHandle] = {}
        """This segment's started groups' child handles (done once the group's close reached the run)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._checks: set[asyncio.Task[None]] = set()
        self._asking = self._stopping = False

    async def watched(
        self, gid: str, start: Awaitable[workflow.ChildWorkflowHandle]
    ) -> workflow.ChildWorkflowHandle:
        """Start a group (``start``) and watch its handle: a failure is noticed at once."""
        handle = await start
        self.handles[gid] = handle

        def done(h: asyncio.Future) -> None:
            if h.cancelled() or (e := h.exception()) is None:  # retrieved: never "never retrieved"
                return
            task = asyncio.create_task(self._noticed(gid, e))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        handle.add_done_callback(done)
        return handle

    def closing(self, slots: dict[str, GroupSlot]) -> list[str]:
        """This segment's groups that left ``slots`` (reported or accounted for) and whose close has not
        reached the run yet: each is about to add its ``ChildWorkflowExecution*`` event to the run's
        history (a group closes one workflow task of its own after its ``group_done`` signal)."""
        return sorted(g for g, h in self.handles.items() if g not in slots and not h.done())

    async def _noticed(self, gid: str, e: BaseException) -> None:
        if not workflow.patched(NOTICE_CLOSED_GROUPS.id):
            return
        workflow.logger.warning("run %s: group %s closed without reporting: %s", self.run_id, gid, e)
        await self._notice(gid, reason_of(status_of(e)))

    async def _notice(self, gid: str, reason: str) -> None:
        ask = TerminatedGroupInput(run_id=self.run_id, group_id=gid, reason=OUTSIDE)
        await self.account(ask, Outcome.FAILED, reason)

    def check_carried(self, slots: dict[str, GroupSlot], cfg: Config) -> None:
        """Start the check of carried groups (the caller starts it only when ``carried`` is not empty, behind
        `NOTICE_CLOSED_GROUPS.id`)."""
        every = cfg.admission.poll_interval_s if cfg.admission.enabled else cfg.run.closed_group_check_s
        task = asyncio.create_task(self._check(slots, every))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def stop(self) -> None:
        """End the checks of carried groups before a continue-as-new: a check asking now gets its answer
        first (the completion of its activity must not land in the task that carries the continue-as-new),
        then the wait for the next one is cancelled (its timer cancelled by a command of that task)."""
        self._stopping = True
        await workflow.wait_condition(lambda: not self._asking)
        for task in list(self._checks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _check(self, slots: dict[str, GroupSlot], interval_s: float) -> None:
        """Every ``interval_s`` while a carried group is in flight (``slots``), ask which of them closed,
        and account for each."""
        left = lambda: sorted(g for g in self.carried if g in slots and g not in self.why)  # noqa: E731
        while left() and not self._stopping:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: not left(), timeout=interval_s)
            if not (ask := left()) or self._stopping:
                return
            self._asking = True
            try:
                closed: dict[str, str] = await call(
                    DispatchActivities.closed_groups,
                    ClosedGroupsInput(run_id=self.run_id, groups=ask),
                    local=patches.run_local(),
                )
            except (ActivityError, ApplicationError) as e:  # asked again next interval
                workflow.logger.warning("run %s: closed-group check failed: %s", self.run_id, e)
                continue
            finally:
                self._asking = False
            for gid, status in sorted(closed.items()):
                if gid in slots and gid not in self.why:
                    workflow.logger.warning(
                        "run %s: group %s closed (%s), unreported", self.run_id, gid, status
                    )
                    await self._notice(gid, reason_of(status))
