"""What a run report shows, read from the run store in a few whole-run queries.

Invariants: read-only; no token blob is read (rows, turn meta, group records, feed marks, the dispatch
log and a trainer's off-policy evidence only), so a report of a large run costs a few queries; times are
the export's (``records/timing.py``), so the report and the records never disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from durable_rollouts.records.timing import rollout_time
from durable_rollouts.store.runstore import RunStore


class ReportError(ValueError):
    """The report cannot be made (unknown run, nothing recorded); one line."""


@dataclass(frozen=True)
class Rollout:
    """One finalized rollout as the report needs it."""

    rollout_id: str
    group_id: str
    env: str
    outcome: str
    reason: str | None
    reward: float | None
    sampled_tokens: int
    """Tokens the policy sampled (loss mask 1)."""
    turns: int
    replica: str | None
    """Engine replica of its last turn (its first, before a failover)."""
    time: dict[str, Any]
    """The record's ``time`` object."""
    finished_at: float
    """Store time the record was written."""


@dataclass
class RunData:
    """Everything the report plots, for one run."""

    run_id: str
    config: dict[str, Any]
    created_at: float
    rollouts: list[Rollout]
    groups: list[dict[str, Any]]
    feed: list[dict[str, Any]] = field(default_factory=list)
    """The trainer feed's marks (consumed or discarded groups: state, records, tokens, at)."""
    dispatch: list[dict[str, Any]] = field(default_factory=list)
    """The dispatcher's log: one decision per poll (at, cap, inflight, kv_usage, ...)."""
    evidence: list[dict[str, Any]] = field(default_factory=list)
    """A trainer's off-policy evidence, one entry per consumed batch (at, mean/max |Δ logprob|, ratios,
    lag shares, flagged), as the TRL integration keeps it."""

    @property
    def envs(self) -> list[str]:
        return sorted({r.env for r in self.rollouts})


def load(store: RunStore, run_id: str) -> RunData:
    """The run's report data.

    Raises:
        ReportError: If the store has no such run, or the run has no rollout record yet.
    """
    run = store.get_run(run_id)
    if run is None:
        raise ReportError(f"no run {run_id!r} in the store at {store.location}")
    turns: dict[str, list[dict[str, Any]]] = {}
    for rid, meta in store.turn_meta(run_id):
        turns.setdefault(rid, []).append(meta)
    waits = store.trainer_waits(run_id)
    sampled = store.sampled_tokens(run_id)
    rollouts = []
    for row in store.rollouts(run_id):
        metas = turns.get(row["rollout_id"], [])
        extra = json.loads(row["extra_json"] or "{}")
        engines = [m.get("engine") for m in metas if m.get("engine")]
        rollouts.append(
            Rollout(
                rollout_id=row["rollout_id"],
                group_id=row["group_id"],
                env=row["env"],
                outcome=row["outcome"],
                reason=row["reason"],
                reward=row["reward"] if row["scorable"] else None,
                sampled_tokens=sampled.get(row["rollout_id"], 0),
                turns=len(metas),
                replica=engines[-1] if engines else None,
                time=rollout_time(metas, extra, waits.get(row["group_id"])),
                finished_at=row["finished_at"],
            )
        )
    if not rollouts:
        raise ReportError(f"run {run_id!r} has no rollout record yet")
    try:
        config = json.loads(run["config_json"])
    except ValueError:
        config = {}
    feed = sorted(store.feed_marks(run_id).values(), key=lambda m: m["at"])
    return RunData(
        run_id=run_id,
        config=config if isinstance(config, dict) else {},
        created_at=run["created_at"],
        rollouts=rollouts,
        groups=store.groups(run_id),
        feed=feed,
        dispatch=store.dispatch_log(run_id),
        evidence=store.offpolicy_evidence(run_id),
    )
