"""The asyncio task that drives one engine's `StepScheduler` against a (simulated) clock.

Invariant: a request's future resolves only after the simulated time of every step it took part in has
passed on the loop's `SimClock` (by default the wall clock sped up ``time_scale`` times), so HTTP clients
see the latency the timing model gives. When the engine falls behind its clock (an event-loop stall on a
busy or shared CPU), the steps it missed run back to back until it has caught up, as a GPU would have kept
stepping meanwhile; only a shortfall beyond ``max_catch_up_s`` is given up, and counted in ``lag_s``. An
aborted request (its client went away) leaves the batch and frees its blocks before the abort propagates.
The loop owns one task, started on the first request and stopped by `aclose`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from durable_rollouts.simengine.clock import ScaledClock, SimClock
from durable_rollouts.simengine.settings import TimingSettings
from durable_rollouts.simengine.timing import Seq, StepScheduler


class StepLoop:
    """Runs `StepScheduler.tick` against a clock and wakes the requests that finished."""

    def __init__(
        self,
        scheduler: StepScheduler,
        timing: TimingSettings,
        version: Callable[[], str],
        clock: SimClock | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.clock: SimClock = clock if clock is not None else ScaledClock(timing.time_scale)
        self._catch_up = timing.max_catch_up_s * self.clock.time_scale
        self._version = version
        self._done: dict[Seq, asyncio.Future[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.busy_wall_s = 0.0
        """Wall seconds spent in ticks (at least one sequence running); catching up after a stall takes
        less wall time than the steps model, so ``scheduler.stats.busy_s`` is the exact measure."""
        self.max_behind_s = 0.0
        """Most simulated seconds the engine was ever behind its clock (stalls being made up)."""
        self.lag_s = 0.0
        """Simulated seconds given up because the engine fell further behind than it catches up."""

    async def generate(self, request_id: str, prompt: list[int], output: list[int]) -> Seq:
        """Run one request through the engine until its whole ``output`` is sampled."""
        seq = Seq(request_id=request_id, tokens=[*prompt, *output], prompt_len=len(prompt))
        done = asyncio.get_running_loop().create_future()
        self._done[seq] = done
        self.scheduler.add(seq)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="simengine-steps")
        self._wake.set()
        try:
            await done
        except asyncio.CancelledError:
            self.scheduler.abort(seq)
            raise
        finally:
            del self._done[seq]
        return seq

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop, clock = asyncio.get_running_loop(), self.clock
        deadline = clock.now()
        while True:
            if not self.scheduler.has_work():
                await self._idle()
                deadline = clock.now()
            start_wall, start = loop.time(), clock.now()
            tick = self.scheduler.tick(self._version())
            if tick.steps == 0:
                # Work that cannot be scheduled until something else arrives (never with a valid pool).
                await self._idle()
                continue
            self.max_behind_s = max(self.max_behind_s, start - deadline)
            if deadline < start - self._catch_up:
                self.lag_s += start - self._catch_up - deadline
                deadline = start - self._catch_up
            deadline += tick.duration_s
            await clock.sleep_until(deadline)
            for seq in tick.finished:
                done = self._done.get(seq)
                if done is not None and not done.done():
                    done.set_result(None)
            self.busy_wall_s += loop.time() - start_wall

    async def _idle(self) -> None:
        self._wake.clear()
        await self._wake.wait()
