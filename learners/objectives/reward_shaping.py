"""Reward shaping before the advantages: pure functions of a batch's scores and lengths."""

from __future__ import annotations

import torch
from torch import Tensor

from learners.objectives.advantages import token_rewards_from_scores


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


def per_group_sum(values: Tensor, group_ids: Tensor) -> Tensor:
    """``(B,)``: for each row, the sum of ``values`` (``(B,)``) over the rows sharing its group id
    (any comparable ids, not necessarily 0..G-1). Empty in, empty out."""
    if group_ids.numel() == 0:
        return values.clone()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1, dtype=values.dtype, device=values.device)
    sums.index_add_(0, inverse, values)
    return sums[inverse]


def centered_returns(rewards: Tensor, mask: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """Per-token rewards ``(B, T)`` with a mean return subtracted at each sequence's last action
    (reward centering, Naik, Wan, Tomar & Sutton 2024, "Reward Centering"):

        r'_t = r_t - c_b      at t = the last action of sequence b;   r'_t = r_t elsewhere

    with ``c_b`` the mean return of the batch's sequences (``group_ids`` None) or of the sequences
    that share b's group id (its prompt: GRPO's group baseline, Shao et al. 2024, without the
    division by the standard deviation).

    For undiscounted episodes that all end, a constant off every terminal reward of a prompt's
    episodes is potential-based shaping (Ng, Harada & Russell 1999, with the potential c on every
    non-terminal state of that prompt's tree): every Q and V there move by -c and the (soft)
    optimal policy is unchanged. What changes is learning from a start of Q = 0: a failed
    sequence's actions get a target below 0 instead of none at all, so they lose probability as a
    solved one's gain it; a group whose sequences all earned the same gets no signal. Rows with no
    action are left as they are and count in no mean. Returns float32 or wider."""
    valid = mask.bool()
    rows = valid.any(dim=1)
    out = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).clone()
    if not bool(rows.any()):
        return out
    returns = torch.where(valid, out, torch.zeros_like(out)).sum(dim=1)
    if group_ids is None:
        means = returns[rows].mean().expand(returns.shape)
    else:
        n = per_group_sum(rows.to(out.dtype), group_ids)
        total = per_group_sum(torch.where(rows, returns, torch.zeros_like(returns)), group_ids)
        means = total / n.clamp(min=1)
    return out - token_rewards_from_scores(means, valid)


def groups_with_signal(centered: Tensor, mask: Tensor, group_ids: Tensor, rtol: float = 1e-6) -> Tensor:
    """``(B,)`` bool: whether row b's group (the rows sharing its group id) has a centered reward
    ``centered`` (``centered_returns``' output) other than 0 at some action (``mask``).

    A group whose sequences all earned the same, reward for reward, has every centered reward 0:
    its Monte-Carlo targets are all 0, so a TD error there carries no reward, only the pull of Q
    toward its start (the prior, under calibration) — the rows a GRPO learner skips as having zero
    advantage (DAPO's dynamic sampling filters the same groups, Yu et al. 2025, sec. 3.2). Rewards
    at other turns count: equal returns earned at different times still give non-zero centered
    per-token rewards. "0" is within ``rtol`` of the largest centered reward at an action (or of 1):
    a mean of equal floats may miss them by an ulp. Rows without actions count for nothing."""
    valid = mask.bool()
    scale = float(centered.abs()[valid].max()) if bool(valid.any()) else 0.0
    nonzero = (centered.abs() > rtol * max(scale, 1.0)) & valid
    return per_group_sum(nonzero.any(dim=1).long(), group_ids) > 0
