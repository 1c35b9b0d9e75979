"""Reward shaping and advantage estimation for PPO-style RLHF.

Layout convention: every per-token tensor is ``(B, T)`` aligned to token
positions of the full sequence; ``mask`` ``(B, T)`` is 1 / True at response
tokens that train and 0 elsewhere. Masks may be bool or float.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from learners.losses import kl_penalty

__all__ = ["kl_shaped_rewards", "gae_advantages"]


def kl_shaped_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    beta: float,
    kl_kind: str = "k1",
    score_clip: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards: KL penalty at every token, task score at the last one.

    ``r_t = -beta * KL_t + [t == last valid token] * clip(score)``
    (Ziegler et al. 2019 / Ouyang et al. 2022 reward shaping), where
    ``KL_t = kl_penalty(logprobs, ref_logprobs, kl_kind)`` masked to 0 outside
    ``mask``. The score is added at the LAST position of each row where
    ``mask`` is nonzero; rows with an all-zero mask receive no score.

    Args:
        scores: ``(B,)`` task reward per sequence.
        logprobs: ``(B, T)`` rollout-policy log-probs of the sampled tokens.
        ref_logprobs: ``(B, T)`` reference-policy log-probs of the same tokens.
        mask: ``(B, T)``; bool or float.
        beta: KL coefficient.
        kl_kind: estimator, one of ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``.
        score_clip: if given, scores are clamped to ``[-score_clip, score_clip]``.

    Returns:
        ``(rewards, kl)``, both ``(B, T)``; both are 0 at masked positions.
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs.shape)}, "
            f"ref_logprobs {tuple(ref_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"scores must be (B,)={tuple(logprobs.shape[:1])}, got {tuple(scores.shape)}")
    valid = mask.to(logprobs.dtype) != 0
    # where, not a multiply: padding log-probs may be -inf and 0 * inf = NaN.
    kl = torch.where(valid, kl_penalty(logprobs, ref_logprobs, kl_kind), torch.zeros_like(logprobs))
    rewards = -beta * kl

    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    T = logprobs.shape[1]
    positions = torch.arange(T, device=logprobs.device).expand_as(valid)
    # -1 for an all-zero row matches no position, so that row gets no score
    # (and no data-dependent branching / host sync is needed).
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)
    is_last = positions == last.unsqueeze(1)
    rewards = rewards + torch.where(
        is_last, scores.to(rewards.dtype).unsqueeze(1), torch.zeros_like(rewards)
    )
    return rewards, kl


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, eq. 16).

    ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``,
    ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns_t = A_t + V(s_t)``.

    Positions with ``mask == 0`` are SKIPPED: they contribute neither reward
    nor value, and "t+1" means the next position > t with ``mask == 1``. So
    prompt tokens, interior masked tokens and trailing padding are transparent,
    and the last valid token of each row bootstraps from value 0 (terminal).
    Implemented as a backward loop over T, vectorised over B with
    ``torch.where``, carrying the next valid token's value and advantage.

    Inputs are detached (advantages and returns are regression/policy-gradient
    targets, never differentiated through). Computation happens in at least
    float32 because a length-T recurrence in bf16 accumulates visible error.

    Args:
        rewards: ``(B, T)`` per-token rewards r_t (e.g. from ``kl_shaped_rewards``).
        values: ``(B, T)`` value estimates V(s_t) from the rollout.
        mask: ``(B, T)``; bool or float.
        gamma: discount factor.
        lam: GAE lambda (bias/variance trade-off).

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, 0 at masked positions,
        dtype ``promote(rewards, values, float32)``.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"expected matching (B, T) shapes: rewards {tuple(rewards.shape)}, "
            f"values {tuple(values.shape)}, mask {tuple(mask.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    with torch.no_grad():
        r = rewards.detach().to(dtype)
        v = values.detach().to(dtype)
        valid = mask.detach() != 0
        B, T = r.shape
        zeros = torch.zeros(B, dtype=dtype, device=r.device)
        next_value = zeros
        next_adv = zeros
        advs_reversed: list[Tensor] = []
        for t in range(T - 1, -1, -1):
            m_t = valid[:, t]
            delta = r[:, t] + gamma * next_value - v[:, t]
            adv_t = delta + gamma * lam * next_adv
            # where (not multiply) so garbage at skipped positions can't leak
            # into the carry even if it is inf/NaN.
            advs_reversed.append(torch.where(m_t, adv_t, zeros))
            next_value = torch.where(m_t, v[:, t], next_value)
            next_adv = torch.where(m_t, adv_t, next_adv)
        advantages = (
            torch.stack(advs_reversed[::-1], dim=1) if T > 0 else torch.zeros(B, 0, dtype=dtype, device=r.device)
        )
        returns = torch.where(valid, advantages + v, torch.zeros_like(advantages))
    return advantages, returns
