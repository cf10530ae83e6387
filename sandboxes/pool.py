"""The sandbox pool: a bounded number of sandbox slots that scales up with a latency.

A slot stands for the capacity one sandbox needs (a share of a node). The pool starts with
``initial_size`` ready slots; a create that finds none free asks for one more slot, which is ready
``scale_up_latency_s`` later (a node booting, an image pulling), up to ``max_size``. Until then the create
raises `SandboxSlotPending` with the time to wait, and the rollout backs off; it never fails for it.

Invariants:
- State lives in the run store (its ``pool_*`` tables, schema 3), shared by every worker of the store on
  any host, and is changed only in transactions that first lock the pool's state row (SQLite: ``BEGIN
  IMMEDIATE``; PostgreSQL: ``SELECT ... FOR UPDATE``), so two workers never hand out the same slot.
- Holding is idempotent on the sandbox key (the rollout id): a retried create holds one slot, not two;
  releasing an absent key is a no-op. A rollout waiting for a slot is counted once (``waiting``) and asks
  for at most one new slot.
- ready + starting <= max_size; holders <= ready. Slots are never scaled down (documented limitation: a
  real autoscaler would also shrink idle capacity).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from durable_rollouts.errors import SandboxSlotPending


class _Tx(Protocol):
    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any: ...


class _Database(Protocol):
    """What the pool needs of the store's database (store/db.py; sandboxes/ never imports store/)."""

    for_update: str

    def tx(self) -> contextlib.AbstractContextManager[_Tx]: ...

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any: ...


class SandboxPoolConfig(BaseModel):
    """The sandbox pool (``[sandbox_pool]``) the dispatcher tracks: capacity that scales up with a
    latency, to a maximum.

    Every sandbox holds one slot; a create without a ready slot asks for one more (ready after
    scale_up_latency_s) and waits (SandboxSlotPending) instead of failing the rollout.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    initial_size: int = Field(64, ge=0, le=100_000)
    """Slots ready when the pool is first used."""
    max_size: int = Field(256, ge=1, le=100_000)
    """Most slots the pool scales up to (e.g. nodes x sandboxes per node)."""
    scale_up_latency_s: float = Field(0.0, ge=0.0, le=3600.0)
    """Seconds from asking for a slot to its being ready (node boot, image pull)."""
    tasks_per_minute: float = Field(600.0, gt=0.0, le=1_000_000.0)
    """Admission rate of sandboxed rollouts while the pool scales up (token bucket, burst one group)."""
    placement: Literal["local", "hosts"] = "local"
    """``local``: every worker starts sandboxes on its own Docker daemon, the slots counted here (the
    initial size scaling up to the maximum). ``hosts``: sandboxes run on registered sandbox hosts
    (``rollouts worker --sandbox-host``, sandboxes/hosts.py), the capacity their live slots (to max_size)."""
    host_timeout_s: float = Field(15.0, gt=0.0, le=3600.0)
    """``hosts``: a host whose last heartbeat is older is gone: nothing new is placed on it, and its rollouts
    move to another host when they next reach their sandbox (sandbox activities on its queue wait at most
    this long to start)."""
    registry: str | None = Field(None, max_length=200)
    """Image registry for the images environments build (``ImageBuild``, e.g. a Harbor task's Dockerfile),
    as ``host[:port][/namespace]`` (e.g. ``"127.0.0.1:5000/durable-rollouts"``): each image is built on
    one sandbox host, pushed there, and pulled by digest on every other host (sandboxes/images.py). Every
    host's Docker daemon must be able to push to and pull from it. Unset: every host builds its own."""

    @model_validator(mode="after")
    def _check(self) -> SandboxPoolConfig:
        if self.initial_size > self.max_size:
            raise ValueError(f"initial_size {self.initial_size} > max_size {self.max_size}")
        if self.registry is not None:
            check_registry(self.registry)
        return self


_REGISTRY = re.compile(
    r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?)"
    r"(?P<path>(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
)


def check_registry(registry: str) -> str:
    """``registry`` as ``host[:port][/namespace]`` (Docker's reference grammar, lower-case path); the host
    must look like one to Docker (a dot, a port, or ``localhost``): ``team/images`` would mean Docker Hub.

    Raises:
        ValueError: it is not such a name.
    """
    match = _REGISTRY.fullmatch(registry)
    if match is None:
        raise ValueError(
            f"registry {registry!r}: expected host[:port][/namespace], e.g. '127.0.0.1:5000/durable-rollouts'"
            " (lower-case namespace, no scheme, no tag)"
        )
    host = match.group("host")
    if "." not in host and ":" not in host and host != "localhost":
        raise ValueError(
            f"registry {registry!r}: {host!r} is not a registry host to Docker (it would push to Docker Hub);"
            " name it with a dot, a port, or as localhost"
        )
    return registry


class PoolStatus(BaseModel):
    """The pool now: ready, starting (scale-up in progress), in use, waiting, and the limit."""

    ready: int
    starting: int
    in_use: int
    max_size: int
    waiting: int = 0


class SandboxPool:
    """The slots of the sandbox pool every worker of one store shares (its ``pool_*`` tables)."""

    def __init__(self, store: Any) -> None:
        """``store``: a `store.RunStore`, or its database (``store.db``)."""
        self.db: _Database = getattr(store, "db", store)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[_Tx]:
        """A write transaction holding the pool's state row: every change to the pool is serialized
        (SQLite: the write transaction itself; PostgreSQL: ``SELECT ... FOR UPDATE`` on the row)."""
        with self.db.tx() as db:
            db.execute("INSERT INTO pool_state (id, ready) VALUES (1, -1) ON CONFLICT DO NOTHING")
            db.execute("SELECT ready FROM pool_state WHERE id = 1" + self.db.for_update).fetchone()
            yield db

    def _ready(self, db: _Tx, cfg: SandboxPoolConfig, now: float) -> int:
        """Ready slots after promoting the started ones whose time has come (-1 stored: never used)."""
        ready = db.execute("SELECT ready FROM pool_state WHERE id = 1").fetchone()[0]
        if ready < 0:
            ready = min(cfg.initial_size, cfg.max_size)
        done = db.execute("SELECT COUNT(*) FROM pool_starting WHERE ready_at <= ?", (now,)).fetchone()[0]
        if done:
            db.execute("DELETE FROM pool_starting WHERE ready_at <= ?", (now,))
        ready = min(cfg.max_size, ready + done)
        db.execute("UPDATE pool_state SET ready = ? WHERE id = 1", (ready,))
        return ready

    def acquire(self, key: str, cfg: SandboxPoolConfig, now: float | None = None) -> None:
        """Hold a slot for ``key`` (idempotent).

        Raises:
            SandboxSlotPending: No slot is free; the message says how many are starting and the limit.
        """
        now = time.time() if now is None else now
        with self._tx() as db:
            ready = self._ready(db, cfg, now)
            if db.execute("SELECT 1 FROM pool_holders WHERE key = ?", (key,)).fetchone():
                return
            held = db.execute("SELECT COUNT(*) FROM pool_holders").fetchone()[0]
            if held < ready:
                db.execute("INSERT INTO pool_holders (key, at) VALUES (?, ?)", (key, now))
                db.execute("DELETE FROM pool_waiters WHERE key = ?", (key,))
                return
            db.execute("INSERT INTO pool_waiters (key, at) VALUES (?, ?) ON CONFLICT DO NOTHING", (key, now))
            waiting = db.execute("SELECT COUNT(*) FROM pool_waiters").fetchone()[0]
            starting = db.execute("SELECT COUNT(*) FROM pool_starting").fetchone()[0]
            more = min(waiting - starting, cfg.max_size - ready - starting)
            for _ in range(max(0, more)):
                db.execute("INSERT INTO pool_starting (ready_at) VALUES (?)", (now + cfg.scale_up_latency_s,))
            first = db.execute("SELECT MIN(ready_at) FROM pool_starting").fetchone()[0]
        retry = max(0.5, (first - now) if first is not None else 2.0)
        raise SandboxSlotPending(
            f"sandbox pool: {held}/{ready} slots in use, {starting + max(0, more)} starting, limit "
            f"{cfg.max_size}; {key} waits {retry:.1f}s",
            retry,
        )

    def release(self, key: str) -> None:
        """Give back ``key``'s slot (and stop counting it as waiting); absent is fine."""
        with self._tx() as db:
            db.execute("DELETE FROM pool_holders WHERE key = ?", (key,))
            db.execute("DELETE FROM pool_waiters WHERE key = ?", (key,))

    def holders(self) -> list[str]:
        """Keys holding a slot."""
        return [r[0] for r in self.db.execute("SELECT key FROM pool_holders ORDER BY key").fetchall()]

    def status(self, cfg: SandboxPoolConfig, now: float | None = None) -> PoolStatus:
        """The pool now (promotes slots whose start finished)."""
        now = time.time() if now is None else now
        with self._tx() as db:
            ready = self._ready(db, cfg, now)
            starting = db.execute("SELECT COUNT(*) FROM pool_starting").fetchone()[0]
            held = db.execute("SELECT COUNT(*) FROM pool_holders").fetchone()[0]
            waiting = db.execute("SELECT COUNT(*) FROM pool_waiters").fetchone()[0]
        return PoolStatus(ready=ready, starting=starting, in_use=held, max_size=cfg.max_size, waiting=waiting)
