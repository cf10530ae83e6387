"""A round's arithmetic (admission/room.py): the token bucket, the controller's view of the groups in flight,
the cancels per group, the sandbox pool's room."""

from __future__ import annotations

from collections import Counter

import pytest

from durable_rollouts.admission.replicas import replica_load
from durable_rollouts.admission.room import (
    cancels_by_group,
    inflight_view,
    running_members,
    sandbox_room,
    take_tokens,
)
from durable_rollouts.contracts.types import GroupCounts, GroupSlot, PoolStatus


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    b = take_tokens(None, 100.0, rate_per_s=2.0, burst=4.0)
    assert b.tokens == 4.0
    b = take_tokens(b.model_copy(update={"tokens": 0.0}), 101.5, 2.0, 4.0)
    assert b.tokens == pytest.approx(3.0)
    assert take_tokens(b, 200.0, 2.0, 4.0).tokens == 4.0


def test_the_controller_sees_one_entry_per_running_member() -> None:
    slots = {
        "g0": GroupSlot(admitted_at=1.0, engine="a", size=4),
        "g1": GroupSlot(admitted_at=2.0, engine="b", size=4, told=2),
    }
    counts = {"g0": GroupCounts(finished=3), "g1": GroupCounts(finished=2, admission_cancelled=2)}
    view = inflight_view(slots, counts, redispatch=False)
    assert Counter(i.rollout_id.split("#")[0] for i in view) == {"g0": 1, "g1": 2}
    # with redispatch, each admission-cancelled member was started again
    assert running_members(slots["g1"], counts["g1"], redispatch=True) == 4
    assert replica_load(slots, counts, redispatch=False) == {"a": 1, "b": 2}


def test_naming_the_same_members_on_two_polls_cancels_them_once() -> None:
    slots = {"g1": GroupSlot(admitted_at=2.0, engine="b", size=4)}
    counts = {"g1": GroupCounts()}
    first = cancels_by_group(["g1#0003", "g1#0002"], slots, counts)
    assert first == {"g1": 2}
    slots["g1"] = slots["g1"].model_copy(update={"told": 2})
    assert cancels_by_group(["g1#0003", "g1#0002"], slots, counts) == {}
    assert cancels_by_group(["g1#0003", "g1#0002", "g1#0001"], slots, counts) == {"g1": 1}
    # once the told members ended (cancelled records), naming two again means two more
    ended = {"g1": GroupCounts(finished=2, admission_cancelled=2)}
    assert cancels_by_group(["g1#0001", "g1#0000"], slots, ended) == {"g1": 2}


def test_sandbox_room_counts_the_limit_and_the_ready_slots() -> None:
    pool = PoolStatus(ready=4, starting=2, in_use=3, max_size=10)
    assert sandbox_room(pool, inflight=3) == (7, 1)
    assert sandbox_room(pool, inflight=6) == (4, 0)
    assert sandbox_room(None, 5)[0] > 10**6
