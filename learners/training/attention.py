"""Attention for short rows on the CPU: plain matrix multiplies where PyTorch's flash kernel is slow.

PyTorch's CPU flash-attention kernel (what transformers' ``sdpa`` runs there) is tuned for long
rows. At the learner's shapes (a packed GRPO group is ~160 tokens) its forward and backward
took 7 ms per layer against 2.5 ms for the same attention as two matrix multiplies and an fp32
softmax (SmolLM2, bf16, 2 groups x 9 heads x 160 x 160; docs/benchmarks.md). The matrix-multiply
form stores the (q, k) probabilities for the backward, so it is used only while that stays
small; longer rows, and every non-CPU device, keep ``sdpa``.

``ATTENTION`` is registered with transformers under its own name, with ``sdpa``'s mask format
(boolean, True = attend), so a model loaded with ``attn_implementation=ATTENTION`` takes the same
masks, custom 4-D ones included, as under ``sdpa``.
"""

from __future__ import annotations

import torch
from torch import nn

ATTENTION = "rayrlhf_short_sdpa"
SHORT_MAX_PAIRS = 256 * 256
"""Largest query x key count per head run as matrix multiplies (its fp32 probabilities are
256 KB per head and row at this bound)."""


def use_matmul_attention(device: torch.device, q_len: int, k_len: int) -> bool:
    """Whether a (q_len x k_len) attention runs as matrix multiplies (CPU, short) or sdpa."""
    return device.type == "cpu" and q_len * k_len <= SHORT_MAX_PAIRS


def matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    is_causal: bool,
) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v with an fp32 softmax (transformers' eager maths).

    Args:
        query: (B, H, q, D); key, value: (B, H_kv, k, D) with H a multiple of H_kv (GQA).
        mask: (B or 1, 1, q, k) boolean (True = attend) or additive float, or None.
        is_causal: with no mask, query i sees keys 0..i (sdpa's top-left alignment).
    Returns:
        (B, q, H, D), the layout transformers' attention functions return.
    """
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    q_len, k_len = query.shape[2], key.shape[2]
    if mask is None and is_causal:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            # The dtype's lowest value, not -inf: a fully masked row stays finite, as in sdpa's
            # padding rows, instead of becoming NaN.
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def short_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``matmul_attention`` for short rows on the CPU, else sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, k_len = query.shape[2], key.shape[2]
    extras = kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    if dropout or extras or not use_matmul_attention(query.device, q_len, k_len):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # sdpa's rule: causal only when no mask was built, and only for a causal module.
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    is_causal = q_len > 1 and attention_mask is None and is_causal
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return matmul_attention(query, key, value, attention_mask, scaling, bool(is_causal)), None


def register() -> str:
    """Registers ``ATTENTION`` with transformers (idempotent) and returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, short_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
