"""Rule P5 of the admission controller's probe preset: predicted KV footprints (pure functions).

Blind growth (the ramp, P0, and ``fast_factor`` in P4; admission/controller.py) judges the cache by its usage
now, but rollouts admitted now fill it turns later. These functions keep, in the controller's
`AdmissionState`, the mean final footprint of the rollouts that ended and the mean share of the rollouts in
flight that an engine holds, and turn them into the cap at which blind growth stops. Deterministic: state
and arguments in, state and result out; the workflow replays them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from durable_rollouts.config.models import AdmissionConfig
from durable_rollouts.contracts.types import AdmissionState, EngineReading

Fit = tuple[int, float]
"""The predicted fit: the cap at which blind growth stops, and the footprint (tokens per rollout) it uses."""


def learn_footprint(st: AdmissionState, cfg: AdmissionConfig, ended: int, tokens: float) -> None:
    """The footprint estimate: a mean over the first 1 / ``footprint_weight`` ended rollouts, then an
    exponential moving average with that weight per rollout (``ended`` of them, ``tokens`` in all)."""
    if ended <= 0:
        return
    mean = max(0.0, tokens) / ended
    kept = (1.0 - cfg.footprint_weight) ** ended
    w = max(1.0 - kept, ended / (st.footprint_rollouts + ended))
    st.footprint = mean if st.footprint is None else (1.0 - w) * st.footprint + w * mean
    st.footprint_rollouts += ended


def learn_share(
    st: AdmissionState, cfg: AdmissionConfig, healthy: Mapping[str, EngineReading], n: int
) -> None:
    """The share of the ``n`` rollouts in flight that hold KV: the healthy engines' running and
    capacity-waiting requests over ``n`` (at most 1), averaged as ``share_polls`` says. A poll with nothing
    in flight or nothing in an engine says nothing (rollouts just admitted may not have reached one yet:
    counted, they would let the ramp flood the cache)."""
    engaged = sum(r.running + r.waiting_capacity for r in healthy.values())
    if n <= 0 or engaged <= 0:
        return
    share = min(1.0, engaged / n)
    w = max(1.0 / cfg.share_polls, 1.0 / (st.engaged_polls + 1))
    st.engaged_share = share if st.engaged_share is None else (1.0 - w) * st.engaged_share + w * share
    st.engaged_polls += 1


def fit(st: AdmissionState, cfg: AdmissionConfig, healthy: Mapping[str, EngineReading]) -> Fit | None:
    """The cap at which the rollouts, each at the predicted final footprint, would fill ``predicted_fill`` of
    the healthy engines' KV cache, and that footprint; None when ``predicted_fill`` is 0 (P5 off). The
    footprint is the estimate from ended rollouts (``max_model_len`` before one ended). Of the rollouts in
    flight only those in an engine hold KV; the rest wait for a tool. Their mean share (1 before a poll
    measured it) is kept: cap x share x footprint <= fill x capacity."""
    if cfg.predicted_fill <= 0:
        return None
    footprint = st.footprint if st.footprint is not None else float(cfg.max_model_len)
    capacity = sum(r.kv_capacity_tokens for r in healthy.values())
    share = st.engaged_share if st.engaged_share is not None else 1.0
    return math.floor(cfg.predicted_fill * capacity / max(1.0, share * footprint)), footprint


def describe(f: Fit) -> str:
    """The fit as the dispatch log's reasons name it."""
    return f"predicted fit {f[0]} at {f[1]:.0f} tokens per rollout"
