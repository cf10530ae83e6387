"""Group statistics for GRPO: a pure function of the members' results.

Invariant: only scorable members (a reward from the environment) enter the mean, the std and the
advantages; members that failed for infrastructure reasons still count toward the group's size.
"""

from __future__ import annotations

import math

from durable_rollouts.contracts.types import RAN_TO_END, GroupResult, Outcome, RolloutResult


def group_stats(
    run_id: str, group_id: str, task_id: str, size: int, members: list[RolloutResult], eps: float
) -> tuple[GroupResult, dict[str, float | None]]:
    """Reward mean/std over scorable members and advantages (r - mean) / (std + eps).

    Returns the group record and each member's advantage (None for members that are not scorable).
    A group with fewer than two scorable members, or whose scorable rewards are all equal, is
    zero-variance: its advantages are 0.
    """
    scorable = [m for m in members if m.scorable and m.reward is not None]
    rewards = [float(m.reward) for m in scorable if m.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if mean is not None else None
    zero_variance = len(rewards) < 2 or (std is not None and std < 1e-12)
    advantages: dict[str, float | None] = {}
    for m in members:
        if m.scorable and m.reward is not None and mean is not None and std is not None:
            advantages[m.rollout_id] = 0.0 if zero_variance else (float(m.reward) - mean) / (std + eps)
        else:
            advantages[m.rollout_id] = None
    outcomes: dict[str, int] = {}
    for m in members:
        outcomes[m.outcome.value] = outcomes.get(m.outcome.value, 0) + 1
    record = GroupResult(
        run_id=run_id,
        group_id=group_id,
        task_id=task_id,
        size=size,
        scorable=len(rewards),
        failed=sum(1 for m in members if m.outcome == Outcome.FAILED),
        reward_mean=mean,
        reward_std=std,
        zero_variance=zero_variance,
        outcomes=outcomes,
        complete_tokens=sum(m.num_tokens for m in members if m.outcome in RAN_TO_END),
    )
    return record, advantages
