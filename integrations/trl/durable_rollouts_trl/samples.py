"""Export-format records (``records/export.py``) as TRL inputs, checked against the trainer's sampling.

Invariants:
- Nothing is re-tokenized: ``input_ids`` are the record's ``token_ids``; the trained tokens
  (``completion_mask``) are exactly the record's ``loss_mask`` (observation and prompt tokens 0); the old
  logprobs are the engine's recorded (behaviour) logprobs, 0.0 where the mask is 0.
- The behaviour logprobs mean what the trainer's loss assumes, or the record is refused with one line:
  ``processed_logprobs`` at the trainer's temperature, with no top-p/top-k truncation (TRL's loss takes a
  full softmax of logits / temperature; a truncated distribution cannot be rebuilt from the logits).
- A sample's ``model_version`` is the TRL version of the *oldest* policy version among its sampled tokens:
  ``current - lag``, where lag counts publishes in the store's order, exactly as the trainer feed does, so
  TRL's staleness (``model_version_now - sample.model_version``) equals the feed's lag.
- Members without an advantage (not scorable: infra failures, truncations) yield no sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

WANTED_LOGPROBS = "processed_logprobs"


class SampleError(ValueError):
    """A record cannot be trained on by this trainer as it is (one line naming the rollout and field)."""


@dataclass(frozen=True)
class Sampling:
    """The trainer's sampling settings (TRL's ``temperature``, ``top_p``, ``top_k``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def check_sampling(rec: dict[str, Any], want: Sampling) -> None:
    """Refuse a record whose behaviour logprobs do not mean what the trainer's loss recomputes."""
    rid = rec.get("rollout_id", "?")
    s = rec.get("sampling") or {}
    mode = s.get("logprob_mode")
    if mode != WANTED_LOGPROBS:
        raise SampleError(
            f"rollout {rid}: sampling.logprob_mode {mode!r}; the trainer needs {WANTED_LOGPROBS!r}"
        )
    t = float(s.get("temperature", 1.0))
    if not math.isclose(t, want.temperature, rel_tol=0, abs_tol=1e-9):
        raise SampleError(
            f"rollout {rid}: sampling.temperature {t} but the trainer's temperature is {want.temperature}; "
            "set both to one value (the run's [sampling] and the trainer's args.temperature)"
        )
    if float(s.get("top_p", 1.0)) < 1.0 or int(s.get("top_k", -1)) > 0:
        raise SampleError(f"rollout {rid}: sampling.top_p/top_k truncation: the trainer cannot rebuild it")
    if want.top_p < 1.0 or want.top_k > 0:
        raise SampleError(f"trainer top_p {want.top_p} / top_k {want.top_k}: use 1.0 and 0 (no truncation)")


def group_index(group_id: str) -> int:
    """The run's index of a group (``g000012`` -> 12): TRL's integer ``group_id``."""
    tail = group_id.rsplit("/", 1)[-1]
    if not tail.startswith("g") or not tail[1:].isdigit():
        raise SampleError(f"group {group_id!r}: not a g<index> group id")
    return int(tail[1:])


def sampled_versions(rec: dict[str, Any]) -> list[str]:
    """The policy version of every sampled token (loss_mask 1), in order."""
    return [v for v, m in zip(rec["policy_versions"], rec["loss_mask"], strict=True) if m and v is not None]


def token_lags(rec: dict[str, Any], order: dict[str, int], current: str) -> list[int]:
    """The policy lag (publishes behind ``current``) of every sampled token of ``rec``, in order."""
    return [order[current] - order[v] for v in sampled_versions(rec)]


def sample_fields(
    rec: dict[str, Any], order: dict[str, int], current: str, current_int: int, want: Sampling
) -> dict[str, Any] | None:
    """The ``RolloutSample`` fields of one record (numpy arrays as lists); None without an advantage.

    Args:
        order: Store publish order of every version (``policies`` rows: version -> position).
        current: The version label the trainer holds now; ``current_int`` its TRL ``model_version``.
    """
    if rec.get("advantage") is None:
        return None
    check_sampling(rec, want)
    ids, lps, mask = rec["token_ids"], rec["logprobs"], rec["loss_mask"]
    if not (len(ids) == len(lps) == len(mask)) or not any(mask):
        raise SampleError(
            f"rollout {rec.get('rollout_id')}: token_ids/logprobs/loss_mask differ or nothing sampled"
        )
    versions = sampled_versions(rec)
    lag = max((order[current] - order[v] for v in versions), default=0)
    return {
        "input_ids": list(ids),
        "completion_mask": [int(m) for m in mask],
        "old_log_probs": [float(lp) if m else 0.0 for lp, m in zip(lps, mask, strict=True)],
        "advantage": float(rec["advantage"]),
        "model_version": current_int - lag,
        "group_id": group_index(rec["group_id"]),
        "metrics": {"reward": float(rec["reward"]) if rec.get("reward") is not None else 0.0},
    }


def rollout_func_row(rec: dict[str, Any]) -> dict[str, Any]:
    """``prompt_ids`` (every token before the first sampled one), ``completion_ids`` (the rest, observations
    included), ``logprobs`` (behaviour; 0.0 on observation tokens) and ``env_mask`` (its loss_mask)."""
    mask = rec["loss_mask"]
    first = next((i for i, m in enumerate(mask) if m), len(mask))
    return {
        "prompt_ids": list(rec["token_ids"][:first]),
        "completion_ids": list(rec["token_ids"][first:]),
        "logprobs": [
            float(lp) if m else 0.0 for lp, m in zip(rec["logprobs"][first:], mask[first:], strict=True)
        ],
        "env_mask": [int(m) for m in mask[first:]],
    }
