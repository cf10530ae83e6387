"""The circuit breaker of a run: repeated infrastructure failures of one kind pause admission; repeated
environment failures stop the run.

A pure state machine (no clock, no I/O: time arrives with each call), carried in the run's state.

Rules:
- Every closed group reports its members' infra failures by error type (``GroupResult.infra_failures``),
  its environment failures (``environment_failures``) and how many members succeeded (completed or
  truncated with a reward).
- A group with a success resets every streak (and closes an open breaker: the probe worked). Otherwise each
  error type's streak grows by its failures; one reaching ``threshold`` opens the breaker.
- While open, nothing is admitted, except one probe group once ``probe_after_s`` have passed since it
  opened (or since the last failed probe). The probe's result closes it (a success) or re-opens it.
- ``threshold`` None disables the breaker (the environment rule still applies).
- Environment failures (an exception in the environment's code: the fault is the environment's, not the
  fleet's, so waiting does not help) grow one streak; reaching ``env_threshold`` stops the run for good
  (``stopped``, one line; never cleared, not even by a later success of a group still in flight).
  ``env_threshold`` None disables the rule.
"""

from __future__ import annotations

from durable_rollouts.contracts.types import BreakerState


def record(
    state: BreakerState,
    group_id: str,
    infra_failures: dict[str, int],
    successes: int,
    now: float,
    threshold: int | None,
    environment_failures: int = 0,
    env_threshold: int | None = None,
    environment_failure: str | None = None,
) -> BreakerState:
    """The state after a group closed."""
    s = state.model_copy(deep=True)
    if env_threshold is not None and s.stopped is None:
        s.env_streak = 0 if successes > 0 else s.env_streak + environment_failures
        if s.env_streak >= env_threshold:
            last = f" (last: {environment_failure})" if environment_failure else ""
            s.stopped = f"{s.env_streak} consecutive environment failures{last}"[:300]
    if threshold is None:
        return s
    if group_id == s.probe:
        s.probe = None
    if successes > 0:  # a success closes it and resets every streak
        return BreakerState(opened=s.opened, env_streak=s.env_streak, stopped=s.stopped)
    for kind, n in infra_failures.items():
        s.streaks[kind] = s.streaks.get(kind, 0) + n
    tripped = sorted(k for k, n in s.streaks.items() if n >= threshold)
    if tripped:
        if s.open_since is None:
            s.opened += 1
        s.open_since = now  # opened now, or the probe failed: wait again before the next probe
        s.reason = f"{s.streaks[tripped[0]]} consecutive infra failures of {tripped[0]}"
    return s


def may_admit(state: BreakerState, now: float, probe_after_s: float) -> bool:
    """Whether a group may start now (not stopped; closed, or open, no probe in flight and the wait over)."""
    if state.stopped is not None:
        return False
    if state.open_since is None:
        return True
    return state.probe is None and now - state.open_since >= probe_after_s


def admitted(state: BreakerState, group_id: str) -> BreakerState:
    """The state after a group started: while open, it is the probe."""
    if state.open_since is None:
        return state
    return state.model_copy(update={"probe": group_id})


def describe(state: BreakerState, probe_after_s: float) -> str | None:
    """One line for `rollouts status`, or None when closed."""
    if state.open_since is None:
        return None
    probe = (
        f"probe {state.probe} in flight" if state.probe else f"next probe {probe_after_s:.0f}s after opening"
    )
    return f"open: {state.reason}; {probe}"
