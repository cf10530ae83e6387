"""The circuit breaker's rules (admission/breaker.py), on recorded sequences of closed groups."""

from __future__ import annotations

from durable_rollouts.admission import breaker
from durable_rollouts.contracts.types import BreakerState


def test_consecutive_failures_of_one_kind_open_it_and_a_success_closes_it() -> None:
    s = BreakerState()
    s = breaker.record(s, "g0", {"SandboxNotReady": 2}, 0, now=10.0, threshold=3)
    assert s.open_since is None and breaker.may_admit(s, 10.0, 60.0)
    s = breaker.record(s, "g1", {"SandboxNotReady": 1, "EngineUnavailable": 1}, 0, now=20.0, threshold=3)
    assert (
        s.open_since == 20.0
        and s.opened == 1
        and "3 consecutive infra failures of SandboxNotReady" in s.reason
    )
    assert not breaker.may_admit(s, 79.0, 60.0) and breaker.may_admit(s, 80.0, 60.0)
    s = breaker.admitted(s, "g2")
    assert s.probe == "g2" and not breaker.may_admit(s, 500.0, 60.0)  # one probe at a time
    assert "probe g2 in flight" in (breaker.describe(s, 60.0) or "")
    failed = breaker.record(s, "g2", {"SandboxNotReady": 2}, 0, now=90.0, threshold=3)
    assert failed.open_since == 90.0 and failed.probe is None and failed.opened == 1  # waits again
    ok = breaker.record(s, "g2", {}, 2, now=90.0, threshold=3)
    assert ok == BreakerState(opened=1) and breaker.describe(ok, 60.0) is None


def test_other_kinds_and_successes_in_between_do_not_trip_it() -> None:
    s = BreakerState()
    for i in range(10):
        s = breaker.record(s, f"g{i}", {"EngineUnavailable": 2}, 1, now=float(i), threshold=3)
    assert s.open_since is None and s.streaks == {}
    s = breaker.record(s, "a", {"X": 2}, 0, 1.0, 3)
    s = breaker.record(s, "b", {"Y": 2}, 0, 2.0, 3)
    assert s.open_since is None and s.streaks == {"X": 2, "Y": 2}


def test_disabled_it_never_opens() -> None:
    s = breaker.record(BreakerState(), "g0", {"X": 100}, 0, now=1.0, threshold=None)
    assert s == BreakerState() and breaker.admitted(s, "g1") == s


def test_environment_failures_are_not_infra_failures_and_never_trip_it() -> None:
    """A buggy environment (every member failing in its own code) does not look like a flaky cluster."""
    from durable_rollouts.contracts.types import Outcome, RolloutResult
    from durable_rollouts.workflows.group import close_group

    bug = "environment: ZeroDivisionError: division by zero"
    members = [RolloutResult(rollout_id=f"r/g0/{i}", sample_index=i, outcome=Outcome.FAILED, reason=bug)
               for i in range(4)]  # fmt: skip
    record, _ = close_group("r", "g0", "t", 4, members, 1e-6)
    assert record.failed == 4 and record.successes == 0 and record.infra_failures == {}
    s = BreakerState()
    for i in range(5):
        s = breaker.record(s, f"g{i}", record.infra_failures, record.successes, now=float(i), threshold=1)
    assert s.open_since is None and s.streaks == {}
    infra = members[0].model_copy(update={"reason": "infra: EngineUnavailable: refused"})
    record, _ = close_group("r", "g0", "t", 4, [infra, *members[1:]], 1e-6)
    assert record.infra_failures == {"EngineUnavailable": 1}


def test_a_streak_of_environment_failures_stops_the_run_for_good() -> None:
    s = BreakerState()
    s = breaker.record(s, "g0", {}, 0, 1.0, 3, environment_failures=2, env_threshold=5)
    assert s.stopped is None and s.env_streak == 2 and breaker.may_admit(s, 1.0, 60.0)
    s = breaker.record(s, "g1", {}, 1, 2.0, 3, environment_failures=1, env_threshold=5)
    assert s.env_streak == 0  # a success in between resets it
    for i in range(2, 5):
        s = breaker.record(s, f"g{i}", {}, 0, float(i), 3, 2, 5, "environment: KeyError: 'answer'")
    assert s.stopped == "6 consecutive environment failures (last: environment: KeyError: 'answer')"
    assert not breaker.may_admit(s, 1e9, 60.0)
    s = breaker.record(s, "g5", {}, 4, 6.0, 3, 0, 5)  # a late success of a group in flight
    assert s.stopped is not None and not breaker.may_admit(s, 1e9, 60.0)
    assert s.open_since is None  # infra streaks are another rule: the breaker never opened


def test_the_environment_rule_holds_without_the_infra_breaker_and_is_off_without_a_threshold() -> None:
    s = breaker.record(BreakerState(), "g0", {"X": 9}, 0, 1.0, None, environment_failures=3, env_threshold=3)
    assert s.stopped is not None and s.open_since is None and s.streaks == {}
    s = breaker.record(BreakerState(), "g0", {}, 0, 1.0, 3, environment_failures=100, env_threshold=None)
    assert s.stopped is None and s.env_streak == 0 and breaker.may_admit(s, 1.0, 60.0)


def test_environment_failures_never_open_the_infra_breaker() -> None:
    s = BreakerState()
    for i in range(4):
        s = breaker.record(s, f"g{i}", {}, 0, float(i), 3, environment_failures=2, env_threshold=None)
    assert s.open_since is None and s.opened == 0
