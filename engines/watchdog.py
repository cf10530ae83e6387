"""Hang detection: an engine call outstanding on an engine that makes no progress fails within seconds.

A hung engine never fails a call by itself: its port accepts the connection (a hung proxy, a SIGSTOPped
process whose kernel still completes the handshake) or its HTTP server answers ``/health`` while generation
stalls, and the request waits until ``request_timeout_s``. So while calls to an engine are outstanding, this
worker probes it: one probe loop per engine (shared by every call to it, on its own connections so a full
pool of hung calls cannot starve it) reads ``GET /metrics`` every quarter of the stall timeout, and

- the engine answered no probe for ``stall_timeout_s`` (since the later of the call's start and the last
  answer): it is stalled;
- a model call is outstanding and the engine's token counters (``vllm:prompt_tokens_total`` plus
  ``vllm:generation_tokens_total``, summed over label sets) did not move, and no model call of this worker
  to it completed, for ``stall_timeout_s`` since the call started: it is stalled (the engine may be busy with
  other requests while this one waits in its queue; that is progress, and not a stall).

An outstanding call to a stalled engine is cancelled and fails as `EngineStalled` (an ``EngineUnavailable``
not retried in place: the rollout fails over at once, or waits the outage out). Detection takes at most
``stall_timeout_s`` plus two probe intervals (``1.5 x stall_timeout_s``).

Invariants:
- nothing is probed while no call to the engine is outstanding, and a call that ends within one probe
  interval causes no probe at all (the fast path costs one task and a timed wait);
- the probe only reads: what a call returns is exactly what the engine returned, never re-requested;
- an engine without these counters (or without ``/metrics``: any answer below 500 counts) is judged only
  on whether it answers;
- a worker that did not run for a while (SIGSTOPped, its event loop blocked) blames nothing on the engine:
  the silence it then sees is its own, and each outstanding call is judged afresh from its wake-up.

The stall timeout of the calls made in a task is `stall_timeout` (a context variable the model-call
activities set from the run's ``engine.stall_timeout_s``), else the client's default (None: unwatched, so
an env step's tokenize calls keep their retries under the request timeout); 0 disables the watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from durable_rollouts.errors import EngineStalled

T = TypeVar("T")

DEFAULT_STALL_TIMEOUT_S = 10.0
"""``engine.stall_timeout_s``'s default."""
PROBE_FRACTION = 0.25
"""Probe interval as a fraction of the stall timeout."""
MIN_PROBE_S = 0.1
LATE_S = 0.5
"""A watcher woken this much later than two probe intervals was not running (its process frozen or its
event loop starved): the silence it sees is its own, so it judges the engine afresh from then on."""
COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")

stall_timeout: ContextVar[float | None] = ContextVar("engine_stall_timeout_s", default=None)
"""The stall timeout of engine calls made in the current task (None: the client's default)."""


@dataclass
class _Engine:
    """What this worker knows of one engine's liveness (kept across idle periods)."""

    calls: int = 0
    """Watched calls outstanding."""
    intervals: list[float] = field(default_factory=list)
    """Probe interval of each outstanding call; the loop probes at the shortest."""
    answered_at: float = float("-inf")
    changed_at: float = float("-inf")
    """When a probe last saw the counters move, or a model call to the engine last completed."""
    counter: float | None = None
    probe: asyncio.Task[None] | None = None


class Watchdog:
    """Watches the engine calls of one client (`EngineClient` owns one)."""

    def __init__(self, default_stall_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.default_stall_s = default_stall_s
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=8, max_keepalive_connections=4))

    async def aclose(self) -> None:
        for e in self._engines.values():
            if e.probe is not None:
                e.probe.cancel()
        await self._http.aclose()

    async def watch(self, base_url: str, aw: Awaitable[T], *, model_call: bool = False) -> T:
        """Await ``aw`` (a call to the engine at ``base_url``); raises EngineStalled if the engine stalls
        first (``aw`` is then cancelled). ``model_call``: ``aw`` generates tokens (progress is judged on
        the token counters, not only on answers)."""
        stall_s = stall_timeout.get()
        if stall_s is None:
            stall_s = self.default_stall_s
        if not stall_s or stall_s <= 0:
            return await aw
        interval = max(MIN_PROBE_S, stall_s * PROBE_FRACTION)
        e = self._engines.setdefault(base_url, _Engine())
        start = self._clock()
        e.calls += 1
        e.intervals.append(interval)
        if e.probe is None or e.probe.done():
            e.probe = asyncio.create_task(self._probe(base_url, e, stall_s))
        task = asyncio.ensure_future(aw)
        woke = start
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=interval)
                if done:
                    result = task.result()
                    if model_call:
                        e.changed_at = self._clock()  # a model call that completed is progress
                    return result
                now = self._clock()
                if now - woke > 2 * interval + LATE_S:
                    start = now  # this process did not run meanwhile (frozen, starved): judge afresh
                woke = now
                reason = self._stalled(e, start, stall_s, model_call)
                if reason is not None:
                    raise EngineStalled(f"engine {base_url} stalled: {reason}; call abandoned")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            e.calls -= 1
            e.intervals.remove(interval)
            if e.calls == 0 and e.probe is not None:
                e.probe.cancel()
                e.probe = None

    def _stalled(self, e: _Engine, start: float, stall_s: float, model_call: bool) -> str | None:
        now = self._clock()
        silent = now - max(e.answered_at, start)
        if silent > stall_s:
            return f"no answer to GET /metrics for {silent:.1f}s (stall timeout {stall_s:g}s)"
        still = now - max(e.changed_at, start)
        if model_call and e.counter is not None and still > stall_s:
            return f"no token processed for {still:.1f}s under a model call (stall timeout {stall_s:g}s)"
        return None

    async def _probe(self, base_url: str, e: _Engine, stall_s: float) -> None:
        """Read the engine's /metrics every probe interval while calls to it are outstanding."""
        while True:
            await asyncio.sleep(min(e.intervals, default=stall_s * PROBE_FRACTION))
            try:
                resp = await self._http.get(f"{base_url}/metrics", timeout=stall_s)
            except httpx.HTTPError:
                continue  # unanswered: answered_at stays where it was
            if resp.status_code >= 500:
                continue
            now = self._clock()
            e.answered_at = now
            value = progress_counter(resp.text) if resp.status_code == 200 else None
            if value is not None and value != e.counter:
                e.counter, e.changed_at = value, now


def progress_counter(text: str) -> float | None:
    """Sum of the token counters (`COUNTERS`) in a Prometheus text exposition; None if it has none.

    A line scan, not a full parse (vLLM's exposition is large and this runs every probe)."""
    total: float | None = None
    for line in text.splitlines():
        if not line.startswith(COUNTERS):
            continue
        name_end = line.find("{") if "{" in line else line.find(" ")
        if line[:name_end] not in COUNTERS:
            continue  # a longer name with the same prefix
        rest = line[line.rindex("}") + 1 :] if "}" in line else line[name_end:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        total = value if total is None else total + value
    return total


@contextlib.contextmanager
def watching(stall_s: float | None) -> Iterator[None]:
    """Engine calls made inside (in this task) are watched with stall timeout ``stall_s`` (None: the
    default, `DEFAULT_STALL_TIMEOUT_S`, as for inputs recorded before the setting existed)."""
    token = stall_timeout.set(DEFAULT_STALL_TIMEOUT_S if stall_s is None else stall_s)
    try:
        yield
    finally:
        stall_timeout.reset(token)
