"""The sandbox pool's slots: scale-up latency, the limit, idempotent holding, shared state."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxes.pool import SandboxPool, SandboxPoolConfig, SandboxSlotPending

CFG = SandboxPoolConfig(initial_size=2, max_size=3, scale_up_latency_s=10.0)


def test_slots_beyond_the_ready_ones_start_after_the_latency_and_never_beyond_the_limit(
    tmp_path: Path,
) -> None:
    pool = SandboxPool(tmp_path / "pool.sqlite")
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


def test_a_retried_acquire_holds_one_slot_and_a_waiter_asks_for_one_slot(tmp_path: Path) -> None:
    pool = SandboxPool(tmp_path / "pool.sqlite")
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


def test_two_pool_objects_on_one_file_share_the_slots(tmp_path: Path) -> None:
    one, two = SandboxPool(tmp_path / "p.sqlite"), SandboxPool(tmp_path / "p.sqlite")
    cfg = SandboxPoolConfig(initial_size=1, max_size=1, scale_up_latency_s=0.0)
    one.acquire("a", cfg, now=0.0)
    with pytest.raises(SandboxSlotPending):
        two.acquire("b", cfg, now=0.0)
    one.release("a")
    two.acquire("b", cfg, now=0.0)
