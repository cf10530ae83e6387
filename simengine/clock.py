"""Clocks for the timing model: simulated seconds, and sleeping until a simulated instant.

Invariant: a clock's ``now()`` never goes backwards, and ``sleep_until(t)`` returns only once ``now() >= t``.

- `ScaledClock` (the default): the event loop's clock times ``time_scale``. Time passes whether or not the
  process gets the CPU, so on a busy machine the engine falls behind and makes the steps up in a burst.
- `PacedClock`: simulated time advances in small wall-clock increments from a ticker task, and a wake-up
  that comes late (the process did not get the CPU, or the event loop was busy with other work) counts only
  ``max_step_s``. Simulated time then stops while the process is starved, for every engine, client timer
  and poll that shares the clock, so results measured in simulated seconds barely depend on how loaded
  the machine is; only the wall time to reach them does. Benchmarks comparing policies use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from typing import Protocol


class SimClock(Protocol):
    time_scale: float

    def now(self) -> float:
        """Simulated seconds (an arbitrary origin)."""
        ...

    async def sleep_until(self, t: float) -> None:
        """Return once ``now() >= t`` (at once, after yielding, when it already is)."""
        ...


class ScaledClock:
    """The event loop's clock, sped up ``time_scale`` times."""

    def __init__(self, time_scale: float = 1.0) -> None:
        self.time_scale = time_scale

    def now(self) -> float:
        return asyncio.get_running_loop().time() * self.time_scale

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, (t - self.now()) / self.time_scale))


class PacedClock:
    """Simulated time that passes only while the event loop keeps its ticker on time."""

    def __init__(self, time_scale: float, resolution_s: float = 0.001, max_step_s: float = 0.003) -> None:
        self.time_scale = time_scale
        self._resolution = resolution_s
        self._max_step = max_step_s
        self._now = 0.0
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self.paused_s = 0.0
        """Wall seconds that did not count as simulated time (late wake-ups beyond ``max_step_s``)."""

    def now(self) -> float:
        return self._now

    async def sleep_until(self, t: float) -> None:
        if t <= self._now:
            await asyncio.sleep(0)
            return
        self.start()
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (t, next(self._order), fut))
        await fut

    def start(self) -> None:
        """Start the ticker (idempotent); sleeping starts it too."""
        if self._task is None:
            self._task = asyncio.create_task(self._tick(), name="simengine-clock")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(self._resolution)
            t = loop.time()
            step = min(t - last, self._max_step)
            self.paused_s += t - last - step
            last = t
            self._now += step * self.time_scale
            while self._waiters and self._waiters[0][0] <= self._now:
                _, _, fut = heapq.heappop(self._waiters)
                if not fut.done():
                    fut.set_result(None)
