"""GRPO group statistics over scorable members only."""

from __future__ import annotations

import math

import pytest

from durable_rollouts.contracts.types import Outcome, RolloutResult
from durable_rollouts.workflows.grpo import group_stats


def member(i: int, outcome: Outcome = Outcome.COMPLETED, reward: float | None = None) -> RolloutResult:
    scorable = reward is not None
    return RolloutResult(
        rollout_id=f"r/g/{i}", sample_index=i, outcome=outcome, reward=reward, scorable=scorable
    )


def test_advantages_are_normalised_over_scorable_members() -> None:
    members = [member(0, reward=1.0), member(1, reward=0.0), member(2, reward=0.0), member(3, reward=1.0)]
    rec, adv = group_stats("r", "g", "t", 4, members, eps=1e-6)
    assert rec.reward_mean == 0.5 and rec.reward_std == pytest.approx(0.5)
    assert adv["r/g/0"] == pytest.approx(0.5 / (0.5 + 1e-6))
    assert adv["r/g/1"] == pytest.approx(-0.5 / (0.5 + 1e-6))
    assert not rec.zero_variance and rec.scorable == 4 and rec.failed == 0


def test_infra_failures_count_toward_size_but_not_statistics() -> None:
    failed = member(3, outcome=Outcome.FAILED)
    members = [member(0, reward=1.0), member(1, reward=0.0), member(2, reward=0.0), failed]
    rec, adv = group_stats("r", "g", "t", 4, members, eps=1e-6)
    assert rec.size == 4 and rec.scorable == 3 and rec.failed == 1
    assert rec.reward_mean == pytest.approx(1 / 3)
    assert rec.reward_std == pytest.approx(math.sqrt(2 / 9))
    assert adv["r/g/3"] is None
    assert sum(a for a in adv.values() if a is not None) == pytest.approx(0.0, abs=1e-9)
    assert rec.outcomes == {"completed": 3, "failed": 1}


def test_zero_variance_group_is_flagged_with_zero_advantages() -> None:
    rec, adv = group_stats("r", "g", "t", 3, [member(i, reward=1.0) for i in range(3)], eps=1e-6)
    assert rec.zero_variance and rec.reward_std == 0.0
    assert set(adv.values()) == {0.0}


def test_group_with_no_scorable_member() -> None:
    members = [member(i, outcome=Outcome.FAILED) for i in range(2)]
    rec, adv = group_stats("r", "g", "t", 2, members, eps=1e-6)
    assert rec.reward_mean is None and rec.reward_std is None and rec.zero_variance
    assert adv == {"r/g/0": None, "r/g/1": None}
