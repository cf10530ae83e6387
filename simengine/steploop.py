"""The asyncio task that drives one engine's `StepScheduler` in (scaled) real time.

Invariant: a request's future resolves only after the simulated time of every step it took part in has
passed on the wall clock (divided by ``time_scale``), so HTTP clients see the latency the timing model
gives; when the process cannot keep up, steps run back to back and the shortfall is counted in ``lag_s``
instead of being skipped. An aborted request (its client went away) leaves the batch and frees its blocks
before the abort propagates. The loop owns one task, started on the first request and stopped by `aclose`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from simengine.settings import TimingSettings
from simengine.timing import Seq, StepScheduler

MAX_CATCH_UP_S = 0.05
"""Wall seconds of missed deadlines the loop still catches up on (by not sleeping); beyond that it is lag."""


class StepLoop:
    """Runs `StepScheduler.tick` against the wall clock and wakes the requests that finished."""

    def __init__(self, scheduler: StepScheduler, timing: TimingSettings, version: Callable[[], str]) -> None:
        self.scheduler = scheduler
        self._scale = timing.time_scale
        self._version = version
        self._done: dict[Seq, asyncio.Future[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.busy_wall_s = 0.0
        """Wall seconds spent in ticks (at least one sequence running)."""
        self.lag_s = 0.0
        """Wall seconds the loop ran behind its deadlines, beyond what it caught up."""

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
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
            start = loop.time()
            tick = self.scheduler.tick(self._version())
            if tick.steps == 0:
                # Work that cannot be scheduled until something else arrives (never with a valid pool).
                self._wake.clear()
                await self._wake.wait()
                continue
            if deadline < start - MAX_CATCH_UP_S:
                self.lag_s += start - MAX_CATCH_UP_S - deadline
                deadline = start - MAX_CATCH_UP_S
            deadline += tick.duration_s / self._scale
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            for seq in tick.finished:
                done = self._done.get(seq)
                if done is not None and not done.done():
                    done.set_result(None)
            self.busy_wall_s += loop.time() - start
