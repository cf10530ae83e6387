"""The dispatcher's pure pieces: bounded-load replica choice, the token bucket, the controller's view."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from admission.replicas import choose_replica, replica_load, replica_order
from admission.room import (
    cancels_by_group,
    inflight_view,
    running_members,
    sandbox_room,
    take_tokens,
)
from contracts.types import GroupCounts, GroupSlot, PoolStatus

URLS = [f"http://r{i}:8000" for i in range(4)]


def test_an_unloaded_fleet_gives_each_key_its_first_hash_choice() -> None:
    for key in (f"task-{i}" for i in range(50)):
        assert choose_replica(URLS, key, {}, 4, 1.25) == replica_order(URLS, key)[0]


def test_a_replica_over_its_bound_passes_the_group_to_the_next_in_order() -> None:
    key = "task-7"
    first, second = replica_order(URLS, key)[:2]
    load = {first: 12}  # bound = ceil(1.25 * 16 / 4) = 5: first is over, the rest are empty
    assert choose_replica(URLS, key, load, 4, 1.25) == second


@given(st.lists(st.integers(0, 200), min_size=4, max_size=4), st.integers(1, 16), st.text(max_size=8))
def test_the_chosen_replica_stays_within_the_bound_or_is_the_least_loaded(
    loads: list[int], add: int, key: str
) -> None:
    load = dict(zip(URLS, loads, strict=True))
    got = choose_replica(URLS, key, load, add, 1.25)
    bound = max(add, math.ceil(1.25 * (sum(loads) + add) / 4))
    assert load[got] + add <= bound or load[got] == min(loads)


def test_placing_many_groups_spreads_them_within_the_load_factor() -> None:
    load: Counter[str] = Counter()
    for g in range(200):
        load[choose_replica(URLS, f"task-{g % 3}", load, 4, 1.25)] += 4  # 3 hot tasks, 4 replicas
    mean = sum(load.values()) / len(URLS)
    assert max(load.values()) <= 1.25 * mean + 4
    assert len(load) == 4


def test_groups_of_one_task_share_a_replica_while_it_has_room() -> None:
    home = choose_replica(URLS, "same-task", {}, 4, 2.0)
    even = {u: 4 for u in URLS}  # bound = ceil(2.0 * 20 / 4) = 10: home takes a second group
    assert choose_replica(URLS, "same-task", even, 4, 2.0) == home


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
