"""A toy capacity model of a vLLM engine: admission by sequence count and KV tokens, and a prefix cache.

Invariant: requests are admitted first-in first-out, and one is admitted only while fewer than
``max_num_seqs`` run and its tokens (prompt + output) fit the free KV cache, or when nothing runs (so an
oversized request still makes progress). What runs and what waits is exactly what /metrics reports as
``num_requests_running`` and ``num_requests_waiting``. There is no preemption.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass(eq=False)
class _Waiter:
    tokens: int
    admitted: asyncio.Future[None]


class Scheduler:
    """FIFO admission under a sequence limit and a KV-token budget."""

    def __init__(self, max_num_seqs: int, kv_capacity_tokens: int) -> None:
        self._max_seqs = max_num_seqs
        self._capacity = kv_capacity_tokens
        self._queue: deque[_Waiter] = deque()
        self.running = 0
        self.kv_used = 0

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._queue if not w.admitted.done())

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_used / self._capacity)

    @asynccontextmanager
    async def admit(self, tokens: int) -> AsyncIterator[float]:
        """Wait for a slot for ``tokens`` KV tokens; yields the seconds spent waiting."""
        t0 = time.monotonic()
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._pump()
        try:
            await waiter.admitted
        except asyncio.CancelledError:
            if waiter.admitted.done() and not waiter.admitted.cancelled():
                self._release(tokens)
            else:
                self._queue.remove(waiter)
                self._pump()
            raise
        try:
            yield time.monotonic() - t0
        finally:
            self._release(tokens)

    def _pump(self) -> None:
        while self._queue and self.running < self._max_seqs:
            head = self._queue[0]
            if head.admitted.done():
                self._queue.popleft()
                continue
            if self.running and self.kv_used + head.tokens > self._capacity:
                return
            self._queue.popleft()
            self.running += 1
            self.kv_used += head.tokens
            head.admitted.set_result(None)

    def _release(self, tokens: int) -> None:
        self.running -= 1
        self.kv_used -= tokens
        self._pump()


class PrefixCache:
    """Which full blocks of earlier prompts are cached, least recently used evicted first."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self._block = block_size
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries_total = 0
        self.hits_total = 0

    def lookup(self, token_ids: list[int]) -> int:
        """Record a prompt; returns how many of its leading tokens were already cached."""
        self.queries_total += len(token_ids)
        h, hits, missed = 0, 0, False
        for start in range(0, len(token_ids) - self._block + 1, self._block):
            h = hash((h, tuple(token_ids[start : start + self._block])))
            if not missed and h in self._blocks:
                hits += self._block
                self._blocks.move_to_end(h)
            else:
                missed = True
                self._blocks[h] = None
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)
        self.hits_total += hits
        return hits
