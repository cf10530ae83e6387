"""The arithmetic of an admission round: the controller's view of the groups in flight, what the sandbox
pool and the trainer queue leave of its admit, the cancels per group.

Invariant: every function here is deterministic in its arguments (no clocks, no I/O), so RunWorkflow can
call them and replay identically; unit tests drive them directly.

- `inflight_view`: the controller's list of rollouts in flight, built from group-level counts only (one
  entry per running member, ids ``<group>#<k>``), so no per-rollout state travels through history.
- `newly_complete`, `closed_unseen`: the rollouts that ended since the previous round (rule P5 learns
  their footprints), including those of groups that closed in between.
- `cancels_by_group`: the controller's cancels as members to cancel per group, each member once.
- `admission_room`: the controller's admit cut by the sandbox pool and the trainer queue; `take_tokens`:
  a token bucket (rate per second, burst), used for sandboxed rollouts while the sandbox pool scales up.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from durable_rollouts.admission.controller import Inflight
from durable_rollouts.contracts.types import (
    RAN_TO_END,
    DispatchState,
    GroupCounts,
    GroupResult,
    GroupSlot,
    PoolStatus,
    TokenBucket,
)


def take_tokens(bucket: TokenBucket | None, now: float, rate_per_s: float, burst: float) -> TokenBucket:
    """The bucket refilled up to ``now`` (a new bucket starts full)."""
    if bucket is None:
        return TokenBucket(tokens=burst, at=now)
    tokens = min(burst, bucket.tokens + max(0.0, now - bucket.at) * rate_per_s)
    return TokenBucket(tokens=tokens, at=now)


def running_members(slot: GroupSlot, counts: GroupCounts | None, redispatch: bool) -> int:
    """Members of a group still holding (or about to hold) engine resources."""
    c = counts or GroupCounts()
    started = slot.size + (c.admission_cancelled if redispatch else 0)
    return max(0, started - c.finished)


def inflight_view(
    slots: Mapping[str, GroupSlot], counts: Mapping[str, GroupCounts], redispatch: bool
) -> list[Inflight]:
    """One `Inflight` per running member of every group in flight (ids ``<group>#<k>``)."""
    out: list[Inflight] = []
    for gid, slot in slots.items():
        for k in range(running_members(slot, counts.get(gid), redispatch)):
            out.append(Inflight(rollout_id=f"{gid}#{k:04d}", admitted_at=slot.admitted_at))
    return out


def closed_unseen(ds: DispatchState, slot: GroupSlot, record: GroupResult) -> None:
    """A group closed: its completed or truncated members that no poll showed wait in ``ds`` for the next
    step (the last members of a group, often its longest, end after the last poll that saw it)."""
    ended = sum(record.outcomes.get(o.value, 0) for o in RAN_TO_END)
    ds.unseen_complete += max(0, ended - slot.seen_complete)
    ds.unseen_complete_tokens += max(0, record.complete_tokens - slot.seen_complete_tokens)


def newly_complete(
    ds: DispatchState, slots: Mapping[str, GroupSlot], counts: Mapping[str, GroupCounts]
) -> tuple[int, int]:
    """Rollouts that completed or were truncated since the previous poll, and their summed tokens (rule P5
    learns from them): the groups in flight's new ones plus those of groups that closed in between. Marks
    them seen (the slots' and the dispatch state's counters)."""
    ended, tokens = ds.unseen_complete, ds.unseen_complete_tokens
    ds.unseen_complete = ds.unseen_complete_tokens = 0
    for gid, slot in sorted(slots.items()):
        c = counts.get(gid)
        if c is None or c.complete <= slot.seen_complete:
            continue
        ended += c.complete - slot.seen_complete
        tokens += max(0, c.complete_tokens - slot.seen_complete_tokens)
        slot.seen_complete, slot.seen_complete_tokens = c.complete, c.complete_tokens
    return ended, tokens


def cancels_by_group(
    cancel: list[str], slots: Mapping[str, GroupSlot], counts: Mapping[str, GroupCounts]
) -> dict[str, int]:
    """How many more members each group must cancel for the controller's ``cancel`` list.

    The controller names running members, including ones already told to cancel that have not ended yet;
    those are subtracted, so naming the same members on two polls cancels them once.
    """
    named: dict[str, int] = {}
    for rid in cancel:
        gid = rid.split("#", 1)[0]
        named[gid] = named.get(gid, 0) + 1
    more: dict[str, int] = {}
    for gid, k in sorted(named.items()):
        slot = slots.get(gid)
        if slot is None:
            continue
        c = counts.get(gid) or GroupCounts()
        pending = max(0, slot.told - c.admission_cancelled)
        if k > pending:
            more[gid] = k - pending
    return more


def sandbox_room(pool: PoolStatus | None, inflight: int) -> tuple[int, int]:
    """(rollouts the pool's limit still allows, of which how many have a ready slot now)."""
    if pool is None:
        return (1 << 30, 1 << 30)
    used = max(inflight, pool.in_use)
    return max(0, pool.max_size - used), max(0, pool.ready - used)


class Room(BaseModel):
    """What one admission round may start: rollouts, groups, and why it is less than the controller's."""

    model_config = ConfigDict(frozen=True)

    rollouts: int
    """Rollouts that may start (the controller's admit, cut by the sandbox pool and its token bucket)."""
    ready: int
    """Of those, how many find a ready sandbox slot (the rest wait for a slot that is starting)."""
    max_groups: int
    """Groups that may be in flight (run.max_inflight_groups, cut by the trainer queue limit)."""
    bucket: TokenBucket | None
    reasons: list[str]


def admission_room(
    admit: int,
    now: float,
    inflight: int,
    groups_inflight: int,
    pool: PoolStatus | None,
    bucket: TokenBucket | None,
    tasks_per_minute: float,
    group_size: int,
    max_inflight_groups: int,
    max_queued_groups: int | None,
    unconsumed_groups: int,
) -> Room:
    """Cut the controller's ``admit`` to what the sandbox pool and the trainer queue allow.

    Admissions that would wait for a sandbox slot still starting are paced by a tasks-per-minute token
    bucket (burst one group); ``max_queued_groups`` stops admission while groups in flight plus complete
    groups the feed has not taken reach it.
    """
    room, reasons, ready = admit, [], 1 << 30
    if pool is not None:
        limit, ready = sandbox_room(pool, inflight)
        wanted = min(room, limit)
        if wanted > ready:  # some would wait for a slot to start: pace them by the bucket
            bucket = take_tokens(bucket, now, tasks_per_minute / 60.0, float(group_size))
            wanted = min(wanted, ready + int(bucket.tokens))
        if wanted < room:
            reasons.append(f"sandbox pool {pool.model_dump()}: admit {room} -> {wanted}")
        room = wanted
    max_groups = max_inflight_groups
    if max_queued_groups is not None:  # freshness: do not outrun the trainer
        max_groups = min(max_groups, max_queued_groups - unconsumed_groups)
        if groups_inflight >= max_groups:
            reasons.append(f"queue: {unconsumed_groups} groups wait for the trainer")
    return Room(rollouts=room, ready=ready, max_groups=max_groups, bucket=bucket, reasons=reasons)


def spend_bucket(bucket: TokenBucket | None, admitted: int, ready: int) -> TokenBucket | None:
    """The bucket after ``admitted`` rollouts started, of which only those beyond ``ready`` wait."""
    if bucket is None or admitted <= ready:
        return bucket
    return bucket.model_copy(update={"tokens": max(0.0, bucket.tokens - float(admitted - ready))})
