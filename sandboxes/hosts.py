"""Sandbox hosts: workers that own a Docker daemon and a capacity, registered in the run store.

A *sandbox host* is a worker started with ``--sandbox-host NAME --docker-host URL --sandbox-slots N``. It
registers itself here and heartbeats; it polls a task queue of its own (`host_queue`), on which every
sandbox activity of a rollout placed on it runs (the Temporal pattern for worker-affine activities).
With ``sandbox_pool.placement = "hosts"`` a rollout asks `SandboxHosts.place` for a host before it creates
its sandbox; the dispatcher's capacity is then the live hosts' slots, not a simulated counter.

Invariants:
- Placement and release share the pool's lock (`SandboxPool._tx`: the state row, ``BEGIN IMMEDIATE`` on
  SQLite, ``SELECT ... FOR UPDATE`` on PostgreSQL), so concurrent workers on any host never hold more
  slots on a host than it registered.
- Placement is idempotent on the rollout id: a rollout that holds a slot on a live host it does not avoid
  gets that host again; one whose host died (or that avoids it) moves its hold to another host.
- A host is live while its last heartbeat is younger than ``sandbox_pool.host_timeout_s`` and it has not
  left; holds on a host that is not live do not count against anything and are moved or released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from durable_rollouts.errors import SandboxSlotPending
from durable_rollouts.sandboxes.pool import PoolStatus, SandboxPool, SandboxPoolConfig


def host_queue(task_queue: str, host: str) -> str:
    """The task queue of the sandbox activities that run on ``host`` (a run's queue plus the host)."""
    return f"{task_queue}@sandbox-host-{host}"


@dataclass(frozen=True)
class HostInfo:
    """A registered sandbox host as the store holds it."""

    name: str
    task_queue: str
    docker_host: str
    slots: int
    in_use: int
    heartbeat_at: float
    state: str
    """``up`` or ``left`` (stopped on purpose: it takes no new sandboxes)."""


class SandboxHosts(SandboxPool):
    """The pool with its capacity on registered hosts (``placement = "hosts"``); the local counter
    (`SandboxPool.acquire`) remains for ``placement = "local"``."""

    def register(
        self, name: str, task_queue: str, docker_host: str, slots: int, now: float | None = None
    ) -> None:
        """Join (or rejoin) with ``slots`` sandboxes of capacity; it is live from now on."""
        now = time.time() if now is None else now
        with self._tx() as db:
            db.execute(
                "INSERT INTO sandbox_hosts"
                " (name, task_queue, docker_host, slots, state, started_at, heartbeat_at)"
                " VALUES (?,?,?,?,'up',?,?) ON CONFLICT (name) DO UPDATE SET"
                " task_queue = excluded.task_queue, docker_host = excluded.docker_host,"
                " slots = excluded.slots, state = 'up',"
                " started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at",
                (name, task_queue, docker_host, slots, now, now),
            )

    def heartbeat(self, name: str, now: float | None = None) -> None:
        """The host is alive (called every few seconds by its worker)."""
        now = time.time() if now is None else now
        self.db.execute(
            "UPDATE sandbox_hosts SET heartbeat_at = ? WHERE name = ? AND state = 'up'", (now, name)
        )

    def leave(self, name: str) -> None:
        """The host stops on purpose: no new sandbox is placed on it (its rollouts move when it is gone)."""
        self.db.execute("UPDATE sandbox_hosts SET state = 'left' WHERE name = ?", (name,))

    def hosts(self) -> list[HostInfo]:
        """Every registered host, with the slots held on it."""
        rows = self.db.execute(
            "SELECT h.name, h.task_queue, h.docker_host, h.slots, h.heartbeat_at, h.state,"
            " (SELECT COUNT(*) FROM pool_holders p WHERE p.host = h.name)"
            " FROM sandbox_hosts h ORDER BY h.name"
        ).fetchall()
        return [HostInfo(r[0], r[1], r[2], int(r[3]), int(r[6]), float(r[4]), r[5]) for r in rows]

    def live(self, cfg: SandboxPoolConfig, now: float | None = None) -> list[HostInfo]:
        """The hosts that take sandboxes now: up, and heartbeating within ``cfg.host_timeout_s``."""
        now = time.time() if now is None else now
        return [h for h in self.hosts() if h.state == "up" and now - h.heartbeat_at <= cfg.host_timeout_s]

    def place(
        self, key: str, cfg: SandboxPoolConfig, avoid: frozenset[str] = frozenset(), now: float | None = None
    ) -> HostInfo:
        """The host that runs ``key``'s sandbox, holding one of its slots (idempotent on ``key``).

        The live host with the most free slots (ties by name), never one in ``avoid`` (a host the rollout
        could not reach). Raises:
            SandboxSlotPending: No live host has a free slot; details carry the seconds to wait.
        """
        now = time.time() if now is None else now
        with self._tx() as db:
            live = {
                r[0]: (r[1], r[2], int(r[3]), float(r[4]))
                for r in db.execute(
                    "SELECT name, task_queue, docker_host, slots, heartbeat_at FROM sandbox_hosts"
                    " WHERE state = 'up' AND heartbeat_at >= ?",
                    (now - cfg.host_timeout_s,),
                ).fetchall()
                if r[0] not in avoid
            }
            held = db.execute("SELECT host FROM pool_holders WHERE key = ?", (key,)).fetchone()
            if held is not None and held[0] in live:
                q, docker, slots, beat = live[held[0]]
                return HostInfo(held[0], q, docker, slots, -1, beat, "up")
            used = dict(db.execute("SELECT host, COUNT(*) FROM pool_holders GROUP BY host").fetchall())
            free = {name: v[2] - int(used.get(name, 0)) for name, v in live.items()}
            best = min(free, key=lambda n: (-free[n], n), default=None)
            if best is not None and free[best] > 0:
                db.execute("DELETE FROM pool_holders WHERE key = ?", (key,))
                db.execute("INSERT INTO pool_holders (key, at, host) VALUES (?, ?, ?)", (key, now, best))
                db.execute("DELETE FROM pool_waiters WHERE key = ?", (key,))
                q, docker, slots, beat = live[best]
                return HostInfo(best, q, docker, slots, int(used.get(best, 0)) + 1, beat, "up")
            db.execute("INSERT INTO pool_waiters (key, at) VALUES (?, ?) ON CONFLICT DO NOTHING", (key, now))
        capacity = sum(v[2] for v in live.values())
        names = ", ".join(sorted(live)) or "none"
        raise SandboxSlotPending(
            f"sandbox hosts: {len(live)} live ({names}), {capacity} slots, all held; {key} waits 2.0s"
            + (f" (avoiding {', '.join(sorted(avoid))})" if avoid else ""),
            2.0,
        )

    def status(self, cfg: SandboxPoolConfig, now: float | None = None) -> PoolStatus:
        """The pool now; with ``placement = "hosts"``, the live hosts' capacity: ready = their slots,
        in use = the holds on them, starting = 0 (a host counts once it has registered)."""
        if cfg.placement != "hosts":
            return super().status(cfg, now)
        live = self.live(cfg, now)
        waiting = int(self.db.execute("SELECT COUNT(*) FROM pool_waiters").fetchone()[0])
        return PoolStatus(
            ready=min(cfg.max_size, sum(h.slots for h in live)),
            starting=0,
            in_use=sum(h.in_use for h in live),
            max_size=cfg.max_size,
            waiting=waiting,
        )
