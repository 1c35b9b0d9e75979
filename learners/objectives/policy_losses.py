"""Policy-gradient objectives beside PPO's clipped token ratio (``losses.policy_loss_clipped``):
GSPO's sequence-level ratio and CISPO's clipped, stop-gradient token weights. Pure functions on
``(B, T)`` tensors with the conventions of ``learners/objectives/losses.py`` (mask True at trained tokens;
an all-zero mask gives 0, never NaN; garbage at masked positions never reaches the result).

A policy loss is one function decorated with ``register_policy_loss(name)``, with the signature
of ``policy_loss_clipped``: ``fn(logprobs, old_logprobs, advantages, mask, clip_eps,
clip_eps_high=None, *, loss_agg, loss_agg_constant, weights) -> (loss, stats)``, stats holding at
least ``clip_frac`` and ``approx_kl``. ``policy_loss(kind, ...)`` looks one up by name
(``ppo.policy_loss``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from learners.objectives.registry import Registry
from learners.objectives.losses import _LOG_RATIO_CLAMP, agg_loss, masked_mean, policy_loss_clipped

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss (the signature of ``policy_loss_clipped``) as ``name``."""

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        _POLICY_LOSSES.add(name, fn)
        return fn

    return add


def unregister_policy_loss(name: str) -> None:
    """Remove policy loss ``name`` (e.g. one a test registered); KeyError if there is none."""
    _POLICY_LOSSES.remove(name)


def policy_loss_names() -> tuple[str, ...]:
    """Every registered policy loss, in registration order."""
    return _POLICY_LOSSES.names()


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; a one-line ValueError naming the known ones."""
    return _POLICY_LOSSES.get(name)


def __getattr__(name: str) -> tuple[str, ...]:
    # POLICY_LOSSES: a view of the registry at the moment it is read.
    if name == "POLICY_LOSSES":
        return policy_loss_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# PPO's clipped token ratio lives in learners/objectives/losses.py beside the other PPO losses.
register_policy_loss("ppo")(policy_loss_clipped)


@register_policy_loss("gspo")
def policy_loss_gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 3e-4,
    clip_eps_high: Optional[float] = None,
    *,
    loss_agg: str = "seq_mean_token_mean",
    loss_agg_constant: Optional[float] = None,
    weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7): one importance
    ratio per sequence, the geometric mean of its token ratios,

        s_i = exp( (1/|y_i|) sum_t log(pi(y_t) / pi_old(y_t)) ),
        L_i = -min( s_i A_i, clip(s_i, 1 - eps, 1 + eps_high) A_i ),

    clipped and weighted per sequence. ``A_i`` is the row's mean advantage over its mask (the
    group advantage of GRPO, constant along the row). ``L_i`` is spread over the row's tokens so
    that ``loss_agg`` reduces it: ``seq_mean_token_mean`` (the default) is the paper's
    ``(1/G) sum_i L_i``. The paper's clip ranges are small (3e-4 / 4e-4) because ``s_i`` is a
    per-token average. ``weights`` (rollout correction) multiply each token's log-ratio before
    the average. Rows without a masked token contribute 0.

    Stats: ``clip_frac`` (fraction of sequences clipped), ``approx_kl`` (token mean of
    0.5 * log-ratio^2), ``ratio_mean`` (mean sequence ratio)."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    valid = mask.to(logprobs.dtype) != 0
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if weights is not None:
        log_ratio = log_ratio * torch.where(valid, weights.detach(), torch.zeros_like(weights))
    n = valid.sum(-1).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = (log_ratio.sum(-1) / n).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    s = torch.exp(seq_log_ratio)
    adv = masked_mean(torch.where(valid, advantages.detach(), torch.zeros_like(advantages)), valid, dim=-1)
    unclipped, clipped = -adv * s, -adv * s.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_seq = torch.maximum(unclipped, clipped)
    loss = agg_loss(per_seq[:, None].expand_as(logprobs), valid, loss_agg, loss_agg_constant)
    has = valid.any(-1)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).to(logprobs.dtype), has),
            "approx_kl": masked_mean(0.5 * log_ratio.square(), valid),
            "ratio_mean": masked_mean(s, has),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


@register_policy_loss("cispo")
def policy_loss_cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 1.0,
    clip_eps_high: Optional[float] = None,
    *,
    loss_agg: str = "token_mean",
    loss_agg_constant: Optional[float] = None,
    weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eqs. 4-5): REINFORCE with a clipped, stop-gradient
    importance weight on every token, so no token's gradient is dropped (PPO's clip zeroes the
    gradient of clipped tokens):

        r_t = pi(y_t) / pi_old(y_t),   w_t = sg( clip(r_t, 1 - eps, 1 + eps_high) ),
        L = - agg( w_t A_t log pi(y_t) ).

    At ``r_t = 1`` its gradient is PPO's. The paper bounds only the top (``eps`` large, e.g. 1.0:
    no lower bound as ``r >= 0``) with ``eps_high`` e.g. 0.28 or 5. ``weights`` (rollout
    correction) multiply ``w_t``. Stats: ``clip_frac`` (tokens whose weight was clipped),
    ``approx_kl``, ``ratio_mean``."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    valid = mask.to(logprobs.dtype) != 0
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).detach()
    clipped = ratio.clamp(max(0.0, 1.0 - clip_eps), 1.0 + eps_high)
    w = clipped if weights is None else clipped * torch.where(valid, weights.detach(), torch.zeros_like(weights))
    adv = torch.where(valid, advantages.detach(), torch.zeros_like(advantages))
    lp = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    loss = agg_loss(-w * adv * lp, valid, loss_agg, loss_agg_constant)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped != ratio).to(logprobs.dtype), valid),
            "approx_kl": masked_mean(0.5 * log_ratio.square(), valid),
            "ratio_mean": masked_mean(ratio, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def policy_loss(
    kind: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    clip_eps_high: Optional[float] = None,
    **kwargs,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The objective registered as ``kind`` (``policy_loss_names()``); ValueError for another name."""
    return get_policy_loss(kind)(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high, **kwargs)
