"""The probe preset's ramp (rule P0) on metric traces 5 s apart, and the presets it must leave unchanged.

The ramp doubles the cap every binding poll while the fleet's mean KV usage is low and nothing preempts or
queues; the last tests replay seeded random traces through the ``prime-rl`` preset and fixed mode and compare
them with digests recorded from the controller before the ramp existed (commit 488043d), decision by
decision: old workflow histories must replay with them unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_rollouts.admission.controller import (
    AdmissionConfig,
    AdmissionController,
    Decision,
    EngineReading,
    Inflight,
)
from durable_rollouts.contracts.types import AdmissionState
from tests.unit.admission.test_controller_probe import cfg, flight
from tests.unit.admission.test_controller_probe import reading as probe_reading

DEFAULTS = AdmissionConfig()
NEAR_STORM = DEFAULTS.near_storm_fraction
RAMP_ADMIT_WINDOW_FRACTION = DEFAULTS.ramp_admit_window_fraction
RAMP_BELOW_USAGE = DEFAULTS.ramp_below_usage
RAMP_FACTOR = DEFAULTS.ramp_factor


def reading(at, usage=0.1, running=10, waiting=0, preemptions=0.0, tokens=0.0, engine="e0") -> EngineReading:
    """test_admission_probe's reading, at a usage below the ramp's threshold and tokens as a keyword."""
    return probe_reading(
        at, tokens, usage=usage, running=running, waiting=waiting, preemptions=preemptions, engine=engine
    )


class Trace:
    """One engine's polls 5 s apart, with the cap in flight unless told (the cap binds)."""

    def __init__(self, ctl: AdmissionController) -> None:
        self.ctl, self.t, self.preemptions = ctl, 0.0, 0.0

    def poll(self, n: int | None = None, new_preemptions: float = 0, **kw) -> Decision:
        self.preemptions += new_preemptions
        cap = self.ctl.state.cap or 10
        r = reading(self.t, preemptions=self.preemptions, tokens=100.0 * self.t, **kw)
        d = self.ctl.step(self.t, [r], flight(cap if n is None else n))
        self.t += 5.0
        return d


def test_a_ramp_poll_doubles_the_cap_at_once_every_poll():
    tr = Trace(AdmissionController(cfg()))
    caps = [tr.poll().cap for _ in range(4)]
    assert caps == [20, 40, 80, 160]  # the first poll too: 10 in flight bind at the initial cap 10
    d = tr.poll()
    assert d.cap == 320 and any("ramp" in r and "cap 160 -> 320" in r for r in d.reasons)
    assert tr.ctl.state.epoch_start_at is None  # no epoch is measured during the ramp


def test_with_the_ramp_and_the_hold_off_the_probe_grows_by_epochs_as_before():
    """What RunWorkflow runs for histories from before PROBE_RAMP_PATCH: no ramp poll, no near-storm hold."""
    off = Trace(AdmissionController(cfg(ramp_below_usage=0.0, near_storm_fraction=1.0)))
    assert [off.poll().cap for _ in range(3)] == [10, 10, 20]  # P4: one epoch, x fast_factor
    # 6 preemptions on 10 running at the epoch's end: over half a storm (storm_min 8, fraction 1)
    for near_storm, cap in ((1.0, 20), (0.5, 10)):  # off: the probe grows; on: P4 holds
        tr = Trace(AdmissionController(cfg(ramp_below_usage=0.0, near_storm_fraction=near_storm)))
        assert [tr.poll(new_preemptions=p).cap for p in (0, 0, 6)] == [10, 10, cap]


def test_the_ramp_stops_at_the_usage_threshold_and_the_epoch_paced_probe_takes_over():
    below = Trace(AdmissionController(cfg()))
    assert below.poll(usage=RAMP_BELOW_USAGE - 0.01).cap == 20
    at = Trace(AdmissionController(cfg()))
    assert [at.poll(usage=RAMP_BELOW_USAGE).cap for _ in range(3)] == [10, 10, 20]  # P4: one epoch, × 2


def test_the_ramp_reads_the_mean_usage_not_the_worst_engine():
    ctl = AdmissionController(cfg())
    d = ctl.step(0.0, [reading(0.0, usage=0.4), reading(0.0, usage=0.0, engine="e1")], flight(10))
    assert d.cap == 20  # mean 0.2 although e0 is at 0.4
    ctl = AdmissionController(cfg())
    d = ctl.step(0.0, [reading(0.0, usage=0.4), reading(0.0, usage=0.2, engine="e1")], flight(10))
    assert d.cap == 10  # mean 0.3


def test_any_preemption_pauses_the_ramp_for_that_poll():
    tr = Trace(AdmissionController(cfg()))
    assert tr.poll().cap == 20  # the first value of the counter only sets the baseline
    d = tr.poll(new_preemptions=1)  # one preemption: far from a storm, but the cache is not roomy
    assert d.cap == 20 and not d.storm and not any("ramp" in r for r in d.reasons)
    assert tr.poll().cap == 40  # none since the previous poll: the ramp resumes


def test_a_queued_poll_pauses_the_ramp_and_a_single_waiting_request_does_not():
    tr = Trace(AdmissionController(cfg()))
    assert tr.poll(waiting=6, running=10).cap == 10  # 6 > queue_ratio 0.5 × 10 running: a queued poll
    tr = Trace(AdmissionController(cfg()))
    assert tr.poll(waiting=1, running=10).cap == 20  # a request waiting between two steps is no queue


def test_the_ramp_needs_fresh_readings_and_a_binding_cap():
    ctl = AdmissionController(cfg())
    stale = reading(-30.0, engine="e1")  # older than metrics_max_age_s
    assert ctl.step(0.0, [reading(0.0), stale], flight(10)).cap == 10
    tr = Trace(AdmissionController(cfg(initial_cap=40)))
    for _ in range(4):
        assert tr.poll(n=20).cap == 40  # 20 + a group of 1 < 0.9 × 40: a bigger cap would change nothing


def test_rollouts_that_ended_since_the_previous_poll_count_toward_a_binding_cap():
    # rollouts shorter than a poll: of the 10 the cap let in, 8 ended before this poll. All 10 were in
    # flight together after the previous poll, so the cap bound them, and a ramp poll grows it
    def cap_after(n: int, ended: int) -> int:
        ctl = AdmissionController(cfg())
        return ctl.step(0.0, [reading(0.0)], flight(n), ended, ended * 20.0).cap

    assert cap_after(2, 8) == 20
    assert cap_after(2, 0) == 10  # 2 in flight, none ended: a larger cap would change nothing
    assert cap_after(2, 5) == 10  # 2 + 5 + a group of 1 < 0.9 x 10: demand, not the cap, is the limit


def test_the_ramp_never_grows_past_max_inflight_or_a_ceiling():
    tr = Trace(AdmissionController(cfg(max_inflight=30)))
    assert [tr.poll().cap for _ in range(4)] == [20, 30, 30, 30]
    tr = Trace(AdmissionController(cfg(initial_cap=40)))
    tr.poll(n=40, usage=0.9)  # baselines
    d = tr.poll(n=40, new_preemptions=50, running=10, usage=0.9)  # a storm: cut to 0.8 × 40, a ceiling
    assert d.storm and d.admit == 0 and d.cap == 32 and tr.ctl.state.ceiling == 32
    d = tr.poll(n=30)  # drained; usage low again, nothing preempts: a ramp poll, but the ceiling holds
    assert d.cap == 32 and "drained" in d.reasons
    assert tr.poll(n=32).cap == 32


def test_a_ramp_poll_admits_by_the_ramp_window_fraction():
    ramp = AdmissionController(cfg(admit_window_s=5.0, initial_cap=100), group_size=4)
    assert ramp.step(0.0, [reading(0.0, usage=0.1)], []).admit == math.ceil(RAMP_ADMIT_WINDOW_FRACTION * 100)
    probe = AdmissionController(cfg(admit_window_s=5.0, initial_cap=100), group_size=4)
    assert probe.step(0.0, [reading(0.0, usage=0.3)], []).admit == 25  # not a ramp poll: 0.25 × 100
    # the window is shared: a ramp poll in the same window tops it up to the ramp's allowance only
    ctl = AdmissionController(cfg(admit_window_s=5.0, initial_cap=100), group_size=4)
    inflight = [Inflight(rollout_id=f"x{i:03d}", admitted_at=0.0) for i in range(25)]
    assert ctl.step(0.0, [reading(0.0, usage=0.3)], []).admit == 25
    assert ctl.step(2.0, [reading(2.0, usage=0.1)], inflight).admit == 25


_polls = st.tuples(
    st.lists(st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.24, 0.3, 0.6, 0.95]), min_size=2, max_size=2),  # usage
    st.integers(0, 40),  # running (each engine)
    st.sampled_from([0, 0, 0, 1, 30]),  # waiting for capacity (engine e0)
    st.sampled_from([0, 0, 0, 0, 1, 9, 100]),  # new preemptions (engine e1; storms among them)
    st.sampled_from([False] * 8 + [True]),  # e1's reading is stale
    st.sampled_from([0, 0, 1, 5, 50]),  # rollouts that finish before the poll
)


@settings(max_examples=200, deadline=None)
@given(
    bounds=st.tuples(st.integers(1, 8), st.sampled_from([0, 4, 40, 200, 900])),
    window=st.sampled_from([0.0, 5.0]),
    group=st.sampled_from([1, 4, 8]),
    polls=st.lists(_polls, min_size=1, max_size=40),
    footprint=st.sampled_from([20, 400, 4000]),  # every ended rollout's final context (rule P5)
)
def test_ramp_traces_keep_the_cap_in_bounds_admit_nothing_in_a_storm_and_grow_only_when_allowed(
    bounds, window, group, polls, footprint
):
    lo, hi = bounds[0], bounds[0] + bounds[1]
    config = AdmissionConfig(
        preset="probe", min_inflight=lo, max_inflight=hi, max_model_len=1024, admit_window_s=window
    )
    ctl = AdmissionController(config, group_size=group)
    inflight: list[Inflight] = []
    preemptions, seen, serial, cap, ended = 0.0, None, 0, None, 0
    share: float | None = None
    polled = 0
    for t, (usage, running, waiting, new_pre, stale, finish) in enumerate(polls):
        now = 5.0 * t
        preemptions += new_pre
        e0 = reading(now, usage[0], running, waiting, 0.0, 100.0 * t)
        e1 = reading(now - (30.0 if stale else 0.0), usage[1], running, 0, preemptions, 100.0 * t, "e1")
        gone, n = min(finish, len(inflight)), len(inflight)
        healthy = [e0] if stale else [e0, e1]
        engaged = sum(r.running + r.waiting_capacity for r in healthy)
        if n and engaged:  # the mean share in an engine, as P5 averages it
            w, now_share = max(1.0 / config.share_polls, 1.0 / (polled + 1)), min(1.0, engaged / n)
            share = now_share if share is None else (1 - w) * share + w * now_share
            polled += 1
        d = ctl.step(now, [e0, e1], inflight, gone, gone * footprint)
        ended += gone
        assert lo <= d.cap <= hi
        assert d.cancel == []  # the probe never cancels
        assert 0 <= d.admit <= max(0, d.cap - len(inflight))
        new = preemptions - seen if seen is not None and not stale else 0.0
        seen = preemptions if not stale else seen
        storm = new >= config.storm_min_preemptions and new > config.storm_fraction * running
        assert d.storm == (storm and not config.fixed)
        if d.storm:
            assert d.admit == 0
        if window:
            assert d.admit <= max(group, math.ceil(max(RAMP_ADMIT_WINDOW_FRACTION, 0.25) * d.cap))
        if any(r.startswith("ramp at") for r in d.reasons):
            healthy_usage = [usage[0]] if stale else usage
            # fresh, nothing preempted, and the fleet-wide queue (e0's waiting over both engines' running)
            assert not stale and new == 0 and waiting <= config.queue_ratio * 2 * running
            assert sum(healthy_usage) / len(healthy_usage) < RAMP_BELOW_USAGE
            before = cap if cap is not None else d.cap
            assert d.cap <= max(before + 1, math.floor(before * RAMP_FACTOR))
            # P5: no further than the rollouts' mean share in an engine fits at the predicted footprint
            # (the one footprint once a rollout ended, else max_model_len)
            f = (share if share is not None else 1.0) * (footprint if ended else 1024.0)
            assert d.cap <= max(before, math.floor(sum(r.kv_capacity_tokens for r in healthy) / f))
        if any(r.startswith("probe at") for r in d.reasons):  # P4 grew: not near a storm (e0 never preempts)
            assert not (new >= NEAR_STORM * config.storm_min_preemptions and new > NEAR_STORM * running)
        cap = d.cap
        for _ in range(d.admit):
            inflight.append(Inflight(rollout_id=f"x{serial:05d}", admitted_at=now))
            serial += 1
        inflight = inflight[gone:]


def _replay(config: AdmissionConfig, seed: int, polls: int = 300, engines: int = 3, group: int = 4) -> str:
    """A seeded random trace (restarts, stale readings, preemptions, queues, finishing rollouts) through the
    controller, with ended rollouts' footprints (rule P5) that only the probe preset may use; the digest of
    every decision and of the final state (less rule P5's estimate, which must stay empty: asserted)."""
    rng, ends = random.Random(seed), random.Random(-1 - seed)
    ctl = AdmissionController(config, group_size=group)
    pre, tok = [0.0] * engines, [0.0] * engines
    live: list[Inflight] = []
    serial, out = 0, []
    for t in range(polls):
        now = 5.0 * t
        rs = []
        for e in range(engines):
            if rng.random() < 0.02:
                pre[e] = tok[e] = 0.0  # a restart
            pre[e] += rng.choice([0, 0, 0, 0, 1, 3, 9, 20])
            tok[e] += rng.uniform(0, 4000)
            stale = rng.random() < 0.05
            rs.append(
                EngineReading(
                    engine_id=f"e{e}",
                    at=now - (30.0 if stale else 0.0),
                    kv_usage=rng.random(),
                    running=rng.randint(0, 30),
                    waiting_capacity=rng.choice([0, 0, 0, 1, 5, 20]),
                    preemptions_total=pre[e],
                    kv_capacity_tokens=rng.choice([65536, 131072]),
                    generation_tokens_total=tok[e],
                )
            )
        ended = ends.randint(0, 6)  # its own stream: the trace is the one the digests were recorded on
        d = ctl.step(now, rs, live, ended, ended * ends.uniform(100, 3000))
        out.append([d.cap, d.admit, d.cancel, d.wasted_tokens, d.reasons, d.storm, d.kv_usage, d.healthy])
        gone = set(d.cancel)
        live = [i for i in live if i.rollout_id not in gone]
        for _ in range(d.admit):
            live.append(Inflight(rollout_id=f"x{serial:05d}", admitted_at=now, tokens=rng.randint(0, 5000)))
            serial += 1
        finish = rng.randint(0, max(0, len(live) // 4))
        rng.shuffle(live)
        live = sorted(live[finish:], key=lambda i: i.rollout_id)
    state = ctl.state.model_dump(mode="json")
    if config.fixed or config.preset == "prime-rl":
        p5 = ("footprint", "footprint_rollouts", "engaged_share", "engaged_polls")
        assert [state.pop(k) for k in p5] == [None, 0, None, 0]
    # rule O's bookkeeping (accepted rollouts/s per cap) runs in both presets; with no backlog passed it
    # has no say, which the decisions above (in the digest) show; fixed mode keeps none
    rule_o = {k: state.pop(k) for k in list(state) if k.startswith(("accepted_", "backlog_"))}
    if config.fixed:
        assert rule_o == {k: v for k, v in AdmissionState().model_dump(mode="json").items() if k in rule_o}
    out.append(state)
    return hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()


_BEFORE_THE_RAMP = {
    ("prime-rl", 0): "c494fab056f40b4c3511e76b4b3843bf767af9110255f4e7842afdac10efd1a2",
    ("prime-rl", 1): "2735d386f64d61e27093b921302b837b048a52b4d545357c2982e9079b12e8e9",
    ("prime-rl-paced", 0): "09b5a114471bacc39a4f33173c79903d3c92ff775aae2982737ebdb009c83283",
    ("prime-rl-paced", 1): "5ddc62393687bff06ec6d6c5d1dcc4d3b4ecc3b768893c3a3683f20ac25a2d19",
    ("fixed", 0): "a58751f136f2617c47aa490e453680c2c48e8718c6a89d83315e10cbb4184a6e",
    ("fixed", 1): "e99fe7a86f31f79ae3e31524a1613c264bf454bc6e911a788c3afdeb680fe33d",
}
"""`_replay`'s digests from workflows/admission.py at commit 488043d (before rule P0)."""

_CONFIGS = {
    "prime-rl": {"preset": "prime-rl", "max_model_len": 4096},
    "prime-rl-paced": {
        "preset": "prime-rl",
        "max_model_len": 4096,
        "min_inflight": 4,
        "max_inflight": 300,
        "grow_turnover": 0.5,
    },
    "fixed": {"min_inflight": 40, "max_inflight": 40},  # the probe preset's fixed mode
}


@pytest.mark.parametrize(("name", "seed"), sorted(_BEFORE_THE_RAMP))
def test_the_prime_rl_preset_and_fixed_mode_decide_exactly_as_before_the_ramp(name, seed):
    assert _replay(AdmissionConfig(**_CONFIGS[name]), seed) == _BEFORE_THE_RAMP[name, seed]
