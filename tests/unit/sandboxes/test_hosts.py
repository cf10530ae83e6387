"""Sandbox hosts in the run store, on both backends: placement by free slots, idempotent on the rollout,
hosts that stop heartbeating or leave take nothing new and their rollouts move, the dispatcher's capacity
is the live hosts' slots, and concurrent placers never exceed a host's slots."""

from __future__ import annotations

import contextlib
import random
import threading

import pytest

from durable_rollouts.errors import SandboxSlotPending
from durable_rollouts.sandboxes.hosts import SandboxHosts, host_queue
from durable_rollouts.sandboxes.pool import SandboxPoolConfig
from durable_rollouts.store import RunStore, open_store

CFG = SandboxPoolConfig(placement="hosts", max_size=100, host_timeout_s=10.0)


def test_placement_fills_the_freest_live_host_and_is_idempotent(any_store: RunStore) -> None:
    hosts = SandboxHosts(any_store)
    hosts.register("a", host_queue("q", "a"), "unix:///a.sock", 1, now=0.0)
    hosts.register("b", host_queue("q", "b"), "unix:///b.sock", 2, now=0.0)
    assert hosts.place("r1", CFG, now=1.0).name == "b"  # 2 free beats 1 free
    assert hosts.place("r1", CFG, now=1.5).name == "b"  # the same rollout keeps its host and one slot
    assert hosts.place("r2", CFG, now=2.0).name == "a"  # a tie (1 free each) goes by name
    assert hosts.place("r3", CFG, now=2.0).task_queue == "q@sandbox-host-b"
    with pytest.raises(SandboxSlotPending, match="3 slots, all held"):
        hosts.place("r4", CFG, now=3.0)
    hosts.release("r2")
    assert hosts.place("r4", CFG, now=3.0).name == "a"
    assert {h.name: h.in_use for h in hosts.hosts()} == {"a": 1, "b": 2}


def test_a_host_that_stops_heartbeating_or_leaves_takes_nothing_and_its_rollouts_move(
    any_store: RunStore,
) -> None:
    hosts = SandboxHosts(any_store)
    hosts.register("a", "qa", "unix:///a.sock", 2, now=0.0)
    hosts.register("b", "qb", "unix:///b.sock", 2, now=0.0)
    assert hosts.place("r1", CFG, now=0.0).name == "a"
    hosts.heartbeat("b", now=8.0)
    assert [h.name for h in hosts.live(CFG, now=12.0)] == ["b"]  # a's last beat is 12 s old
    assert hosts.place("r1", CFG, now=12.0).name == "b"  # moved: a is gone
    assert hosts.status(CFG, now=12.0).ready == 2
    hosts.register("a", "qa", "unix:///a.sock", 2, now=13.0)  # it comes back
    assert hosts.place("r1", CFG, avoid=frozenset({"b"}), now=13.0).name == "a"  # a rollout avoiding b
    hosts.leave("a")
    assert hosts.place("r2", CFG, now=13.0).name == "b"
    with pytest.raises(SandboxSlotPending, match="avoiding b"):
        hosts.place("r3", CFG, avoid=frozenset({"b"}), now=13.0)


def test_capacity_is_the_live_hosts_slots_up_to_the_limit(any_store: RunStore) -> None:
    hosts = SandboxHosts(any_store)
    small = SandboxPoolConfig(placement="hosts", initial_size=0, max_size=5, host_timeout_s=10.0)
    assert hosts.status(small, now=0.0).ready == 0
    hosts.register("a", "qa", "unix:///a.sock", 2, now=0.0)
    hosts.place("r1", small, now=0.0)
    s = hosts.status(small, now=1.0)
    assert (s.ready, s.in_use, s.starting, s.max_size) == (2, 1, 0, 5)
    hosts.register("b", "qb", "unix:///b.sock", 4, now=1.0)  # joins mid-run
    assert hosts.status(small, now=2.0).ready == 5  # 6 slots, the limit is 5
    assert hosts.status(small, now=10.5).ready == 4  # a's heartbeat is stale: only b's slots count
    local = SandboxPoolConfig(initial_size=3, max_size=5)
    assert hosts.status(local, now=0.0).ready == 3  # placement "local": the pool's own counter


def test_concurrent_placers_never_exceed_a_hosts_slots(store_url: str) -> None:
    setup = SandboxHosts(open_store(store_url))
    slots = {"a": 2, "b": 3}
    for name, n in slots.items():
        setup.register(name, f"q-{name}", f"unix:///{name}.sock", n, now=1e12)  # live for the whole test
    seen: list[str] = []
    errors: list[BaseException] = []

    def placer(w: int) -> None:
        hosts, rng = SandboxHosts(open_store(store_url)), random.Random(w)
        try:
            for i in range(25):
                key = f"w{w}-{i % 4}"
                with contextlib.suppress(SandboxSlotPending):
                    hosts.place(key, CFG, now=1e12)
                used = {h.name: h.in_use for h in hosts.hosts()}
                seen.extend(n for n, u in used.items() if u > slots[n])
                if rng.random() < 0.5:
                    hosts.release(key)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=placer, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert seen == []
    assert sum(h.in_use for h in setup.hosts()) <= 5
