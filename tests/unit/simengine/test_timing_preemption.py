"""The timing model's preemption cost: ``preemption_steps`` base steps per preempted sequence, no more."""

from __future__ import annotations

import pytest

from durable_rollouts.simengine.settings import TimingSettings
from durable_rollouts.simengine.timing import Seq, StepScheduler

pytestmark = pytest.mark.timeout(60)

BASE = 10.0


def _run(preemption_steps: float) -> StepScheduler:
    """Two sequences that do not fit 8 blocks of 4 tokens together: the younger one is preempted."""
    timing = TimingSettings(
        step_base_ms=BASE, step_per_seq_ms=1.0, prefill_ms_per_token=0.5, max_tick_ms=0.0,
        preemption_steps=preemption_steps,
    )  # fmt: skip
    sched = StepScheduler(timing, 8, 4, 64)
    for rid, first in (("a", 0), ("b", 100)):
        sched.add(Seq(request_id=rid, tokens=list(range(first, first + 20)), prompt_len=8))
    while sched.has_work():
        sched.tick("v0")
    return sched


def test_each_preemption_costs_preemption_steps_base_steps_and_changes_no_count() -> None:
    free, costly = _run(0.0), _run(7.0)
    assert free.stats.preemptions == costly.stats.preemptions >= 1
    assert free.stats.steps == costly.stats.steps
    assert free.stats.recomputed_tokens == costly.stats.recomputed_tokens
    assert free.stats.preemption_s == 0.0
    extra = costly.stats.preemptions * 7.0 * BASE / 1000
    assert costly.stats.preemption_s == pytest.approx(extra)
    assert costly.stats.busy_s == pytest.approx(free.stats.busy_s + extra)
