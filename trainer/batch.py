"""Trainer-feed records (the export contract, records/export.py) as padded tensors for the loss.

Invariants:
- Nothing is re-tokenized: the tensors hold the records' ``token_ids`` exactly, right-padded.
- A token enters the loss only where its record's ``loss_mask`` is 1 and the record has an advantage
  (members that were not scorable, e.g. infra failures, have none and contribute nothing).
- Every record of one batch was sampled at one temperature (the trainer's logprobs must be taken under the
  same transform as the recorded ones); a mix is refused. ``top_p``/``top_k`` truncation is refused too:
  the recorded (processed) logprobs would then be renormalised over a set the trainer cannot rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class BatchError(ValueError):
    """A record cannot be trained on as it is (one line naming the rollout and the field)."""


@dataclass
class TensorBatch:
    """Right-padded sequences and their per-token training data (shapes ``(B, T)``; ``(B,)`` for advantages).

    ``logp_behaviour`` and ``mask`` are aligned with the *targets* ``token_ids[:, 1:]``: shape ``(B, T - 1)``.
    """

    token_ids: torch.Tensor
    attention_mask: torch.Tensor
    logp_behaviour: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    temperature: float
    rollout_ids: list[str]

    @property
    def tokens(self) -> int:
        return int(self.mask.sum().item())

    def rows(self, index: list[int]) -> TensorBatch:
        """The sub-batch of these rows (for mini-batches)."""
        i = torch.tensor(index, dtype=torch.long)
        return TensorBatch(
            self.token_ids[i],
            self.attention_mask[i],
            self.logp_behaviour[i],
            self.mask[i],
            self.advantages[i],
            self.temperature,
            [self.rollout_ids[k] for k in index],
        )


def _check(rec: dict[str, Any]) -> None:
    rid = rec.get("rollout_id", "?")
    ids, lps, mask = rec.get("token_ids"), rec.get("logprobs"), rec.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(lps, list) or not isinstance(mask, list):
        raise BatchError(f"rollout {rid}: token_ids, logprobs and loss_mask must be lists")
    if not (len(ids) == len(lps) == len(mask)):
        raise BatchError(
            f"rollout {rid}: token_ids ({len(ids)}), logprobs ({len(lps)}) and loss_mask ({len(mask)}) "
            "differ in length"
        )
    for k, (m, lp) in enumerate(zip(mask, lps, strict=True)):
        if m and lp is None:
            raise BatchError(f"rollout {rid}: logprobs[{k}] is null on a sampled token (loss_mask 1)")
    if mask and mask[0]:
        raise BatchError(f"rollout {rid}: loss_mask[0] is 1; the first token has no context to score it")


def _temperature(rec: dict[str, Any]) -> float:
    s = rec.get("sampling") or {}
    rid = rec.get("rollout_id", "?")
    if float(s.get("top_p", 1.0)) < 1.0 or int(s.get("top_k", -1)) > 0:
        raise BatchError(f"rollout {rid}: sampling.top_p/top_k truncation is not supported by this trainer")
    t = float(s.get("temperature", 1.0))
    if t <= 0:
        raise BatchError(f"rollout {rid}: sampling.temperature {t}: greedy samples carry no usable logprobs")
    return t


def to_tensors(records: list[dict[str, Any]], pad_id: int) -> TensorBatch | None:
    """The trainable rollout records of a batch as tensors; None when none has an advantage.

    Raises:
        BatchError: A malformed record, truncated sampling, or records sampled at different temperatures.
    """
    usable = [r for r in records if r.get("kind", "rollout") == "rollout" and r.get("advantage") is not None]
    if not usable:
        return None
    temps = set()
    for r in usable:
        _check(r)
        temps.add(_temperature(r))
    if len(temps) > 1:
        raise BatchError(f"records sampled at several temperatures {sorted(temps)}; train on one at a time")
    width = max(len(r["token_ids"]) for r in usable)
    b = len(usable)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    att = torch.zeros((b, width), dtype=torch.long)
    lp = torch.zeros((b, width - 1), dtype=torch.float32)
    mask = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, r in enumerate(usable):
        n = len(r["token_ids"])
        ids[i, :n] = torch.tensor(r["token_ids"], dtype=torch.long)
        att[i, :n] = 1
        # Target t + 1 is predicted at position t: shift mask and logprobs left by one.
        mask[i, : n - 1] = torch.tensor(r["loss_mask"][1:], dtype=torch.float32)
        lp[i, : n - 1] = torch.tensor([x if x is not None else 0.0 for x in r["logprobs"][1:]])
    adv = torch.tensor([float(r["advantage"]) for r in usable], dtype=torch.float32)
    return TensorBatch(ids, att, lp, mask, adv, temps.pop(), [str(r.get("rollout_id")) for r in usable])
