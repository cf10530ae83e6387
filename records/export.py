"""Export a run as JSONL: one rollout object per line, then one group object per group.

This is a stable contract that trainers read (see README, "Export format"): every line is built through
the models of ``records/record.py`` (whose committed JSON Schemas are ``records/schema/*.json``) and carries
``schema_version``. Fields keep their names and meaning. Invariant: token_ids, logprobs, loss_mask and
policy_versions of a record have the same length, and logprobs/policy_versions are null exactly where
loss_mask is 0.

Optional fields: of what the rollout workflow stores beside the record (``extra_json``), only the declared
optional fields (``records.models.ROLLOUT_OPTIONAL``) are exported, and only where stored; any other key
stays in the store and is not exported.

Time: every rollout record carries ``time`` (``records/timing.py``): its turns' times summed, the
per-rollout entries (``sandbox_s``, ``record_transfer_s``) and wall time that ``finalize_rollout`` stores in
``extra_json``, and, once the trainer feed consumed its group, ``trainer_wait_s`` (feed mark time - group
record time; the group record carries it too). Records stored before wall time existed have null wall time.

Lineage: every rollout record carries ``lineage`` (see :func:`rollout_lineage`): the policy versions that
sampled its tokens in order of first use, the run's config hash, the environment and verifier versions
(constants in ``environments/``) and, for coding, the sandbox image of the stored config.
``finalize_rollout`` stores
it with the record; records stored before lineage existed are exported with what the store still knows
(versions from the tokens, hash and image from the stored run) and null for the code versions it never
recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

from durable_rollouts.records.record import ROLLOUT_OPTIONAL, SCHEMA_VERSION, GroupRecord, RolloutRecord
from durable_rollouts.records.timing import rollout_time
from durable_rollouts.store.runstore import RunStore, Segment

LINEAGE_FIELDS = (
    "policy_versions",
    "config_hash",
    "env",
    "env_version",
    "verifier_version",
    "sandbox_image",
)
"""Keys of a record's ``lineage`` object, in export order."""


def env_versions(env: str) -> tuple[str | None, str | None]:
    """(environment version, verifier version) of the code running now; None for an env not installed."""
    from durable_rollouts.environments import registry

    e = registry.find(env)
    return (e.env_version, e.verifier_version) if e is not None else (None, None)


def versions_in_order(segs: list[Segment]) -> list[str]:
    """Policy versions that sampled the rollout's tokens, in order of first use (engine-reported)."""
    seen: dict[str, None] = {}
    for s in segs:
        if s.kind == "model":
            for v in s.policy_versions or []:
                if v is not None:
                    seen.setdefault(v, None)
    return list(seen)


def rollout_lineage(
    run: dict[str, Any] | None, env: str, segs: list[Segment], sandbox_image: str | None = None
) -> dict[str, Any]:
    """What produced a rollout: policy versions, run config hash, env/verifier versions, sandbox image.

    ``run`` is the store's run row (``config_json``, ``config_hash``) or None when the run is unknown;
    ``sandbox_image`` the image the rollout's sandbox ran (None: the run's default, for an env with one).
    """
    env_version, verifier_version = env_versions(env)
    return {
        "policy_versions": versions_in_order(segs),
        "config_hash": run["config_hash"] if run else None,
        "env": env,
        "env_version": env_version,
        "verifier_version": verifier_version,
        "sandbox_image": sandbox_image or _sandbox_image(run, env),
    }


def _sandbox_image(run: dict[str, Any] | None, env: str) -> str | None:
    """The run's default sandbox image, for an environment that uses sandboxes."""
    from durable_rollouts.environments import registry

    e = registry.find(env)
    if e is None or not e.uses_sandbox or not run:
        return None
    try:
        image = json.loads(run["config_json"])["sandbox"]["image"]
    except (ValueError, KeyError, TypeError):
        return None
    return image if isinstance(image, str) else None


def _export_lineage(stored: Any, run: dict[str, Any] | None, env: str, segs: list[Segment]) -> dict[str, Any]:
    """The stored lineage, or what the store still knows for a record stored before lineage existed."""
    if isinstance(stored, dict):
        out = {k: stored.get(k) for k in LINEAGE_FIELDS}
        out["policy_versions"] = versions_in_order(segs)  # the tokens are the source of truth
        return out
    out = rollout_lineage(run, env, segs)
    out["env_version"] = out["verifier_version"] = None  # not recorded: never guessed from today's code
    return out


def _turns(segs: list[Segment]) -> list[dict[str, Any]]:
    out = []
    for s in segs:
        if s.kind != "model":
            continue
        m = s.meta
        turn = {
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
        if "transfer_s" in m:  # recorded from schema 3 on
            turn["transfer_s"] = m["transfer_s"]
        if "logprob_mode" in m:  # recorded from schema 4 on
            turn["logprob_mode"] = m["logprob_mode"]
        if m.get("metrics"):  # an environment that reports more than the reward (environments.base.Score)
            turn["metrics"] = m["metrics"]
        out.append(turn)
    return out


_UNKNOWN: Any = object()
"""``rollout_record``'s default trainer wait: look it up in the store."""


def rollout_record(
    store: RunStore, row: dict[str, Any], trainer_wait_s: float | None = _UNKNOWN
) -> dict[str, Any]:
    """The export object of one rollout (its summary row joined with its token segments).

    ``trainer_wait_s``: the group's wait in the trainer queue if the caller knows it (None: not consumed);
    by default it is read from the store (one indexed query).
    """
    if trainer_wait_s is _UNKNOWN:
        trainer_wait_s = store.trainer_waits(row["run_id"], row["group_id"]).get(row["group_id"])

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
    lineage = _export_lineage(extra.pop("lineage", None), store.get_run(row["run_id"]), row["env"], segs)
    fields = {
        "schema_version": SCHEMA_VERSION,
        **{k: extra[k] for k in ROLLOUT_OPTIONAL if k in extra},
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
        "time": rollout_time((s.meta for s in segs if s.kind == "model"), extra, trainer_wait_s),
        "lineage": lineage,
    }
    return _dump_rollout(fields)


_TOKEN_ARRAYS = {"token_ids", "logprobs", "loss_mask", "policy_versions"}
"""The per-token lists of a rollout record: validated by the model, then exported as they are."""


def _dump_rollout(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` validated as a :class:`RolloutRecord` and dumped as JSON data (optional fields only where
    given). The per-token lists are validated but not re-serialized (a copy of thousands of plain ints,
    floats and strings would cost as much as the validation): they go out as given, in field order."""
    model = RolloutRecord.model_validate(fields)
    out = model.model_dump(mode="json", exclude_unset=True, exclude=_TOKEN_ARRAYS)
    return {k: fields[k] if k in _TOKEN_ARRAYS else out[k] for k in fields}


def group_record(rec: dict[str, Any], trainer_wait_s: float | None = None) -> dict[str, Any]:
    """The export object of one group (its stored record; ``trainer_wait_s`` once it was consumed)."""
    fields = {
        "schema_version": SCHEMA_VERSION,
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
        "admission_cancelled": rec.get("admission_cancelled", 0),
        "wasted_tokens": rec.get("wasted_tokens", 0),
        "superseded": rec.get("superseded", 0),
        "unscorable_reason": rec.get("unscorable_reason"),
        **({} if trainer_wait_s is None else {"trainer_wait_s": trainer_wait_s}),
    }
    return GroupRecord.model_validate(fields).model_dump(mode="json", exclude_unset=True)


def iter_run(store: RunStore, run_id: str) -> Iterator[dict[str, Any]]:
    """Every rollout record of the run, then every group record."""
    waits = store.trainer_waits(run_id)
    for row in store.rollouts(run_id):
        yield rollout_record(store, row, waits.get(row["group_id"]))
    for rec in store.groups(run_id):
        yield group_record(rec, waits.get(rec["group_id"]))


def rollout_times(store: RunStore, run_id: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(summary row, ``time`` object) of every finalized rollout of the run, as the export computes it,
    from the store's rows and turn meta only (no token blobs are read: cheap for a whole run)."""
    turns: dict[str, list[dict[str, Any]]] = {}
    for rid, meta in store.turn_meta(run_id):
        turns.setdefault(rid, []).append(meta)
    waits = store.trainer_waits(run_id)
    out = []
    for row in store.rollouts(run_id):
        extra = json.loads(row["extra_json"] or "{}")
        out.append((row, rollout_time(turns.get(row["rollout_id"], []), extra, waits.get(row["group_id"]))))
    return out


def export_run(store: RunStore, run_id: str, out: IO[str]) -> dict[str, int]:
    """Write the run as JSONL; returns how many lines of each kind were written."""
    counts = {"rollout": 0, "group": 0}
    for obj in iter_run(store, run_id):
        out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        counts[obj["kind"]] += 1
    return counts
