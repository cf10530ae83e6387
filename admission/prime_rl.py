"""Rules 3-8 of the admission controller: the ``prime-rl`` preset (the prime-rl orchestrator's rules and
constants; admission/controller.py's docstring states them). Pure functions of the config and the
controller's state, which they update; the controller calls :func:`adapt` once per poll when its preset is
``prime-rl``."""

from __future__ import annotations

import math

from durable_rollouts.config.models import AdmissionConfig
from durable_rollouts.contracts.types import AdmissionState, EngineReading


def adapt(
    cfg: AdmissionConfig,
    st: AdmissionState,
    healthy: dict[str, EngineReading],
    n: int,
    reasons: list[str],
    *,
    all_fresh: bool,
) -> int:
    """Rules 3-8 on ``st`` (the cap in it); returns how many of the ``n`` rollouts in flight to cancel
    (the youngest: the caller picks them)."""
    assert st.cap is not None
    if st.draining and n <= st.cap:
        st.draining, st.drained_at_poll = False, st.polls
        reasons.append("drained")
    cut = _cut(cfg, st, healthy, n, reasons)
    usage = max(r.kv_usage for r in healthy.values())
    trimmed = usage > cfg.soft_trim_usage
    if trimmed:
        target = cfg.clamp(math.floor(n * cfg.trim_target_usage / usage))
        hard = usage > cfg.hard_trim_usage
        reasons.append(f"{'hard' if hard else 'soft'} trim at usage {usage:.3f}: cap {st.cap} -> {target}")
        st.cap = min(st.cap, target)
        if hard:
            return n - st.cap
    elif not cut and all_fresh and not st.draining:
        _maybe_grow(cfg, st, healthy, n, reasons)
    return 0


def _cut(
    cfg: AdmissionConfig, st: AdmissionState, healthy: dict[str, EngineReading], n: int, reasons: list[str]
) -> bool:
    """Rules 3-5: update counters and apply an overload cut; True when one was applied."""
    assert st.cap is not None
    preempted = []
    for e, r in sorted(healthy.items()):
        last = st.preemptions.get(e)
        if last is not None and r.preemptions_total > last:
            preempted.append(e)
        st.preemptions[e] = r.preemptions_total
    queued = any(r.waiting_capacity > cfg.queue_ratio * r.running for r in healthy.values())
    st.queue_streak = st.queue_streak + 1 if queued and not st.draining else 0
    persistent = st.queue_streak >= cfg.queue_polls
    if not (preempted or persistent):
        return False
    what = (
        f"preemption on {','.join(preempted)}" if preempted else f"capacity queue for {cfg.queue_polls} polls"
    )
    if st.draining:
        reasons.append(f"{what} during drain: ignored")
        return False
    factor = cfg.preemption_cut if preempted else cfg.queue_cut
    if st.drained_at_poll is not None and st.polls - st.drained_at_poll <= cfg.repeat_window_polls:
        factor, what = cfg.repeat_cut, f"repeat {what}"
    target = min(st.cap, cfg.clamp(math.floor(factor * n)))
    reasons.append(f"{what}: cap {st.cap} -> {target}")
    st.cap, st.queue_streak = target, 0
    st.draining = n > target
    if not st.draining:
        st.drained_at_poll = st.polls
    return True


def _maybe_grow(
    cfg: AdmissionConfig, st: AdmissionState, healthy: dict[str, EngineReading], n: int, reasons: list[str]
) -> None:
    """Rule 8."""
    assert st.cap is not None
    headroom = all(r.kv_usage < cfg.grow_below_usage for r in healthy.values())
    nothing_waits = all(r.waiting_capacity == 0 for r in healthy.values())
    binds = n >= cfg.grow_when_inflight_fraction * st.cap
    turned_over = st.admitted_since_change >= cfg.grow_turnover * st.cap
    if headroom and nothing_waits and binds and turned_over and st.cap < cfg.max_inflight:
        target = cfg.clamp(max(st.cap + 1, math.floor(st.cap * cfg.grow_factor)))
        reasons.append(f"grow: cap {st.cap} -> {target}")
        st.cap = target
