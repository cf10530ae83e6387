"""A rollout's sandbox inside RolloutWorkflow (deterministic: activities only), for any environment that
uses one.

Invariants:
- One sandbox per rollout, keyed by the rollout id; it is destroyed when the rollout ends, however it ends
  (the workflow's finalize path; a reaper covers terminated workflows).
- A create that finds no free pool slot, or a sandbox backend that is not ready, waits on a durable timer
  and asks again (the pool says how long; else exponential back-off to 30 s); waiting for a slot never
  fails the rollout (only its own timeout ends the wait), a backend not ready after ~2.5 min does.
  The state counts the waits (``sandbox_slot_waits``).
- A sandbox that dies is recovered by replaying the rollout's recorded actions into a fresh one (the
  state counts the replays); if that fails too, the rollout fails as ``infra: SandboxGone``. A dead
  sandbox is never scored.
- With ``placement = "hosts"`` the rollout is placed on a registered sandbox host first (a slot held
  there), and every sandbox activity and sandboxed env step runs on that host's queue. A host that does not
  pick one up within twice ``host_timeout_s`` is gone: the rollout never goes back to it, is placed anew,
  and its sandbox recovered there by replay (a destroy it cannot reach gives back the slot only).
- Every create, recover and destroy activity adds its workflow seconds to the state's ``sandbox_s`` (the
  rollout's environment time outside its turns; durable waits for a slot are not in it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.sandbox import SandboxActivities
    from durable_rollouts.contracts.sandbox import (
        SandboxCreated,
        SandboxPlaceInput,
        SandboxPlacement,
        SandboxStepInput,
    )
    from durable_rollouts.contracts.types import RolloutInput, RolloutRef, RolloutState
    from durable_rollouts.errors import (
        SandboxGone,
        SandboxNotReady,
        SandboxSlotPending,
        application_error,
        is_error,
    )
    from durable_rollouts.workflows.calls import call

T = TypeVar("T")
MAX_RECOVERIES = 2
MAX_NOT_READY_WAITS = 8
"""Waits (~2.5 min in all) before a backend that stays not ready fails the rollout as infra."""
MAX_HOST_MOVES = 8
"""Sandbox hosts a rollout may give up on before a recovery fails as infra (placement = "hosts")."""


class SandboxSteps:
    """The sandbox of one rollout; its counters live in the rollout's state."""

    def __init__(self, inp: RolloutInput, state: RolloutState, ref: RolloutRef) -> None:
        self.inp, self.state, self.ref = inp, state, ref

    async def _timed(self, step: Awaitable[T]) -> T:
        """Await a sandbox activity; its workflow seconds go to the rollout's ``sandbox_s``."""
        t0 = workflow.now()
        try:
            return await step
        finally:
            self.state.sandbox_s += (workflow.now() - t0).total_seconds()

    def _input(self, engine: str, turn: int, with_pool: bool = False) -> SandboxStepInput:
        assert self.inp.sandbox is not None
        return SandboxStepInput(
            ref=self.ref,
            turn=turn,
            engine_url=engine,
            spec=self.inp.sandbox,
            pool=self.inp.pool if with_pool else None,
        )

    @property
    def on_hosts(self) -> bool:
        """Sandboxes of this run live on registered sandbox hosts (``placement = "hosts"``)."""
        return self.inp.pool is not None and self.inp.pool.placement == "hosts"

    def on_host(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """Call a sandbox activity (or a sandboxed env step) where the rollout's sandbox lives: its host's
        queue, whose worker must pick it up within twice ``host_timeout_s``; the run's queue otherwise."""
        if self.state.sandbox_queue is None or self.inp.pool is None:
            return call(fn, *args)
        wait = timedelta(seconds=2 * self.inp.pool.host_timeout_s)
        return call(fn, *args, task_queue=self.state.sandbox_queue, schedule_to_start=wait)

    def unreachable(self, e: ActivityError) -> bool:
        """The rollout's sandbox host did not pick up an activity in time: it is gone (or drained)."""
        cause = e.cause
        return (
            self.on_hosts and isinstance(cause, TimeoutError) and cause.type == TimeoutType.SCHEDULE_TO_START
        )

    def _leave_host(self) -> None:
        """Give up on the current host: never placed there again; the next step places anew."""
        if self.state.sandbox_host is not None and self.state.sandbox_host not in self.state.sandbox_avoid:
            self.state.sandbox_avoid.append(self.state.sandbox_host)
        self.state.sandbox_queue = None
        workflow.set_current_details(f"sandbox host {self.state.sandbox_host} unreachable: moving")

    async def _wait(self, e: ActivityError, waits: int) -> None:
        """Wait durably after a create or placement found no slot (or a backend not ready); re-raise what
        is not a wait."""
        if not is_error(e, SandboxSlotPending, SandboxNotReady):
            raise e
        if is_error(e, SandboxNotReady) and waits >= MAX_NOT_READY_WAITS:
            raise e  # not a passing hiccup (e.g. the image is missing): fail as infra
        app = application_error(e)
        # the pool's estimate of when its slot is ready; else exponential back-off
        hint = float(app.details[0]) if app is not None and app.details else 2.0 ** min(waits + 1, 5)
        message = app.message if app is not None else str(e)
        self.state.sandbox_slot_waits += 1
        workflow.set_current_details(f"waiting for a sandbox slot ({waits + 1}): {message}"[:300])
        await workflow.sleep(min(30.0, max(0.5, hint)))

    async def _place(self) -> None:
        """``placement = "hosts"``: hold a slot on a live host the rollout has not given up on; while none
        is free, wait durably."""
        assert self.inp.pool is not None
        ask = SandboxPlaceInput(
            rollout_id=self.inp.rollout_id, pool=self.inp.pool, avoid=self.state.sandbox_avoid
        )
        waits = 0
        while True:
            try:
                placed: SandboxPlacement = await call(SandboxActivities.sandbox_place, ask)
                self.state.sandbox_queue, self.state.sandbox_host = placed.task_queue, placed.host
                return
            except ActivityError as e:
                await self._wait(e, waits)
                waits += 1

    async def create(self, engine: str) -> str | None:
        """Create the sandbox the task needs (if any); while no pool slot is free, wait durably and ask
        again. With sandbox hosts, place the rollout first, and place it anew if its host is gone before
        the sandbox exists. Returns the host running it (None: no sandbox, or a backend that does not say)."""
        waits = 0
        while True:
            try:
                if self.on_hosts and self.state.sandbox_queue is None:
                    await self._place()
                made: SandboxCreated = await self._timed(
                    self.on_host(SandboxActivities.sandbox_create, self._input(engine, 0, with_pool=True))
                )
                self.state.sandbox = made.created
                if made.timeout_s is not None and self.state.task_deadline is None:
                    self.state.task_deadline = workflow.now().timestamp() + made.timeout_s
                if not self.on_hosts:
                    self.state.sandbox_host = made.host if made.created else None
                return self.state.sandbox_host
            except ActivityError as e:
                if self.unreachable(e):
                    self._leave_host()
                    continue
                await self._wait(e, waits)
                waits += 1

    async def destroy(self) -> None:
        """Remove the sandbox and give back its slot; a host that is gone cannot remove it (its reaper
        does when it comes back), so only the slot is given back."""
        if not (self.state.sandbox or (self.on_hosts and self.state.sandbox_queue is not None)):
            return
        try:
            await self._timed(self.on_host(SandboxActivities.sandbox_destroy, self.inp.rollout_id))
        except ActivityError as e:
            if not self.unreachable(e):
                raise
            await call(SandboxActivities.sandbox_release, self.inp.rollout_id)

    async def recovering(self, engine: str, turn: int, step: Callable[[], Awaitable[T]]) -> T:
        """Run a step that uses the sandbox; a lost sandbox (or, with sandbox hosts, a host that is gone)
        is replaced, on another host if need be (recorded actions replayed), and the step retried, at most
        MAX_RECOVERIES times per rollout."""
        while True:
            try:
                return await step()
            except ActivityError as e:
                lost = self.state.sandbox and is_error(e, SandboxGone)
                if not (lost or self.unreachable(e)) or self.state.sandbox_replays >= MAX_RECOVERIES:
                    raise
                if self.unreachable(e):
                    self._leave_host()
            workflow.set_current_details(f"sandbox lost at turn {turn}: replaying {turn} recorded turns")
            await self._recover(engine, turn)
            self.state.sandbox_replays += 1

    async def _recover(self, engine: str, turn: int) -> None:
        """Replace the sandbox (placing the rollout first if it has no host) and replay into it."""
        while True:
            try:
                if self.on_hosts and self.state.sandbox_queue is None:
                    await self._place()
                await self._timed(
                    self.on_host(SandboxActivities.sandbox_recover, self._input(engine, turn, with_pool=True))
                )
                self.state.sandbox = True
                return
            except ActivityError as e:
                if not self.unreachable(e) or len(self.state.sandbox_avoid) >= MAX_HOST_MOVES:
                    raise
                self._leave_host()
