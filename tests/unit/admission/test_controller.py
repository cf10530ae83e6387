"""The admission controller, one test per rule, on synthetic metric traces (polls 5 s apart)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from durable_rollouts.admission.controller import (
    AdmissionConfig,
    AdmissionController,
    AdmissionState,
    Decision,
    EngineReading,
    Inflight,
)


def cfg(**overrides) -> AdmissionConfig:
    """The prime-rl preset (rules 3-8; the probe preset's rules are in test_admission_probe.py), with pacing
    and turnover off, so each test sees only the rule it is about."""
    base = {
        "preset": "prime-rl",
        "max_inflight": 1000,
        "initial_cap": 100,
        "admit_window_s": 0.0,
        "grow_turnover": 0.0,
    }
    return AdmissionConfig(**(base | overrides))


def reading(at=0.0, usage=0.3, running=10, waiting=0, preemptions=0.0, capacity=409_600, engine="e0"):
    return EngineReading(
        engine_id=engine,
        at=at,
        kv_usage=usage,
        running=running,
        waiting_capacity=waiting,
        preemptions_total=preemptions,
        kv_capacity_tokens=capacity,
    )


def flight(n: int, start: float = -1000.0, tokens: int = 10) -> list[Inflight]:
    """n rollouts admitted one second apart from ``start``: r0000 is the oldest."""
    return [Inflight(rollout_id=f"r{i:04d}", admitted_at=start + i, tokens=tokens + i) for i in range(n)]


def poll(ctl: AdmissionController, t: float, n: int, **kw) -> Decision:
    return ctl.step(t, [reading(at=t, **kw)], flight(n))


def test_initial_cap_from_kv_capacity():
    ctl = AdmissionController(cfg(initial_cap=None, max_model_len=4096))
    d = ctl.step(0.0, [reading(capacity=65_536), reading(capacity=32_768, engine="e1")], [])
    assert d.cap == 24
    assert d.admit == 24
    assert ctl.step(5.0, [reading(at=5.0, capacity=10**9)], []).cap == 24  # set once, then carried


def test_initial_cap_is_clamped_and_explicit_cap_wins():
    big = AdmissionController(cfg(initial_cap=None, max_inflight=16, max_model_len=1024))
    assert big.step(0.0, [reading(capacity=1_000_000)], []).cap == 16
    small = AdmissionController(cfg(initial_cap=None, min_inflight=2, max_model_len=1024))
    assert small.step(0.0, [reading(capacity=1024)], []).cap == 2
    assert AdmissionController(cfg(initial_cap=7)).step(0.0, [reading()], []).cap == 7


def test_grow_is_multiplicative_while_cap_binds_with_headroom():
    ctl = AdmissionController(cfg())
    assert poll(ctl, 0.0, 95).cap == 125
    assert poll(ctl, 5.0, 120).cap == 156
    assert poll(ctl, 10.0, 156).cap == 195


def test_no_grow_when_cap_does_not_bind():
    ctl = AdmissionController(cfg())
    assert poll(ctl, 0.0, 89).cap == 100


def test_no_grow_when_something_waits():
    ctl = AdmissionController(cfg())
    d = poll(ctl, 0.0, 100, running=10, waiting=1)  # below the queue ratio: no cut either
    assert d.cap == 100


def test_no_grow_when_any_engine_lacks_headroom():
    ctl = AdmissionController(cfg())
    d = ctl.step(0.0, [reading(usage=0.2), reading(usage=0.65, engine="e1")], flight(100))
    assert d.cap == 100


def test_grow_waits_for_a_full_turnover():
    ctl = AdmissionController(cfg(initial_cap=10, grow_turnover=1.0))
    assert poll(ctl, 0.0, 10).cap == 10  # rollouts already running when the controller starts do not count
    fresh = [Inflight(rollout_id=f"n{i}", admitted_at=2.0, tokens=0) for i in range(9)]
    assert ctl.step(5.0, [reading(at=5.0)], fresh).cap == 10  # 9 of 10 admitted since the cap was set
    fresh.append(Inflight(rollout_id="n9", admitted_at=5.0))
    assert ctl.step(5.0, [reading(at=5.0)], fresh).cap == 12  # the 10th, admitted at the poll instant
    assert ctl.step(10.0, [reading(at=10.0)], fresh).cap == 12  # the cap changed: a new turnover is due


def test_soft_trim_holds_target_usage_without_cancels():
    ctl = AdmissionController(cfg())
    d = poll(ctl, 0.0, 100, usage=0.875)
    assert d.cap == 80  # 100 × 0.7 / 0.875
    assert d.cancel == []
    assert d.admit == 0
    assert poll(ctl, 5.0, 100, usage=0.85).cap == 80  # a trim never raises the cap


def test_hard_trim_cancels_exactly_the_excess_youngest_first():
    ctl = AdmissionController(cfg())
    inflight = flight(100)
    d = ctl.step(0.0, [reading(usage=0.95)], inflight)
    assert d.cap == 73  # floor(100 × 0.7 / 0.95)
    assert d.cancel == [f"r{i:04d}" for i in range(99, 72, -1)]
    assert d.wasted_tokens == sum(i.tokens for i in inflight[73:])
    assert ctl.step(5.0, [reading(at=5.0, usage=0.95)], inflight).cancel == d.cancel  # repeat: same ids


def test_hard_trim_worst_engine_decides():
    ctl = AdmissionController(cfg())
    d = ctl.step(0.0, [reading(usage=0.2), reading(usage=0.95, engine="e1")], flight(100))
    assert (d.cap, len(d.cancel), d.kv_usage) == (73, 27, 0.95)


def test_preemption_cut_on_new_preemption_only():
    ctl = AdmissionController(cfg())
    assert poll(ctl, 0.0, 80, preemptions=5).cap == 100  # first value: baseline, however large
    assert poll(ctl, 5.0, 80, preemptions=5).cap == 100  # unchanged counter: nothing new
    d = poll(ctl, 10.0, 80, preemptions=6)
    assert d.cap == 64  # 0.8 × 80
    assert d.cancel == []


def test_preemption_counter_reset_is_not_a_preemption():
    ctl = AdmissionController(cfg())
    poll(ctl, 0.0, 80, preemptions=50)
    assert poll(ctl, 5.0, 80, preemptions=0).cap == 100  # engine restarted
    assert poll(ctl, 10.0, 80, preemptions=1).cap == 64


def test_persistent_queue_cut_after_queue_polls():
    ctl = AdmissionController(cfg(queue_polls=6))
    queued = {"running": 10, "waiting": 6}  # 6 > 0.5 × 10
    caps = [poll(ctl, 5.0 * t, 80, **queued).cap for t in range(5)]
    assert caps == [100] * 5
    assert poll(ctl, 25.0, 80, **queued).cap == 72  # 0.9 × 80 on the sixth queued poll


def test_interrupted_queue_does_not_cut():
    ctl = AdmissionController(cfg(queue_polls=3))
    for t, waiting in enumerate([6, 6, 0, 6, 6]):
        assert poll(ctl, 5.0 * t, 80, running=10, waiting=waiting).cap == 100


def test_repeated_overload_right_after_drain_cuts_harder():
    ctl = AdmissionController(cfg(repeat_window_polls=6, grow_turnover=1.0))
    assert poll(ctl, 0.0, 100, preemptions=0).cap == 100
    assert poll(ctl, 5.0, 100, preemptions=1).cap == 80  # cut: drain from 100 down to 80 begins
    assert poll(ctl, 10.0, 100, preemptions=2).cap == 80  # overload during the drain is stale
    assert poll(ctl, 15.0, 80, preemptions=2).cap == 80  # drained
    assert poll(ctl, 20.0, 80, preemptions=3).cap == 40  # overload again right away: 0.5 × 80


def test_overload_long_after_drain_cuts_normally():
    ctl = AdmissionController(cfg(repeat_window_polls=2, grow_turnover=1.0))
    poll(ctl, 0.0, 100)
    poll(ctl, 5.0, 100, preemptions=1)
    poll(ctl, 10.0, 80, preemptions=1)  # drained
    for t in range(3):
        poll(ctl, 15.0 + 5 * t, 10, preemptions=1)
    assert poll(ctl, 30.0, 50, preemptions=2).cap == 40  # 0.8 × 50, not 0.5 × 50


def test_fixed_mode_keeps_cap_and_never_cancels():
    ctl = AdmissionController(cfg(min_inflight=8, max_inflight=8, initial_cap=None))
    trace = [
        {"usage": 0.3},
        {"usage": 0.99, "preemptions": 3},
        {"usage": 0.99, "preemptions": 9, "running": 1, "waiting": 50},
        {"usage": 0.1},
    ]
    decisions = [ctl.step(5.0 * t, [reading(at=5.0 * t, **kw)], flight(6)) for t, kw in enumerate(trace)]
    assert [d.cap for d in decisions] == [8] * 4
    assert all(d.cancel == [] and d.admit == 2 for d in decisions)
    assert ctl.step(30.0, [reading(at=30.0, usage=0.99)], flight(12)).cancel == []


def test_stale_metrics_make_engine_unhealthy_and_admit_nothing():
    ctl = AdmissionController(cfg(metrics_max_age_s=15.0))
    assert poll(ctl, 0.0, 10).admit == 90
    d = ctl.step(20.0, [reading(at=0.0)], flight(10))
    assert (d.admit, d.healthy, d.cap) == (0, [], 100)
    assert "stale metrics: e0" in d.reasons


def test_readings_age_at_the_poll_that_read_them_not_at_a_late_decision():
    # the poll read e0 at t=20; the decision runs at t=40 (its workflow task waited for a slot): e0 is fresh
    ctl = AdmissionController(cfg(metrics_max_age_s=15.0))
    assert poll(ctl, 0.0, 10).admit == 90
    d = ctl.step(40.0, [reading(at=20.0)], flight(10), read_at=20.0)
    assert d.healthy == ["e0"] and d.admit > 0 and not any(r.startswith("stale") for r in d.reasons)
    # an engine that stopped answering is stale however late the decision: its newest reading is old at
    # the poll that failed to read it
    d = ctl.step(60.0, [reading(at=20.0)], flight(10), read_at=40.0)
    assert (d.admit, d.healthy) == (0, []) and "stale metrics: e0" in d.reasons


def test_stale_engine_is_excluded_and_blocks_growth():
    ctl = AdmissionController(cfg())
    d = ctl.step(20.0, [reading(at=20.0, usage=0.3), reading(at=0.0, usage=0.99, engine="e1")], flight(100))
    assert d.healthy == ["e0"]
    assert (d.cap, d.cancel) == (100, [])  # the stale 99% neither trims nor cancels, and nothing grows


def test_no_readings_at_all_admit_nothing():
    d = AdmissionController(cfg()).step(0.0, [], [])
    assert (d.admit, d.cap) == (0, 100)


def test_admission_window_paces_new_rollouts():
    ctl = AdmissionController(cfg(admit_window_s=5.0), group_size=4)
    d = ctl.step(0.0, [reading()], [])
    assert d.admit == 10  # max(group_size 4, 10% of cap 100)
    started = [Inflight(rollout_id=f"a{i}", admitted_at=0.0) for i in range(d.admit)]
    assert ctl.step(1.0, [reading(at=1.0)], started).admit == 0  # window spent
    assert ctl.step(5.0, [reading(at=5.0)], started).admit == 10  # next window
    wide = AdmissionController(cfg(admit_window_s=5.0), group_size=16)
    assert wide.step(0.0, [reading()], []).admit == 16  # a whole group always fits


def _trace() -> list[tuple[float, dict, int]]:
    return [
        (0.0, {"preemptions": 0}, 95),
        (5.0, {"preemptions": 1}, 125),
        (10.0, {"preemptions": 1, "running": 10, "waiting": 8}, 110),
        (15.0, {"preemptions": 1}, 100),
        (20.0, {"preemptions": 2}, 100),
        (25.0, {"usage": 0.95, "preemptions": 2}, 60),
    ]


def test_state_round_trips_across_continue_as_new():
    config = cfg(queue_polls=2, admit_window_s=5.0, grow_turnover=0.5)
    straight = AdmissionController(config)
    expected = [poll(straight, t, n, **kw) for t, kw, n in _trace()]
    first = AdmissionController(config)
    got = [poll(first, t, n, **kw) for t, kw, n in _trace()[:3]]
    carried = AdmissionState.model_validate_json(first.state.model_dump_json())
    second = AdmissionController(config, AdmissionState.model_validate(carried.model_dump()))
    got += [poll(second, t, n, **kw) for t, kw, n in _trace()[3:]]
    assert got == expected
    assert len({d.cap for d in expected}) > 2  # the trace exercises more than one rule


def test_config_checks_bounds():
    with pytest.raises(ValidationError):
        AdmissionConfig(min_inflight=10, max_inflight=5)
    with pytest.raises(ValidationError):
        AdmissionConfig(soft_trim_usage=0.95, hard_trim_usage=0.9)
    with pytest.raises(ValidationError):
        AdmissionConfig(grow_factor=1.0)
    with pytest.raises(ValidationError):
        AdmissionConfig(unknown=1)


_polls = st.tuples(
    st.floats(0.0, 1.0),  # kv usage
    st.integers(0, 40),  # running
    st.sampled_from([0, 0, 0, 1, 8, 40]),  # waiting for capacity
    st.sampled_from([0, 0, 0, 0, 1, 2]),  # new preemptions
    st.sampled_from([False] * 5 + [True]),  # reading is stale
    st.sampled_from([0, 0, 1, 3, 10]),  # rollouts that finish before the poll
    st.booleans(),  # cancelled rollouts still in flight at the next poll
)


@settings(max_examples=150, deadline=None)
@given(
    bounds=st.tuples(st.integers(1, 8), st.sampled_from([0, 4, 40, 200])),
    window=st.sampled_from([0.0, 5.0, 12.0]),
    turnover=st.sampled_from([0.0, 1.0]),
    capacity=st.integers(1024, 64 * 1024),
    polls=st.lists(_polls, min_size=1, max_size=25),
)
def test_cap_bounds_and_youngest_cancels_hold_on_random_traces(bounds, window, turnover, capacity, polls):
    lo, hi = bounds[0], bounds[0] + bounds[1]
    config = AdmissionConfig(
        min_inflight=lo, max_inflight=hi, max_model_len=1024, admit_window_s=window, grow_turnover=turnover
    )
    ctl = AdmissionController(config)
    inflight: list[Inflight] = []
    preemptions, serial = 0.0, 0
    for t, (usage, running, waiting, new_pre, stale, finish, lag) in enumerate(polls):
        now = 5.0 * t
        preemptions += new_pre
        r = reading(now - (30.0 if stale else 0.0), usage, running, waiting, preemptions, capacity)
        d = ctl.step(now, [r], inflight)
        assert lo <= d.cap <= hi
        assert len(d.cancel) <= max(0, len(inflight) - d.cap)
        ranked = sorted(inflight, key=lambda i: (i.admitted_at, i.rollout_id), reverse=True)
        assert d.cancel == [i.rollout_id for i in ranked[: len(d.cancel)]]
        assert 0 <= d.admit <= max(0, d.cap - len(inflight))
        if config.fixed:
            assert d.cap == lo and d.cancel == []
        if not lag:
            inflight = [i for i in inflight if i.rollout_id not in d.cancel]
        for _ in range(d.admit):
            inflight.append(Inflight(rollout_id=f"x{serial:05d}", admitted_at=now))
            serial += 1
        # Oldest finish on odd polls, youngest on even ones.
        inflight = inflight[finish:] if t % 2 else inflight[: max(0, len(inflight) - finish)]
