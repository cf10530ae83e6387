"""Replica choice: which engine replica a group goes to, pinned for every turn of its members.

Invariant: every function here is deterministic in its arguments (no clocks, no I/O), so the workflows can
call them and replay identically; unit tests drive them directly.

- `replica_order` / `choose_replica`: consistent hashing with bounded load (rendezvous hashing; a replica
  takes new work only while its load stays within ``load_factor`` x the mean, else the next replica in the
  key's order does). The key of a group is its task id, so groups of one task, and every member of a group,
  prefer the replica that already holds their prompt prefix in its cache.
- `replica_load`: the running members on each replica, from the run's own assignments.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

from durable_rollouts.admission.room import running_members
from durable_rollouts.contracts.types import GroupCounts, GroupSlot


def replica_order(urls: list[str], key: str) -> list[str]:
    """The key's replica preference: first choice, then the rest (stable; removing a replica moves only
    the keys that preferred it)."""
    return sorted(urls, key=lambda u: hashlib.sha256(f"{key}|{u}".encode()).digest())


def choose_replica(urls: list[str], key: str, load: Mapping[str, int], add: int, load_factor: float) -> str:
    """The first replica in ``key``'s order whose load stays within the bound after taking ``add``.

    The bound is ceil(load_factor x (total + add) / replicas), at least ``add``; some replica always
    fits (the least loaded one is at most the mean), so the result is the first that does.
    """
    if not urls:
        raise ValueError("no replica to choose from")
    total = sum(load.get(u, 0) for u in urls) + add
    bound = max(add, math.ceil(load_factor * total / len(urls)))
    order = replica_order(urls, key)
    for u in order:
        if load.get(u, 0) + add <= bound:
            return u
    return min(order, key=lambda u: load.get(u, 0))


def replica_load(
    slots: Mapping[str, GroupSlot], counts: Mapping[str, GroupCounts], redispatch: bool
) -> dict[str, int]:
    """Running members per replica (the dispatcher's own assignments)."""
    load: dict[str, int] = {}
    for gid, slot in slots.items():
        load[slot.engine] = load.get(slot.engine, 0) + running_members(slot, counts.get(gid), redispatch)
    return load
