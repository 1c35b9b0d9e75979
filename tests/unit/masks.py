"""Shared test data: ragged response masks shaped like real batches."""

from __future__ import annotations

import torch

B, T = 4, 7


def ragged_mask(seed: int, interior: bool = True) -> torch.Tensor:
    """(B, T) float64 mask: 1-2 prompt zeros, >=1 padding zero, optional interior zero."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        p = int(torch.randint(1, 3, (1,), generator=g))  # prompt length 1..2
        end = int(torch.randint(p + 3, T, (1,), generator=g))  # exclusive, <= T-1
        row = [0.0] * T
        for t in range(p, end):
            row[t] = 1.0
        if interior:
            k = int(torch.randint(p + 1, end - 1, (1,), generator=g))
            row[k] = 0.0
        rows.append(row)
    m = torch.tensor(rows, dtype=torch.float64)
    assert (m[:, 0] == 0).all() and (m[:, -1] == 0).all()
    return m
