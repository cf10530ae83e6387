"""Transfer time: the seconds a turn (an activity) spends in run-store reads and writes.

Invariants: every store call an activity times goes through one :class:`StoreClock` (a thread, as the
activities always ran them), so timing adds no store round trip; the seconds are recorded with the turn
(segment meta ``transfer_s``, see ``records/timing.py``) by the activity's last write, which cannot time
itself and is not counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class StoreClock:
    """Runs store calls in a thread and sums the seconds they took (thread hand-off included)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        """Seconds spent in the calls made through this clock so far."""

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        t0 = time.monotonic()
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        finally:
            self.seconds += time.monotonic() - t0
