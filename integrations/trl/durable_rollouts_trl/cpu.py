"""Run TRL 1.16's ``AsyncGRPOTrainer`` on a machine without CUDA (tests and the CPU benchmark only).

``AsyncGRPOTrainer`` assumes a GPU in two places: its tree attention calls FlashAttention-3's
``flash_attn_varlen_func`` from the Hugging Face ``kernels`` hub (a CUDA kernel, downloaded at run time),
and its MFU accounting calls ``torch.cuda.get_device_name``. :func:`enable` replaces the first with the same
function in plain torch (per packed segment: causal attention, bottom-right aligned as FlashAttention
aligns ``seqlen_q < seqlen_k``) and the second with "peak FLOPs unknown" (TRL then skips its MFU metrics).
Nothing changes when CUDA is available. The loss, the packing and the optimiser are TRL's own.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **_: Any,
) -> torch.Tensor:
    """``(total_q, heads, dim)`` attention of each segment's queries over its keys (FlashAttention's API)."""
    if window_size != (-1, -1):
        raise NotImplementedError("sliding-window attention is not supported by the CPU stand-in")
    outs = []
    for i in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        c, d = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi, ki, vi = (x.transpose(0, 1) for x in (q[a:b], k[c:d], v[c:d]))
        mask = torch.ones(b - a, d - c, dtype=torch.bool, device=q.device).tril(diagonal=(d - c) - (b - a))
        o = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask if causal else None, scale=softmax_scale
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0)


def enable() -> bool:
    """Patch TRL's async GRPO module for CPU when CUDA is absent; returns whether it patched."""
    if torch.cuda.is_available():
        return False
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_mod
    import trl.experimental.async_grpo.packing as packing

    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)  # type: ignore[assignment]
    trainer_mod.get_peak_flops_per_device = lambda *a, **k: None
    return True
