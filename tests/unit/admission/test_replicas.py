"""Replica choice (admission/replicas.py): bounded-load hashing of a group's task id over the replicas."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from durable_rollouts.admission.replicas import choose_replica, replica_order

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
