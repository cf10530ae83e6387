"""Off-policy evidence: the trainer's own logprobs of the sampled tokens against the engine's.

For every consumed batch the trainer side recomputes, with the weights it holds now, the logprob of every
sampled token (``loss_mask`` 1) under the trainer's temperature, and reports beside the behaviour
logprobs the engine recorded: mean and max ``|Δ logprob|``, KL estimates (k1 = mean(-log r), k3 =
mean(r - 1 - log r), r = p_trainer / p_behaviour), importance-ratio p50/p99/max, and the share of tokens by
policy lag (publishes between the version that sampled a token and the trainer's).

Invariants:
- Tokens sampled by the weights the trainer holds (lag 0) must agree up to float noise; ``flagged`` is set
  (with a one-line ``flag``) when their mean ``|Δ|`` exceeds ``tolerance`` (default 0.01 nats) or their max
  exceeds ``20 * tolerance``: a mismatch of sampling settings (temperature, top-p/top-k, logprob mode) or of
  weights, which would otherwise silently bias every importance ratio.
- Nothing here changes the batch; it is measurement only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from durable_rollouts.trainer.loss import token_logprobs

TOLERANCE = 0.01


@torch.no_grad()
def recompute(model: torch.nn.Module, records: list[dict[str, Any]], temperature: float) -> list[list[float]]:
    """The model's logprob of every token of each record given its prefix (index 0 is NaN), at
    ``temperature`` (the core's ``trainer.loss.token_logprobs``)."""
    was_training = model.training
    model.eval()
    out: list[list[float]] = []
    device = next(model.parameters()).device
    try:
        for rec in records:
            ids = torch.tensor([rec["token_ids"]], dtype=torch.long, device=device)
            lp = token_logprobs(model(input_ids=ids).logits, ids, temperature)[0]
            out.append([float("nan"), *lp.cpu().tolist()])
    finally:
        model.train(was_training)
    return out


def _quantile(v: torch.Tensor, q: float) -> float:
    return float(torch.quantile(v, q).item()) if v.numel() else float("nan")


def evidence(
    model: torch.nn.Module,
    records: list[dict[str, Any]],
    temperature: float,
    lags: list[list[int]],
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:
    """The off-policy evidence of one batch.

    Args:
        records: Rollout records (export format).
        lags: Per record, the policy lag of each *sampled* token (same order as its loss_mask 1 positions).
    """
    current = recompute(model, records, temperature)
    d, lag_of = [], []
    for rec, cur, lag in zip(records, current, lags, strict=True):
        pos = [i for i, m in enumerate(rec["loss_mask"]) if m]
        if len(pos) != len(lag):
            raise ValueError(
                f"rollout {rec.get('rollout_id')}: {len(lag)} lags for {len(pos)} sampled tokens"
            )
        for i, g in zip(pos, lag, strict=True):
            d.append(cur[i] - float(rec["logprobs"][i]))
            lag_of.append(g)
    delta = torch.tensor(d, dtype=torch.float64)
    if not delta.numel():
        return {"tokens": 0, "flagged": False}
    lr = delta  # log r = log p_trainer - log p_behaviour
    r = torch.exp(lr)
    lag_t = torch.tensor(lag_of)
    zero = delta[lag_t == 0].abs()
    counts = Counter(lag_of)
    out: dict[str, Any] = {
        "tokens": int(delta.numel()),
        "temperature": temperature,
        "mean_abs_dlogp": float(delta.abs().mean()),
        "max_abs_dlogp": float(delta.abs().max()),
        "kl_k1": float((-lr).mean()),
        "kl_k3": float((r - 1 - lr).mean()),
        "ratio_p50": _quantile(r, 0.5),
        "ratio_p99": _quantile(r, 0.99),
        "ratio_max": float(r.max()),
        "lag_share": {str(k): round(v / len(lag_of), 6) for k, v in sorted(counts.items())},
        "lag0_tokens": int(zero.numel()),
        "lag0_mean_abs_dlogp": float(zero.mean()) if zero.numel() else None,
        "lag0_max_abs_dlogp": float(zero.max()) if zero.numel() else None,
        "flagged": False,
    }
    if zero.numel() and (zero.mean() > tolerance or zero.max() > 20 * tolerance):
        out["flagged"] = True
        out["flag"] = (
            f"logprob mismatch at equal weights: mean |Δ| {float(zero.mean()):.4f}, "
            f"max {float(zero.max()):.4f} nats over {zero.numel()} lag-0 tokens (tolerance {tolerance}); "
            "check temperature, top-p/top-k and logprob mode against the engine's"
        )
    return out


def metrics(ev: dict[str, Any], prefix: str = "offpolicy/") -> dict[str, float]:
    """The evidence as flat float metrics (TRL's metric sink shape)."""
    out: dict[str, float] = {}
    for k, v in ev.items():
        if k == "lag_share":
            out.update({f"{prefix}lag_share/{lag}": float(s) for lag, s in v.items()})
        elif isinstance(v, bool | int | float):
            out[prefix + k] = float(v)
    return out
