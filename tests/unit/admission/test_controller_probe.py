"""The admission controller's probe preset (rules P1-P4), one test per rule, on metric traces 5 s apart.

A trace here is what a run would record: per poll, every engine's reading (KV usage, running, waiting for
capacity, preemption and generated-token counters) and how many rollouts are in flight.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from durable_rollouts.admission.controller import (
    AdmissionConfig,
    AdmissionController,
    Decision,
    EngineReading,
    Inflight,
)


def cfg(**overrides) -> AdmissionConfig:
    """The probe preset with pacing and the footprint prediction (P5, tested in test_admission_footprint.py)
    off and a fixed start, so each test sees only the rule it is about."""
    base = {"preset": "probe", "max_inflight": 1000, "initial_cap": 10, "admit_window_s": 0.0}
    base["predicted_fill"] = 0.0
    return AdmissionConfig(**(base | overrides))


def reading(at, tokens, usage=0.3, running=10, waiting=0, preemptions=0.0, engine="e0") -> EngineReading:
    return EngineReading(
        engine_id=engine,
        at=at,
        kv_usage=usage,
        running=running,
        waiting_capacity=waiting,
        preemptions_total=preemptions,
        kv_capacity_tokens=409_600,
        generation_tokens_total=tokens,
    )


def flight(n: int) -> list[Inflight]:
    return [Inflight(rollout_id=f"r{i:04d}", admitted_at=-1000.0 + i) for i in range(n)]


class Trace:
    """Feeds one engine's polls 5 s apart; ``rate`` tokens/s are generated between polls unless told."""

    def __init__(self, ctl: AdmissionController) -> None:
        self.ctl, self.t, self.tokens, self.preemptions = ctl, 0.0, 0.0, 0.0

    def poll(self, n: int | None = None, rate: float = 100.0, new_preemptions: float = 0, **kw) -> Decision:
        if self.t > 0:
            self.tokens += rate * 5.0
        self.preemptions += new_preemptions
        cap = self.ctl.state.cap or 10
        d = self.ctl.step(
            self.t,
            [reading(self.t, self.tokens, preemptions=self.preemptions, **kw)],
            flight(cap if n is None else n),
        )
        self.t += 5.0
        return d

    def epoch(self, rate: float = 100.0, **kw) -> Decision:
        """Polls until the cap changes or a judgement is logged (at most probe_polls + 1 polls)."""
        d = self.poll(rate=rate, **kw)
        for _ in range(self.ctl.config.probe_polls):
            if any("probe" in r for r in d.reasons):
                break
            d = self.poll(rate=rate, **kw)
        return d


def test_the_cap_grows_fast_while_the_fleet_s_kv_usage_is_low():
    tr = Trace(AdmissionController(cfg()))
    assert tr.poll().cap == 10  # initial cap; the epoch starts
    assert tr.poll().cap == 10  # one poll of two
    d = tr.poll()
    assert d.cap == 20 and any("cap 10 -> 20" in r for r in d.reasons)
    assert d.admit == 10  # the new room at once


def test_near_full_kv_the_probe_grows_by_the_smaller_factor():
    tr = Trace(AdmissionController(cfg()))
    assert tr.epoch(usage=0.7).cap == 12  # 10 × 1.2


def test_a_flat_rate_at_high_usage_sets_a_ceiling_that_lifts_after_reprobe_polls():
    tr = Trace(AdmissionController(cfg(reprobe_polls=6)))
    assert tr.epoch(rate=100.0, usage=0.7).cap == 12
    tr.poll(rate=100.0, usage=0.7)  # the epoch at 12 starts
    d = tr.epoch(rate=95.0, usage=0.7)  # fell, but by less than drop_revert
    assert d.cap == 12 and any("probe flat" in r and "ceiling 12" in r for r in d.reasons)
    for _ in range(4):
        assert tr.poll(rate=95.0, usage=0.7).cap == 12  # held at the ceiling
    caps = [tr.poll(rate=95.0, usage=0.7).cap for _ in range(4)]
    assert caps[-1] == 14  # lifted: 12 × 1.2


def test_at_low_usage_a_flat_rate_does_not_stop_the_probe():
    tr = Trace(AdmissionController(cfg()))
    assert tr.epoch(rate=100.0).cap == 20
    tr.poll(rate=100.0)
    assert tr.epoch(rate=95.0).cap == 40  # 20 × 2: usage 0.3 < fast_below_usage


def test_min_gain_asks_for_a_gain_before_growing_again():
    tr = Trace(AdmissionController(cfg(min_gain=0.03)))
    assert tr.epoch(rate=100.0, usage=0.7).cap == 12
    tr.poll(rate=100.0, usage=0.7)
    d = tr.epoch(rate=101.0, usage=0.7)  # +1 % < min_gain
    assert d.cap == 12 and tr.ctl.state.ceiling == 12


def test_a_rate_drop_after_growth_reverts_to_the_previous_cap():
    tr = Trace(AdmissionController(cfg()))
    assert tr.epoch(rate=100.0, usage=0.7).cap == 12
    tr.poll(rate=100.0, usage=0.7)
    d = tr.epoch(rate=80.0, usage=0.7)  # 20 % slower > drop_revert
    assert d.cap == 10 and any("probe lost" in r for r in d.reasons)
    assert tr.ctl.state.ceiling == 10
    assert tr.epoch(rate=80.0, usage=0.7).cap == 10  # no growth past the ceiling


def test_a_preemption_storm_cuts_sets_a_ceiling_and_admits_nothing_while_it_lasts():
    tr = Trace(AdmissionController(cfg()))
    tr.poll(n=10)
    d = tr.poll(n=10, new_preemptions=12, running=10)  # 12 >= 8 and > 1.0 × 10 running
    assert d.storm and d.admit == 0 and d.cap == 8
    assert any("preemption storm" in r for r in d.reasons)
    assert tr.ctl.state.ceiling == 8 and tr.ctl.state.storm_polls == 1
    d = tr.poll(n=9, new_preemptions=12, running=10)  # still storming (and draining): nothing admitted
    assert d.storm and d.admit == 0 and d.cap == 8
    d = tr.poll(n=6)  # over
    assert not d.storm and d.admit == 2


def test_preemptions_short_of_a_storm_cut_nothing():
    tr = Trace(AdmissionController(cfg()))
    tr.poll()
    d = tr.poll(new_preemptions=7, running=4)  # 7 > 1.0 × 4 running but < storm_min_preemptions 8
    assert not d.storm and d.cap == 10
    d = tr.poll(new_preemptions=9, running=20)  # 9 >= 8 but not > 20 running (nor > 0.5 × 20: P4 grows)
    assert not d.storm and d.cap == 20  # the epoch completes and the cap grows


def test_half_a_storm_of_preemptions_holds_the_probe_and_cuts_nothing():
    tr = Trace(AdmissionController(cfg()))
    tr.poll()
    tr.poll()
    d = tr.poll(new_preemptions=6, running=10)  # 6 >= 0.5 × 8 and > 0.5 × 10 running: half a storm
    assert not d.storm and d.cap == 10 and tr.ctl.state.ceiling is None
    assert any("near a preemption storm: cap 10 held" in r for r in d.reasons)
    tr.poll()
    assert tr.poll().cap == 20  # the next epoch, without preemptions, grows


def test_preemptions_below_half_a_storm_do_not_hold_the_probe():
    for new, running in ((4, 10), (3, 2)):  # 4 is not > 0.5 × 10 running; 3 < 0.5 × 8
        tr = Trace(AdmissionController(cfg()))
        tr.poll()
        tr.poll()
        assert tr.poll(new_preemptions=new, running=running).cap == 20


def test_a_persistent_capacity_queue_stops_growth_and_a_passing_one_does_not():
    tr = Trace(AdmissionController(cfg(queue_polls=2)))
    assert tr.epoch(waiting=1, running=10).cap == 20  # 1 <= 0.5 × 10: not a queued poll
    tr = Trace(AdmissionController(cfg(queue_polls=2)))
    assert tr.epoch(waiting=6, running=10).cap == 10  # queued for 3 polls >= queue_polls
    tr = Trace(AdmissionController(cfg(queue_polls=5)))
    assert tr.epoch(waiting=6, running=10).cap == 20  # queued, but not yet for queue_polls


def test_a_cap_that_does_not_bind_measures_nothing():
    tr = Trace(AdmissionController(cfg(initial_cap=40)))
    for _ in range(6):
        assert tr.poll(n=20).cap == 40  # 20 + group of 1 < 0.9 × 40
    assert tr.ctl.state.epoch_start_at is None


def test_a_stale_reading_pauses_the_probe():
    ctl = AdmissionController(cfg())
    for i in range(6):
        t = 5.0 * i
        fresh = reading(t, 500.0 * i, engine="e0")
        stale = reading(t - 30.0, 0.0, engine="e1")  # older than metrics_max_age_s
        ctl.step(t, [fresh, stale] if i >= 1 else [fresh], flight(10))
    assert ctl.state.cap == 10


def test_an_engine_restart_adds_no_tokens_to_the_epoch():
    ctl = AdmissionController(cfg(probe_polls=5))
    ctl.step(0.0, [reading(0.0, 1000.0)], flight(10))
    ctl.step(5.0, [reading(5.0, 1500.0)], flight(10))
    ctl.step(10.0, [reading(10.0, 20.0)], flight(10))  # the counter went back: a restart
    assert ctl.state.epoch_tokens == 500.0 and ctl.state.tokens_total["e0"] == 20.0


def test_the_probe_paces_admissions_by_its_own_window_fraction():
    ctl = AdmissionController(cfg(admit_window_s=5.0, initial_cap=100), group_size=4)
    d = ctl.step(0.0, [reading(0.0, 0.0)], [])
    assert d.admit == 25  # ceil(0.25 × 100), not prime-rl's 0.1


def test_the_prime_rl_preset_keeps_its_rules():
    ctl = AdmissionController(cfg(preset="prime-rl", initial_cap=100, grow_turnover=0.0))
    d = ctl.step(0.0, [reading(0.0, 0.0, usage=0.85)], flight(100))
    assert d.cap == 82 and any("soft trim" in r for r in d.reasons)  # rule 6; the probe has no trims


_polls = st.tuples(
    st.floats(0.0, 1.0),  # kv usage
    st.integers(0, 40),  # running
    st.sampled_from([0, 0, 0, 1, 8]),  # waiting for capacity
    st.sampled_from([0, 0, 0, 1, 4, 9, 30, 100]),  # new preemptions (storms among them)
    st.floats(0.0, 5000.0),  # tokens generated since the last poll
    st.sampled_from([False] * 6 + [True]),  # reading is stale
    st.sampled_from([0, 0, 1, 3, 10]),  # rollouts that finish before the poll
)


@settings(max_examples=200, deadline=None)
@given(
    bounds=st.tuples(st.integers(1, 8), st.sampled_from([0, 4, 40, 200])),
    window=st.sampled_from([0.0, 5.0]),
    group=st.sampled_from([1, 4]),
    polls=st.lists(_polls, min_size=1, max_size=40),
)
def test_probe_cap_stays_in_bounds_and_nothing_is_admitted_during_a_storm(bounds, window, group, polls):
    lo, hi = bounds[0], bounds[0] + bounds[1]
    config = AdmissionConfig(
        preset="probe", min_inflight=lo, max_inflight=hi, max_model_len=1024, admit_window_s=window
    )
    ctl = AdmissionController(config, group_size=group)
    inflight: list[Inflight] = []
    preemptions = tokens = 0.0
    seen: float | None = None  # the preemption counter at the last fresh poll
    serial = 0
    for t, (usage, running, waiting, new_pre, produced, stale, finish) in enumerate(polls):
        now = 5.0 * t
        preemptions += new_pre
        tokens += produced
        at = now - (30.0 if stale else 0.0)
        r = reading(at, tokens, usage, running, waiting, preemptions)
        d = ctl.step(now, [r], inflight)
        assert lo <= d.cap <= hi
        assert d.cancel == []  # the probe never cancels
        assert 0 <= d.admit <= max(0, d.cap - len(inflight))
        new = preemptions - seen if seen is not None and not stale else 0.0
        storm = new >= config.storm_min_preemptions and new > config.storm_fraction * running
        seen = preemptions if not stale else seen
        assert d.storm == (storm and not config.fixed)
        if d.storm:
            assert d.admit == 0
        for _ in range(d.admit):
            inflight.append(Inflight(rollout_id=f"x{serial:05d}", admitted_at=now))
            serial += 1
        inflight = inflight[finish:]


def test_readings_carry_the_generation_token_counter_summed_and_zero_when_absent():
    from pathlib import Path

    from durable_rollouts.engines.metrics import parse_metrics

    sample = (Path(__file__).parents[1] / "data" / "vllm_metrics_sample.txt").read_text()
    assert parse_metrics(sample, url="u", engine_id="e", at=0.0).generation_tokens_total == 0.0
    counter = (
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 1200.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 34.0\n'
    )
    got = parse_metrics(sample + counter, url="u", engine_id="e", at=0.0)
    assert got.generation_tokens_total == 1234.0
