"""A group's close: the group record (GRPO statistics over the scorable attempts, admission cancels,
superseded infra failures) and what finalize_group writes, from every member attempt's result.
Deterministic (the group's workflow and the run's account of a terminated group call it)."""

from __future__ import annotations

import itertools

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.admission.controller import CANCEL_REASON
    from durable_rollouts.contracts.activity_io import FinalizeGroupInput
    from durable_rollouts.contracts.types import FailureKind, GroupResult, Outcome, RolloutResult
    from durable_rollouts.workflows.grpo import group_stats


def slot_of(member_id: str) -> tuple[int, int]:
    """(sample index, attempt) of a member id ``<run>/<group>/<i>`` or ``.../<i>r<n>``."""
    last = member_id.rsplit("/", 1)[-1]
    i, _, n = last.partition("r")
    return int(i), int(n or 0)


def close_group(
    run_id: str,
    group_id: str,
    task_id: str,
    size: int,
    attempts: list[RolloutResult],
    eps: float,
    on_infra_failure: str = "exclude",
) -> tuple[GroupResult, dict[str, float | None]]:
    """The group record (GRPO statistics over the scorable attempts, the admission cancels and their
    wasted tokens, the superseded infra failures) and the advantages, from every member attempt's result.
    With ``fail-group``, a slot whose last attempt failed for infrastructure makes the group unscorable."""
    attempts = sorted(attempts, key=lambda r: (r.sample_index, slot_of(r.rollout_id)[1], r.rollout_id))
    superseded = superseded_attempts(attempts)
    lost = [r for r in last_attempts(attempts) if _infra(r)]
    unscorable = None
    if on_infra_failure == "fail-group" and lost:
        unscorable = f"{lost[0].rollout_id}: {lost[0].reason or 'infra'}"[:300]
    scored = attempts if unscorable is None else [r.model_copy(update={"scorable": False}) for r in attempts]
    record, advantages = group_stats(run_id, group_id, task_id, size, scored, eps)
    cancelled = [r for r in attempts if r.outcome == Outcome.CANCELLED and r.reason == CANCEL_REASON]
    env_failed = [r for r in attempts if _failed_as(r, FailureKind.ENVIRONMENT)]
    record = record.model_copy(
        update={
            "admission_cancelled": len(cancelled),
            "wasted_tokens": sum(r.wasted_tokens for r in cancelled),
            "infra_failures": infra_failures(attempts),
            "successes": sum(1 for r in attempts if r.scorable),
            "superseded": len(superseded),
            "unscorable_reason": unscorable,
            "environment_failures": len(env_failed),
            "environment_failure": (env_failed[0].reason or "")[:300] if env_failed else None,
        }
    )
    return record, advantages


def superseded_attempts(attempts: list[RolloutResult]) -> dict[str, str]:
    """Attempts that failed for infrastructure and whose slot ran again: id -> the next attempt's id."""
    by_slot: dict[int, list[RolloutResult]] = {}
    for r in attempts:
        by_slot.setdefault(r.sample_index, []).append(r)
    out: dict[str, str] = {}
    for tried in by_slot.values():
        tried.sort(key=lambda r: slot_of(r.rollout_id)[1])
        for r, after in itertools.pairwise(tried):
            if _infra(r):
                out[r.rollout_id] = after.rollout_id
    return out


def last_attempts(attempts: list[RolloutResult]) -> list[RolloutResult]:
    """The last attempt of every slot (the one that counts)."""
    last: dict[int, RolloutResult] = {}
    for r in attempts:
        if (
            r.sample_index not in last
            or slot_of(r.rollout_id)[1] > slot_of(last[r.sample_index].rollout_id)[1]
        ):
            last[r.sample_index] = r
    return [last[i] for i in sorted(last)]


def _failed_as(r: RolloutResult, kind: FailureKind) -> bool:
    return r.outcome == Outcome.FAILED and (r.reason or "").startswith(f"{kind.value}:")


def _infra(r: RolloutResult) -> bool:
    return _failed_as(r, FailureKind.INFRA)


def infra_failures(attempts: list[RolloutResult]) -> dict[str, int]:
    """Members that failed for infrastructure, by error type (from reasons ``infra: <Type>: ...``)."""
    out: dict[str, int] = {}
    for r in attempts:
        if _infra(r):
            kind = (r.reason or "").split(":", 2)[1].strip() or "unknown"
            out[kind] = out.get(kind, 0) + 1
    return out


def finalize_input(
    record: GroupResult, advantages: dict[str, float | None], attempts: list[RolloutResult]
) -> FinalizeGroupInput:
    """What finalize_group writes: the record, the advantages, the superseded attempts' marks and, for an
    unscorable group, its members (stored as not scorable)."""
    return FinalizeGroupInput(
        record=record,
        advantages=advantages,
        superseded=superseded_attempts(attempts),
        unscorable=sorted(r.rollout_id for r in attempts) if record.unscorable_reason else [],
    )
