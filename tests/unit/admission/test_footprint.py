"""The probe preset's footprint prediction (rule P5) on metric traces 5 s apart.

Blind growth (the ramp, P0, and the fast factor of P4) judges the cache by its usage now, but rollouts
admitted now fill it turns later. P5 predicts every rollout's final KV footprint from the rollouts that
ended (before one has, from ``max_model_len``) and stops blind growth at the cap at which all of them, at
that footprint, would fill ``predicted_fill`` of the cache; past it the cap grows by ``probe_factor`` per
epoch.

One engine of 409,600 KV tokens, ``max_model_len`` 4096: before any rollout ended the predicted fit is 100.
"""

from __future__ import annotations

import math

from durable_rollouts.admission.controller import AdmissionController, Decision
from tests.unit.admission.test_controller_probe import cfg, flight
from tests.unit.admission.test_controller_ramp import reading


class Trace:
    """Polls 5 s apart with the cap in flight (it binds); ``ended`` rollouts of ``footprint`` tokens each
    ended before the poll; a ``share`` of those in flight are in the engine (default all of them)."""

    def __init__(self, **config: object) -> None:
        self.ctl = AdmissionController(cfg(**({"predicted_fill": 1.0, "max_model_len": 4096} | config)))
        self.t = 0.0

    def poll(self, ended: int = 0, footprint: float = 0, share: float = 1.0) -> Decision:
        n = self.ctl.state.cap or self.ctl.config.initial_cap or 10
        r = reading(self.t, usage=0.1, running=round(share * n), tokens=1000.0 * self.t)
        d = self.ctl.step(self.t, [r], flight(n), ended, ended * footprint)
        self.t += 5.0
        return d


def test_before_any_rollout_ended_the_ramp_stops_at_the_cap_where_full_length_rollouts_fill_the_cache():
    tr = Trace()
    assert [tr.poll().cap for _ in range(4)] == [20, 40, 80, 100]  # 409,600 / 4096 = 100
    d = tr.poll()
    assert d.cap == 100
    assert "ramp held at cap 100: predicted fit 100 at 4096 tokens per rollout" in d.reasons


def test_rollouts_that_ended_short_let_the_ramp_go_on_to_the_fit_of_their_footprint():
    tr = Trace(initial_cap=100)
    d = tr.poll(ended=10, footprint=1000.0)
    assert d.cap == 200 and any(r.startswith("ramp at") for r in d.reasons)
    assert [tr.poll().cap for _ in range(3)] == [400, 409, 409]  # 409,600 / 1000


def test_rollouts_waiting_for_a_tool_hold_no_kv_so_the_fit_counts_only_the_share_in_an_engine():
    tr = Trace(initial_cap=100)
    assert [tr.poll(share=0.5).cap for _ in range(3)] == [200, 200, 200]  # half in an engine: fit 200
    tr = Trace(initial_cap=100)
    assert [tr.poll(share=0.25).cap for _ in range(3)] == [200, 400, 400]  # a quarter: fit 400


def test_past_the_fit_even_a_cache_at_low_usage_grows_by_the_probe_factor_only():
    tr = Trace(initial_cap=100, ramp_below_usage=0.0)  # no ramp: the epochs of P2-P4 alone
    caps, reasons = [], []
    for _ in range(12):
        d = tr.poll(ended=5, footprint=2048.0)  # fit 200
        caps.append(d.cap)
        reasons += d.reasons
    grown = sorted(set(caps))
    assert grown[:3] == [100, 200, 240], grown  # x2 to the fit, then x1.2 (probe_factor) at usage 0.1
    assert any("fast growth held: predicted fit 200 at 2048 tokens per rollout" in r for r in reasons)


def test_without_prediction_the_same_trace_grows_by_the_fast_factor():
    tr = Trace(initial_cap=100, ramp_below_usage=0.0, predicted_fill=0.0)
    caps = sorted({tr.poll(ended=5, footprint=2048.0).cap for _ in range(12)})
    assert caps[:3] == [100, 200, 400], caps


def test_the_estimate_is_the_mean_of_the_first_rollouts_then_follows_lengths_that_drift():
    ctl = AdmissionController(cfg(predicted_fill=1.0, footprint_weight=0.05), group_size=1)
    lengths = [100.0 * (1 + i % 7) for i in range(20)]
    for i, n in enumerate(lengths):
        ctl.step(5.0 * i, [reading(5.0 * i)], flight(10), 1, n)
    assert ctl.state.footprint_rollouts == 20
    assert math.isclose(ctl.state.footprint or 0.0, sum(lengths) / 20)  # a plain mean over 1 / 0.05
    for i in range(20, 120):  # the lengths drift up to 3000 tokens
        ctl.step(5.0 * i, [reading(5.0 * i)], flight(10), 1, 3000.0)
    assert abs((ctl.state.footprint or 0.0) - 3000.0) < 30.0  # a cumulative mean would say ~2550
    ctl.step(600.0, [reading(600.0)], flight(10), 50, 50 * 1000.0)  # a batch weighs as its rollouts would
    assert abs((ctl.state.footprint or 0.0) - (1000.0 + 2000.0 * 0.95**50)) < 30.0
