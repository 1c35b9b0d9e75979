"""Reward shaping before the advantages: pure functions of a batch's scores and lengths."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to ``max_tokens - buffer``
    tokens, then falling linearly to ``-penalty`` at ``max_tokens``, and ``-penalty`` beyond:

        R(L) = 0                                   if L <= L_max - L_cache
             = penalty * ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
             = -penalty                            if L > L_max

    added to each response's reward. ``buffer = 0`` gives zeros (off). Lengths are response
    tokens (``(B,)``, any numeric dtype); returns float32 ``(B,)``."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer > max_tokens:
        raise ValueError(f"overlong buffer ({buffer}) must not exceed the response limit ({max_tokens})")
    start = max_tokens - buffer
    over = (lengths.float() - start).clamp(min=0.0) / buffer
    return -penalty * over.clamp(max=1.0)


def centered_returns(rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards ``(B, T)`` with the batch's mean return subtracted at each sequence's last
    action (reward centering, Naik, Wan, Tomar & Sutton 2024, "Reward Centering"):

        r'_t = r_t - (1/B) sum_b sum_u r_{b,u}     at t = the last action of its sequence
        r'_t = r_t                                 elsewhere

    For undiscounted episodes that all end, one constant taken off every terminal reward is
    potential-based shaping (Ng, Harada & Russell 1999, with the potential c on every non-terminal
    state): every Q and V move by -c and the (soft) optimal policy is unchanged. What changes is
    learning from a start of Q = 0: a failed sequence's actions get a target below 0 instead of
    none at all, so they lose probability as a solved one's gain it. Rows with no action add no
    return but count in the mean's B only if they have actions. Returns float32 or wider."""
    valid = mask.bool()
    rows = valid.any(dim=1)
    if not bool(rows.any()):
        return rewards.clone()
    returns = torch.where(valid, rewards, torch.zeros_like(rewards)).sum(dim=1)
    mean = returns[rows].mean()
    T = valid.shape[1]
    last = (T - 1 - torch.argmax(valid.flip(1).long(), dim=1)).clamp(min=0)
    out = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).clone()
    idx = torch.nonzero(rows).squeeze(1)
    out[idx, last[idx]] -= mean.to(out.dtype)
    return out
