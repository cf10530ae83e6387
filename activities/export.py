"""Export a run as JSONL: one rollout object per line, then one group object per group.

This is a stable contract that trainers read (see README, "Export format"); fields keep their names and
meaning, new fields may be added. Invariant: token_ids, logprobs, loss_mask and policy_versions of a record
have the same length, and logprobs/policy_versions are null exactly where loss_mask is 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

from activities.store import RunStore, Segment


def _turns(segs: list[Segment]) -> list[dict[str, Any]]:
    out = []
    for s in segs:
        if s.kind != "model":
            continue
        m = s.meta
        out.append(
            {
                "turn": s.turn,
                "engine": m.get("engine"),
                "finish_reason": m.get("finish_reason"),
                "range": [s.start, s.end],
                "queue_s": m.get("queue_s", 0.0),
                "model_s": m.get("model_s", 0.0),
                "env_s": m.get("env_s", 0.0),
                "reward_s": m.get("reward_s", 0.0),
                "attempt": m.get("attempt"),
            }
        )
    return out


def rollout_record(store: RunStore, row: dict[str, Any]) -> dict[str, Any]:
    """The export object of one rollout (its summary row joined with its token segments)."""
    segs = store.segments(row["rollout_id"])
    token_ids: list[int] = []
    logprobs: list[float | None] = []
    loss_mask: list[int] = []
    versions: list[str | None] = []
    for s in segs:
        token_ids.extend(s.token_ids)
        sampled = s.kind == "model"
        logprobs.extend(s.logprobs if sampled and s.logprobs is not None else [None] * len(s.token_ids))
        versions.extend(
            s.policy_versions if sampled and s.policy_versions is not None else [None] * len(s.token_ids)
        )
        loss_mask.extend([1 if sampled else 0] * len(s.token_ids))
    extra = json.loads(row["extra_json"] or "{}")
    return {
        **extra,
        "kind": "rollout",
        "run_id": row["run_id"],
        "group_id": row["group_id"],
        "rollout_id": row["rollout_id"],
        "task_id": row["task_id"],
        "sample_index": row["sample_index"],
        "env": row["env"],
        "outcome": row["outcome"],
        "reason": row["reason"],
        "reward": row["reward"],
        "scorable": bool(row["scorable"]),
        "advantage": row["advantage"],
        "prompt_length": row["prompt_length"],
        "token_ids": token_ids,
        "logprobs": logprobs,
        "loss_mask": loss_mask,
        "policy_versions": versions,
        "sampling": json.loads(row["sampling_json"]),
        "turns": _turns(segs),
    }


def group_record(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "group",
        "run_id": rec["run_id"],
        "group_id": rec["group_id"],
        "task_id": rec["task_id"],
        "size": rec["size"],
        "scorable": rec["scorable"],
        "failed": rec["failed"],
        "reward_mean": rec["reward_mean"],
        "reward_std": rec["reward_std"],
        "zero_variance": rec["zero_variance"],
        "outcomes": rec.get("outcomes", {}),
    }


def iter_run(store: RunStore, run_id: str) -> Iterator[dict[str, Any]]:
    """Every rollout record of the run, then every group record."""
    for row in store.rollouts(run_id):
        yield rollout_record(store, row)
    for rec in store.groups(run_id):
        yield group_record(rec)


def export_run(store: RunStore, run_id: str, out: IO[str]) -> dict[str, int]:
    """Write the run as JSONL; returns how many lines of each kind were written."""
    counts = {"rollout": 0, "group": 0}
    for obj in iter_run(store, run_id):
        out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        counts[obj["kind"]] += 1
    return counts
