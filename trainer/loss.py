"""The GRPO policy loss: a PPO-style clipped surrogate with token-level importance weights.

Invariants:
- The importance weight of a token is ``exp(logp_current - logp_behaviour)``, where ``logp_behaviour`` is
  the logprob the engine recorded when it sampled the token (never recomputed here) and ``logp_current`` is
  the trainer's logprob of the same recorded token id under the same sampling temperature.
- Only tokens with loss mask 1 (sampled by the policy) contribute, to the value and to the gradient; the
  loss is their mean over the whole batch (every sampled token weighs the same, DAPO-style).
- Per token: ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``. Beyond the clip range on the side
  the advantage pushes towards, the clipped term is the minimum and carries no gradient; a zero advantage
  gives a zero loss and a zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation (plain floats)."""

    loss: float
    tokens: int
    mean_ratio: float
    clip_fraction: float
    approx_kl: float
    """Mean of ``logp_behaviour - logp_current`` over the tokens (k1 estimate of KL(behaviour || current))."""


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each next token: ``out[b, t] = log p(token_ids[b, t + 1] | token_ids[b, : t + 1])``.

    Args:
        logits: ``(B, T, V)`` model outputs for ``token_ids``.
        token_ids: ``(B, T)`` the recorded sequences.
        temperature: The sampling temperature the logprobs must match (the engine's processed logprobs
            are taken after dividing the logits by it).

    Returns:
        ``(B, T - 1)`` logprobs, aligned with ``token_ids[:, 1:]``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: greedy samples have no logprobs to weigh")
    logp = torch.log_softmax(logits[:, :-1, :].float() / temperature, dim=-1)
    return logp.gather(-1, token_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def clipped_policy_loss(
    logp_current: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, LossStats]:
    """The clipped surrogate loss over the masked tokens of a batch.

    Args:
        logp_current: ``(B, L)`` logprobs under the policy being trained (requires grad).
        logp_behaviour: ``(B, L)`` recorded logprobs of the policy that sampled each token (any value
            where ``mask`` is 0).
        advantages: ``(B,)`` one advantage per sequence (GRPO), or ``(B, L)`` per token.
        mask: ``(B, L)`` 1 for sampled tokens, 0 elsewhere.
        clip_low: ``eps_low``: ratios below ``1 - clip_low`` are clipped.
        clip_high: ``eps_high``: ratios above ``1 + clip_high`` are clipped.

    Returns:
        The scalar loss (mean over masked tokens; 0 with no masked token) and its diagnostics.
    """
    if logp_current.shape != logp_behaviour.shape or logp_current.shape != mask.shape:
        raise ValueError(
            f"shapes differ: current {tuple(logp_current.shape)}, behaviour {tuple(logp_behaviour.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"clip range (1 - {clip_low}, 1 + {clip_high}) is empty or negative")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    adv = adv.expand_as(logp_current).to(logp_current.dtype)
    m = mask.to(logp_current.dtype)
    # Where the mask is 0 the behaviour logprob is a placeholder: compare the token with itself there, so
    # neither an inf nor a NaN can leak through the zero weight into the gradient.
    behaviour = torch.where(m > 0, logp_behaviour.to(logp_current.dtype), logp_current.detach())
    log_ratio = logp_current - behaviour
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    n = m.sum()
    loss = (per_token * m).sum() / n.clamp(min=1.0)
    with torch.no_grad():
        count = int(n.item())
        denom = max(count, 1)
        outside = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).to(m.dtype)
        stats = LossStats(
            loss=float(loss.item()),
            tokens=count,
            mean_ratio=float((ratio * m).sum().item() / denom) if count else 1.0,
            clip_fraction=float((outside * m).sum().item() / denom),
            approx_kl=float((-log_ratio * m).sum().item() / denom),
        )
    return loss, stats
