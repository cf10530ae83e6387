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
- Every create, recover and destroy activity adds its workflow seconds to the state's ``sandbox_s`` (the
  rollout's environment time outside its turns; durable waits for a slot are not in it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.sandbox import SandboxActivities
    from contracts.types import RolloutInput, RolloutState, SandboxCreated, SandboxStepInput
    from errors import SandboxGone, SandboxNotReady, SandboxSlotPending, application_error, is_error
    from workflows.calls import call

T = TypeVar("T")
MAX_RECOVERIES = 2
MAX_NOT_READY_WAITS = 8
"""Waits (~2.5 min in all) before a backend that stays not ready fails the rollout as infra."""


class SandboxSteps:
    """The sandbox of one rollout; its counters live in the rollout's state."""

    def __init__(self, inp: RolloutInput, state: RolloutState) -> None:
        self.inp, self.state = inp, state

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
            run_id=self.inp.run_id,
            rollout_id=self.inp.rollout_id,
            task_id=self.inp.task_id,
            env=self.inp.env.name,
            turn=turn,
            engine_url=engine,
            model=self.inp.engine.model,
            spec=self.inp.sandbox,
            pool=self.inp.pool if with_pool else None,
        )

    async def create(self, engine: str) -> str | None:
        """Create the sandbox the task needs (if any); while no pool slot is free, wait durably and ask
        again. Returns the host running it (None: no sandbox, or a backend that does not say)."""
        waits = 0
        while True:
            try:
                made: SandboxCreated = await self._timed(
                    call(SandboxActivities.sandbox_create, self._input(engine, 0, with_pool=True))
                )
                self.state.sandbox = made.created
                self.state.sandbox_host = made.host if made.created else None
                return self.state.sandbox_host
            except ActivityError as e:
                if not is_error(e, SandboxSlotPending, SandboxNotReady):
                    raise
                if is_error(e, SandboxNotReady) and waits >= MAX_NOT_READY_WAITS:
                    raise  # not a passing hiccup (e.g. the image is missing): fail as infra
                app = application_error(e)
                # the pool's estimate of when its slot is ready; else exponential back-off
                hint = float(app.details[0]) if app is not None and app.details else 2.0 ** min(waits + 1, 5)
                message = app.message if app is not None else str(e)
            waits += 1
            self.state.sandbox_slot_waits += 1
            workflow.set_current_details(f"waiting for a sandbox slot ({waits}): {message}"[:300])
            await workflow.sleep(min(30.0, max(0.5, hint)))

    async def destroy(self) -> None:
        if self.state.sandbox:
            await self._timed(call(SandboxActivities.sandbox_destroy, self.inp.rollout_id))

    async def recovering(self, engine: str, turn: int, step: Callable[[], Awaitable[T]]) -> T:
        """Run a step that uses the sandbox; a lost sandbox is replaced (recorded actions replayed) and the
        step retried, at most MAX_RECOVERIES times per rollout."""
        while True:
            try:
                return await step()
            except ActivityError as e:
                if (
                    not (self.state.sandbox and is_error(e, SandboxGone))
                    or self.state.sandbox_replays >= MAX_RECOVERIES
                ):
                    raise
            workflow.set_current_details(f"sandbox lost at turn {turn}: replaying {turn} recorded turns")
            await self._timed(call(SandboxActivities.sandbox_recover, self._input(engine, turn)))
            self.state.sandbox_replays += 1
