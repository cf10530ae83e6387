"""Rule O of the admission controller: the orchestration's own backlog (pure functions).

The engine rules (admission/controller.py) see only the engines' KV cache, so they keep admitting when the
bottleneck is the workers' workflow-task slots: every rollout then waits longer between its steps (more
policy lag for an async trainer) and nothing ends sooner. Rule O reads how long workflow tasks wait for a
slot (`QueueBacklog.wait_s`: the run's task queue backlog age and the run's own latest workflow tasks'
schedule-to-start, whichever is longer) and the accepted rate (rollouts that completed or were truncated,
per second, measured per cap), and vetoes what the engine rules decided:

- Start (opt-in, ``backlog_start_cap``): when the run's first poll reads the backlog (and ``initial_cap``
  is not set), the cap starts at most at ``backlog_start_cap`` (at least one group): what the
  orchestration sustains is not known until a rate is measured, and a cap taken from the KV cache alone (a
  small model's is huge) admits a burst that only waits. The engine rules then grow it while the backlog
  stays low, but only once the cap binds. Rollouts that end within a poll never make it bind, so it is
  off by default.
- The backlog is high when the wait exceeds ``backlog_wait_fraction`` of a rollout's mean lifetime (Little's
  law: mean rollouts in flight / accepted rollouts per second, at the current cap once measured) and
  ``backlog_min_wait_s``.
- A cap's accepted rate counts once it was held ``backlog_rate_polls`` polls and the rollouts in flight
  turned over once (as many ended as were in flight on average): before that, the rollouts that end are
  mostly ones a smaller cap admitted, and a growing cap would always look like a gain.
- The last increase, from the previous measured (smaller) cap to this one, paid if the accepted rate rose
  by more than max(``backlog_min_gain``, ``backlog_gain_share`` x the cap's relative growth): by Little's
  law a cap x2 whose rate rises only x1.2 makes every rollout live x1.67 longer, waiting on the
  orchestration (policy lag for an async trainer), for little more throughput. With no smaller cap
  measured there is nothing against growth.
- High backlog and the current cap not yet measured: hold (no growth until the rate is known).
- High backlog and the last increase did not pay: revert to the previous cap, which becomes a ceiling,
  lifted after ``reprobe_polls`` polls (then the engine rules probe the larger cap again); past a ceiling
  nothing grows, whatever the backlog. Nothing is cancelled: the excess finishes.
- High backlog and the increase paid: the engine rules decide (more rollouts do end sooner).
- A poll that read neither (no stats from the server, no history: ``QueueBacklog.seen`` False) leaves the
  rule inactive, said once.

Every reason it logs starts with ``orchestration-backlog``. Deterministic: state and arguments in, state
and result out; the workflow replays them.
"""

from __future__ import annotations

from durable_rollouts.config.models import AdmissionConfig
from durable_rollouts.contracts.types import AdmissionState, QueueBacklog

CAUSE = "orchestration-backlog"
"""How the dispatch log names this rule's decisions (every reason of it starts so)."""


def start(
    st: AdmissionState,
    cfg: AdmissionConfig,
    group_size: int,
    backlog: QueueBacklog | None,
    reasons: list[str],
) -> None:
    """The run's first cap (``st.cap``, from the engines) lowered to ``backlog_start_cap`` (at least one
    group) when the backlog is read and no ``initial_cap`` was configured."""
    assert st.cap is not None
    if cfg.initial_cap is not None or cfg.backlog_start_cap is None or backlog is None or not backlog.seen:
        return
    cap = min(st.cap, max(cfg.backlog_start_cap, group_size, cfg.min_inflight))
    if cap < st.cap:
        reasons.append(
            f"{CAUSE}: start at cap {cap} (engine rules: {st.cap}) until the orchestration's accepted rate"
            " is measured"
        )
        st.cap = cap


def measure(st: AdmissionState, now: float, n: int, ended: int) -> None:
    """Count this poll toward the running segment's accepted rate (``ended`` rollouts since the last poll,
    ``n`` in flight); the first poll starts a segment."""
    if st.accepted_since is None:
        st.accepted_since, st.accepted_cap = now, st.cap
        st.accepted_ended = st.accepted_polls = 0
        st.accepted_inflight = 0.0
        return
    st.accepted_ended += max(0, ended)
    st.accepted_polls += 1
    st.accepted_inflight += n


def rate(st: AdmissionState, cfg: AdmissionConfig, now: float) -> float | None:
    """The running segment's accepted rollouts/s, once measured: after ``backlog_rate_polls`` polls and one
    turnover (as many rollouts ended as were in flight on average), so that the rollouts that end are
    mostly ones this cap admitted (the rate lags the cap by about a rollout's lifetime)."""
    if st.accepted_since is None or st.accepted_polls < cfg.backlog_rate_polls or now <= st.accepted_since:
        return None
    if st.accepted_ended < st.accepted_inflight / st.accepted_polls:
        return None
    return st.accepted_ended / (now - st.accepted_since)


def restart(st: AdmissionState, cfg: AdmissionConfig, now: float) -> None:
    """The cap changed: a measured segment becomes the previous one; a new segment starts now."""
    r = rate(st, cfg, now)
    if r is not None and st.accepted_cap is not None:
        st.accepted_prev_rate, st.accepted_prev_cap = r, st.accepted_cap
    st.accepted_since, st.accepted_cap = now, st.cap
    st.accepted_ended = st.accepted_polls = 0
    st.accepted_inflight = 0.0


def threshold(st: AdmissionState, cfg: AdmissionConfig, now: float) -> float:
    """The wait above which the backlog is high: ``backlog_wait_fraction`` of a rollout's mean lifetime
    (Little's law over the running segment), at least ``backlog_min_wait_s``."""
    r = rate(st, cfg, now)
    if not r or st.accepted_polls <= 0:
        return cfg.backlog_min_wait_s
    lifetime = (st.accepted_inflight / st.accepted_polls) / r
    return max(cfg.backlog_min_wait_s, cfg.backlog_wait_fraction * lifetime)


def apply(
    st: AdmissionState,
    cfg: AdmissionConfig,
    now: float,
    cap_before: int,
    backlog: QueueBacklog | None,
    reasons: list[str],
) -> None:
    """Veto or revert the cap the engine rules left in ``st.cap`` (``cap_before`` was this poll's starting
    cap); appends the reasons, and starts a new rate segment when the cap changed. Lower only: it never
    raises the cap above the engine rules' verdict."""
    assert st.cap is not None
    kv_cap = st.cap
    lifted = (
        st.backlog_ceiling_at_poll is not None and st.polls - st.backlog_ceiling_at_poll >= cfg.reprobe_polls
    )
    if st.backlog_ceiling is not None and lifted:
        reasons.append(f"{CAUSE}: ceiling {st.backlog_ceiling} lifted")
        st.backlog_ceiling = st.backlog_ceiling_at_poll = None
    if backlog is not None and not backlog.seen:
        if not st.backlog_unread_said:
            reasons.append(f"{CAUSE}: task queue {backlog.task_queue} reports no backlog; rule inactive")
            st.backlog_unread_said = True
        backlog = None
    limit = threshold(st, cfg, now)
    if backlog is not None and backlog.wait_s > limit:
        _judge(st, cfg, now, cap_before, kv_cap, backlog, limit, reasons)
    if st.backlog_ceiling is not None and st.cap > max(cap_before, st.backlog_ceiling):
        reasons.append(
            f"{CAUSE}: cap held at {max(cap_before, st.backlog_ceiling)} by ceiling {st.backlog_ceiling}"
            f" (engine rules: {kv_cap})"
        )
        st.cap = max(cap_before, st.backlog_ceiling)
    if st.cap != cap_before:
        restart(st, cfg, now)


def _judge(
    st: AdmissionState,
    cfg: AdmissionConfig,
    now: float,
    cap_before: int,
    kv_cap: int,
    backlog: QueueBacklog,
    limit: float,
    reasons: list[str],
) -> None:
    """A high backlog: hold, revert or let the engine rules decide, as the accepted rate says."""
    assert st.cap is not None
    own = "" if backlog.latency_s is None else f", the run's own waited {backlog.latency_s:.1f} s"
    seen = (
        f"workflow tasks wait {backlog.wait_s:.1f} s > {limit:.1f} s (queue backlog {backlog.count},"
        f" age {backlog.age_s:.1f} s{own})"
    )
    r = rate(st, cfg, now)
    prev, prev_cap = st.accepted_prev_rate, st.accepted_prev_cap
    if r is None:
        if kv_cap > cap_before:
            reasons.append(
                f"{CAUSE}: hold cap {cap_before} (engine rules: {kv_cap}) until its accepted rate is"
                f" measured; {seen}"
            )
            st.cap = cap_before
        return
    if prev is None or prev_cap is None or prev_cap >= cap_before:
        return  # nothing against growth
    need = max(cfg.backlog_min_gain, cfg.backlog_gain_share * (cap_before / prev_cap - 1))
    if r > prev * (1 + need):
        return  # the last increase raised the accepted rate enough
    # the rate segment restarts at every cap change, so the one just measured is cap_before's
    rates = f"accepted {r:.2f}/s at cap {cap_before} vs {prev:.2f}/s at cap {prev_cap}, needed +{need:.0%}"
    reasons.append(
        f"{CAUSE}: revert cap {cap_before} -> {prev_cap} (engine rules: {kv_cap}); {rates}; {seen}"
    )
    st.cap = min(st.cap, prev_cap)
    if st.backlog_ceiling is None or st.backlog_ceiling > prev_cap:
        st.backlog_ceiling, st.backlog_ceiling_at_poll = prev_cap, st.polls
