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
