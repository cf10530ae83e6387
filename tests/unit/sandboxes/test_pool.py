"""The sandbox pool's slots, in the run store on both backends: scale-up latency, the limit, idempotent
holding, state shared by every worker of the store, and no over-admission under contention."""

from __future__ import annotations

import random
import threading

import pytest

from durable_rollouts.sandboxes.pool import SandboxPool, SandboxPoolConfig, SandboxSlotPending
from durable_rollouts.store import RunStore, open_store

CFG = SandboxPoolConfig(initial_size=2, max_size=3, scale_up_latency_s=10.0)


def test_slots_beyond_the_ready_ones_start_after_the_latency_and_never_beyond_the_limit(
    any_store: RunStore,
) -> None:
    pool = SandboxPool(any_store)
    pool.acquire("a", CFG, now=0.0)
    pool.acquire("b", CFG, now=0.0)
    with pytest.raises(SandboxSlotPending) as e:
        pool.acquire("c", CFG, now=1.0)
    assert e.value.retry_after_s == pytest.approx(10.0)
    with pytest.raises(SandboxSlotPending):
        pool.acquire("d", CFG, now=1.0)  # the limit is 3: no fourth slot starts
    s = pool.status(CFG, now=2.0)
    assert (s.ready, s.starting, s.in_use, s.waiting) == (2, 1, 2, 2)
    pool.acquire("c", CFG, now=11.5)  # its slot is ready now
    assert pool.status(CFG, now=11.5).ready == 3
    with pytest.raises(SandboxSlotPending):
        pool.acquire("d", CFG, now=12.0)
    pool.release("a")
    pool.acquire("d", CFG, now=12.0)
    assert sorted(pool.holders()) == ["b", "c", "d"]


def test_a_retried_acquire_holds_one_slot_and_a_waiter_asks_for_one_slot(any_store: RunStore) -> None:
    pool = SandboxPool(any_store)
    cfg = SandboxPoolConfig(initial_size=1, max_size=10, scale_up_latency_s=5.0)
    pool.acquire("a", cfg, now=0.0)
    pool.acquire("a", cfg, now=0.1)
    for _ in range(3):
        with pytest.raises(SandboxSlotPending):
            pool.acquire("b", cfg, now=0.2)
    s = pool.status(cfg, now=0.3)
    assert (s.in_use, s.starting, s.waiting) == (1, 1, 1)
    pool.release("b")  # a rollout that gave up waiting stops counting
    assert pool.status(cfg, now=0.3).waiting == 0


def test_two_stores_on_one_url_share_the_slots(store_url: str) -> None:
    one, two = SandboxPool(open_store(store_url)), SandboxPool(open_store(store_url).db)
    cfg = SandboxPoolConfig(initial_size=1, max_size=1, scale_up_latency_s=0.0)
    one.acquire("a", cfg, now=0.0)
    with pytest.raises(SandboxSlotPending):
        two.acquire("b", cfg, now=0.0)
    one.release("a")
    two.acquire("b", cfg, now=0.0)


def test_workers_hammering_hold_and_release_never_over_admit(store_url: str) -> None:
    """Eight workers, each with its own store object and connection (as on separate hosts), hold and
    release slots as fast as they can while the pool scales up: at every moment the slots handed out
    stay within the ready ones and the limit, and a key is held by one worker at most."""
    cfg = SandboxPoolConfig(initial_size=2, max_size=5, scale_up_latency_s=0.005)
    holding: set[str] = set()
    lock = threading.Lock()
    peak = [0]
    problems: list[str] = []
    admitted, refused = [0], [0]

    def work(w: int) -> None:
        pool, rng = SandboxPool(open_store(store_url)), random.Random(w)
        mine: list[str] = []
        for i in range(60):
            if mine and rng.random() < 0.5:
                key = mine.pop(rng.randrange(len(mine)))
                with lock:  # leaves our books before the store's, so ours never exceed the store's
                    holding.discard(key)
                pool.release(key)
                continue
            key = f"w{w}-{i}"
            try:
                pool.acquire(key, cfg)
            except SandboxSlotPending:
                with lock:
                    refused[0] += 1
                if rng.random() < 0.5:
                    pool.release(key)  # gave up waiting
                continue
            with lock:
                holding.add(key)
                peak[0] = max(peak[0], len(holding))
                admitted[0] += 1
                if len(holding) > cfg.max_size:
                    problems.append(f"{len(holding)} holders > max {cfg.max_size}")
            mine.append(key)
            s = pool.status(cfg)
            if s.in_use > s.ready or s.ready + s.starting > cfg.max_size:
                problems.append(f"in_use {s.in_use}, ready {s.ready}, starting {s.starting}")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    final = SandboxPool(open_store(store_url)).status(cfg)
    assert final.in_use == len(holding) <= final.ready <= cfg.max_size
    # the pool filled, turned requests away and kept handing slots out (counts vary with thread timing)
    assert peak[0] == cfg.max_size and refused[0] > 0 and admitted[0] > cfg.max_size
