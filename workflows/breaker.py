"""The circuit breaker of a run: repeated infrastructure failures of one kind pause admission.

A pure state machine (no clock, no I/O: time arrives with each call), carried in the run's state.

Rules:
- Every closed group reports its members' infra failures by error type (``GroupResult.infra_failures``)
  and how many members succeeded (completed or truncated with a reward).
- A group with a success resets every streak (and closes an open breaker: the probe worked). Otherwise each
  error type's streak grows by its failures; one reaching ``threshold`` opens the breaker.
- While open, nothing is admitted, except one probe group once ``probe_after_s`` have passed since it
  opened (or since the last failed probe). The probe's result closes it (a success) or re-opens it.
- ``threshold`` None disables the breaker.
"""

from __future__ import annotations

from contracts.types import BreakerState


def record(state: BreakerState, group_id: str, infra_failures: dict[str, int], successes: int, now: float,
           threshold: int | None) -> BreakerState:  # fmt: skip
    """The state after a group closed."""
    if threshold is None:
        return state
    s = state.model_copy(deep=True)
    if group_id == s.probe:
        s.probe = None
    if successes > 0:
        return BreakerState(opened=s.opened)  # a success closes it and resets every streak
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
    """Whether a group may start now (closed; or open, no probe in flight and the wait is over)."""
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
