"""Loss functions and masked reductions for policy-gradient RLHF (PPO and the GRPO family).

Preference losses: ``learners/objectives/preference_losses.py``; token-level Q-learning:
``learners/objectives/td_losses.py``; the fused LM-head kernel: ``learners/training/logprob_kernel.py``.

Layout convention: every per-token tensor is ``(B, T)`` and aligned to token
positions of the full sequence. ``mask`` ``(B, T)`` is 1.0 / True at response
tokens that train and 0 elsewhere (prompt, padding, interior masked tokens).
Masks may be bool or float.

Every masked reduction divides by ``clamp(sum(mask), min=1)`` so that an
all-zero mask yields 0, never NaN.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "agg_loss",
    "LOSS_AGG_MODES",
    "kl_penalty",
    "KL_KINDS",
    "policy_loss_clipped",
    "ROLLOUT_CORRECTIONS",
    "rollout_importance_weights",
    "value_loss_clipped",
    "entropy_from_logits",
    "logprobs_from_logits",
]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")

LOSS_AGG_MODES: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

# exp(20) ~ 4.9e8: far beyond any ratio a sane update produces, yet small
# enough that exp() never overflows to inf (which would turn 0 * inf into NaN).
_LOG_RATIO_CLAMP: float = 20.0


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x * mask``, over all elements or along ``dim``.

    Args:
        x: ``(B, T)`` (any shape works).
        mask: same shape as ``x``; bool or float.
        dim: reduce only along this dimension if given.

    Returns:
        Scalar if ``dim`` is None, else ``x`` with ``dim`` reduced.
    """
    m = mask.to(x.dtype)
    # torch.where instead of a bare multiply: masked-out positions may hold
    # inf/NaN (e.g. log-probs of padding) and 0 * inf = NaN would leak through,
    # in the forward pass and in the gradient.
    masked = torch.where(m != 0, x * m, torch.zeros_like(x))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over masked entries: ``sum(x*mask) / clamp(sum(mask), min=1)``.

    Args:
        x: ``(B, T)`` (any shape works).
        mask: same shape as ``x``; bool or float.
        dim: reduce only along this dimension if given.

    Returns:
        Scalar if ``dim`` is None, else ``x`` with ``dim`` reduced. Rows / tensors
        with an all-zero mask give 0.
    """
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over masked entries (scalar).

    Args:
        x: ``(B, T)``.
        mask: ``(B, T)``; bool or float.
        unbiased: apply Bessel's correction ``n / (n - 1)`` where
            ``n = sum(mask) > 1``; with ``n <= 1`` the biased value (0) is kept.

    Returns:
        Scalar tensor; 0 for an all-zero mask.
    """
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = m.sum()
        # Branch-free so no host sync; clamp keeps the unused branch finite.
        correction = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
        var = var * correction
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean / unit variance using masked statistics.

    ``(x - mean) / sqrt(var + eps)`` with mean and (unbiased) variance taken
    over the masked entries only. If ``shift_mean`` is False the mean is added
    back, i.e. only the scale is normalised.

    The result is returned at EVERY position, including masked-out ones
    (those values are meaningless); callers must multiply by / select with
    ``mask`` before using them.

    Args:
        x: ``(B, T)``.
        mask: ``(B, T)``; bool or float.
        shift_mean: if False, return ``(x - mean) / std + mean``.
        eps: added to the variance for numerical stability.

    Returns:
        ``(B, T)``, same dtype as ``x``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def agg_loss(per_token: Tensor, mask: Tensor, mode: str = "token_mean", constant: Optional[float] = None) -> Tensor:
    """Reduce a per-token loss ``(B, T)`` to a scalar; the choice sets how
    sequences of different lengths are weighted in the gradient.

    With ``n_b = sum_t mask[b, t]`` the masked token count of row ``b`` and
    ``S = {b : n_b > 0}`` the rows that have at least one masked token:

    * ``"token_mean"``: ``sum_{b,t} mask*x / sum_b n_b`` -- every token weighs
      the same, so long responses are not down-weighted (DAPO, Yu et al. 2025,
      "token-level policy gradient loss", eq. 12). Identical to
      ``masked_mean(x, mask)``.
    * ``"seq_mean_token_mean"``: ``(1/|S|) sum_{b in S} (1/n_b) sum_t mask*x`` --
      every sequence weighs the same, so a token of a long response gets less
      gradient than one of a short response (original GRPO, Shao et al. 2024,
      DeepSeekMath eq. 3).
    * ``"seq_mean_token_sum_norm"``: ``(1/|S|) sum_{b in S} (1/constant) sum_t mask*x``
      -- the per-sequence ``1/n_b`` of GRPO is replaced by one constant
      (e.g. the maximum response length), which removes GRPO's response-length
      bias (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training",
      sec. 3.1). Requires ``constant``.

    Rows with an all-zero mask are excluded from the sequence mean in both
    ``seq_*`` modes (they would otherwise dilute it with zeros). An all-zero
    mask gives 0 (never NaN) with zero gradient in every mode, and
    non-finite values at masked-out positions never leak into the result or
    its gradient (see ``masked_sum``).

    Args:
        per_token: ``(B, T)`` per-token loss; the last dimension is the token
            axis (any leading shape works, all of it counts as "sequences").
        mask: same shape as ``per_token``; bool or float.
        mode: one of ``LOSS_AGG_MODES``.
        constant: the normaliser of ``"seq_mean_token_sum_norm"``; must be
            finite and > 0. Ignored by the other modes.

    Returns:
        Scalar tensor.

    Raises:
        ValueError: for an unknown ``mode``, or a missing / non-positive /
            non-finite ``constant`` in ``"seq_mean_token_sum_norm"``.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    if mode == "token_mean":
        # Exactly masked_mean, so that it is bit-identical to the behaviour of
        # the losses before the aggregation mode became configurable.
        return masked_mean(per_token, mask)

    m = mask.to(per_token.dtype)
    has_tokens = m.sum(dim=-1) > 0
    if mode == "seq_mean_token_mean":
        per_seq = masked_mean(per_token, m, dim=-1)  # empty rows -> 0, then excluded
    else:
        # `not (0 < c < inf)` also rejects NaN, which compares False to everything.
        if constant is None or not (0.0 < constant < float("inf")):
            raise ValueError(
                f"loss aggregation mode {mode!r} needs a finite constant > 0 "
                f"(e.g. the max response length), got {constant!r}"
            )
        per_seq = masked_sum(per_token, m, dim=-1) / constant
    return masked_mean(per_seq, has_tokens)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1") -> Tensor:
    """Per-token sample estimator of KL(pi || ref) from tokens sampled from pi.

    With ``log_ratio = logprobs - ref_logprobs`` = log(pi / ref)
    (J. Schulman, "Approximating KL divergence", 2020):

    * ``"k1"``: ``log_ratio`` -- unbiased, high variance, can be negative.
    * ``"k2"``: ``0.5 * log_ratio**2`` -- biased, low variance, >= 0.
    * ``"k3"``: ``exp(-log_ratio) - 1 + log_ratio`` -- unbiased, >= 0.
      ``log_ratio`` is clamped to [-20, 20] first so ``exp`` cannot overflow;
      beyond that range the estimate (and its gradient) saturates.
    * ``"abs"``: ``|log_ratio|``.

    Args:
        logprobs: ``(B, T)`` log pi(a_t | s_t) of the sampled tokens.
        ref_logprobs: ``(B, T)`` log ref(a_t | s_t) of the same tokens.
        kind: one of ``KL_KINDS``.

    Returns:
        ``(B, T)`` per-token estimate (not masked).

    Raises:
        ValueError: for an unknown ``kind``.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        lr = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        # expm1 keeps precision near lr = 0, where exp(-lr) - 1 + lr cancels
        # catastrophically; the final clamp only absorbs last-ulp rounding so
        # the estimator is >= 0 as it is mathematically.
        return (torch.expm1(-lr) + lr).clamp(min=0)
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"Unknown KL estimator kind {kind!r}; expected one of {KL_KINDS}")


def full_kl(logits: Tensor, ref_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Exact per-position KL(pi || ref) over the whole vocabulary, not a sampled estimate.

    ``KL = sum_v pi(v) (log pi(v) - log ref(v))`` with ``pi = softmax(logits / T)`` and
    ``ref = softmax(ref_logits / T)`` (the reward-shaping KL of Ziegler et al., "Fine-Tuning
    Language Models from Human Preferences", 2019, eq. 2, taken in expectation over the next token
    instead of at the sampled one; PaLM-rlhf-style trainers use it this way). Its gradient
    reaches ``logits`` only (the reference is frozen): ``dKL/dz_v = pi(v) (log pi(v) - log ref(v)
    - KL) / T``. Computed in float32; ``>= 0`` up to rounding, exactly 0 where the rows agree.

    Args:
        logits: ``(N, V)`` the policy's logits at N positions.
        ref_logits: ``(N, V)`` the reference's logits at the same positions (no gradient).
        temperature: the sampling temperature both distributions are taken at.

    Returns:
        ``(N,)`` float32.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    logq = torch.log_softmax(ref_logits.detach().float() / temperature, dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def policy_loss_clipped(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    *,
    loss_agg: str = "token_mean",
    loss_agg_constant: Optional[float] = None,
    weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017, eq. 7), token-mean by default.

    ``ratio = exp(logprobs - old_logprobs)``;
    ``loss = masked_mean(max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high)))``
    which is the negation of L^CLIP (max of negatives == min of positives).

    ``clip_eps_high`` defaults to ``clip_eps`` (symmetric PPO); setting it
    larger gives the decoupled "clip-higher" variant (DAPO, Yu et al. 2025).
    ``loss_agg`` picks how the per-token losses are reduced (``agg_loss``);
    the default ``"token_mean"`` is the ``masked_mean`` above.
    The log-ratio is zeroed at masked positions and clamped to [-20, 20]
    before ``exp`` so garbage at padding can never produce inf/NaN in the
    loss or its gradient.

    Args:
        logprobs: ``(B, T)`` log-probs of the taken tokens under the current
            policy (requires grad).
        old_logprobs: ``(B, T)`` log-probs under the behaviour policy.
        advantages: ``(B, T)`` advantage estimates A_t (treated as constants).
        mask: ``(B, T)``; bool or float.
        clip_eps: lower clip range, epsilon in eq. 7.
        clip_eps_high: upper clip range; None -> ``clip_eps``.
        loss_agg: reduction of the per-token loss, one of ``LOSS_AGG_MODES``.
        loss_agg_constant: ``constant`` of ``agg_loss`` (needed by
            ``"seq_mean_token_sum_norm"``).
        weights: optional ``(B, T)`` per-token factors of the loss, treated as
            constants (e.g. ``rollout_importance_weights``: the correction from
            the rollout policy that sampled the tokens to the old policy).

    Returns:
        ``(loss, stats)``: scalar loss, and detached scalars -- token means
        over the mask whatever ``loss_agg`` is --
        ``"clip_frac"`` (masked fraction of tokens where the clipped branch is
        strictly active, i.e. ``-A*clipped > -A*ratio``),
        ``"approx_kl"`` (masked mean of the k2 estimator
        ``0.5 * (logprobs - old_logprobs)**2`` of KL(old || new)), and
        ``"ratio_mean"`` (masked mean of ``ratio``).
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    valid = mask.to(logprobs.dtype) != 0
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, advantages.detach(), torch.zeros_like(advantages))

    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    if weights is not None:
        per_token = per_token * torch.where(valid, weights.detach(), torch.zeros_like(weights))
    loss = agg_loss(per_token, valid, loss_agg, loss_agg_constant)

    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((loss_clipped > loss_unclipped).to(logprobs.dtype), valid),
            "approx_kl": masked_mean(0.5 * log_ratio.square(), valid),
            "ratio_mean": masked_mean(ratio, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


ROLLOUT_CORRECTIONS: tuple[str, ...] = ("none", "truncate", "mask")


def rollout_importance_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    mode: str = "truncate",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level importance weights from the rollout policy mu that sampled the tokens (the
    inference engine: other kernels, other precision, or older weights) to the learner's old
    policy pi_old, whose ratio PPO clips.

    ``w_t = pi_old(a_t | s_t) / mu(a_t | s_t) = exp(old_logprobs - rollout_logprobs)``, then

    * ``"truncate"``: ``min(w_t, cap)`` -- truncated importance sampling (Ionides 2008; the
      "TIS" correction of Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
      Off-Policy RL Training", eq. 4), which bounds the variance a rare token can add;
    * ``"mask"``: ``1[low <= w_t <= high]`` -- tokens whose ratio leaves the band are left out
      of the loss (weight 0; they stay in its normaliser) and the rest are not reweighted;
    * ``"none"``: all ones.

    The weights are constants of the gradient. The log-ratio is zeroed at masked positions and
    clamped to [-20, 20] before ``exp``.

    Args:
        old_logprobs: ``(B, T)`` log pi_old of the taken tokens (the learner's pass).
        rollout_logprobs: ``(B, T)`` log mu of the same tokens (the generator's).
        mask: ``(B, T)``; bool or float.
        mode: one of ``ROLLOUT_CORRECTIONS``.
        cap: upper bound of ``"truncate"``; > 0.
        low, high: the band of ``"mask"``; ``0 <= low <= 1 <= high``.

    Returns:
        ``(weights, stats)``: ``(B, T)`` weights (0 at masked positions) and detached token
        means over the mask: ``"gap_mean_abs"`` (|log pi_old - log mu|), ``"kl_k3"`` (k3 estimate
        of KL(mu || pi_old) from mu's samples), ``"ratio_mean"`` (w before the correction),
        ``"weight_mean"`` and ``"corrected_frac"`` (tokens truncated or masked).

    Raises:
        ValueError: for an unknown ``mode`` or a bad ``cap`` / band.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"Unknown rollout correction {mode!r}; expected one of {ROLLOUT_CORRECTIONS}")
    if not cap > 0 or not 0 <= low <= 1 <= high:
        raise ValueError(f"need cap > 0 and 0 <= low <= 1 <= high, got cap={cap}, low={low}, high={high}")
    valid = mask.to(old_logprobs.dtype) != 0
    with torch.no_grad():
        log_ratio = torch.where(valid, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs))
        log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        if mode == "truncate":
            weights = ratio.clamp(max=cap)
            corrected = ratio > cap
        elif mode == "mask":
            inside = (ratio >= low) & (ratio <= high)
            weights = inside.to(ratio.dtype)
            corrected = ~inside
        else:
            weights = torch.ones_like(ratio)
            corrected = torch.zeros_like(valid)
        weights = torch.where(valid, weights, torch.zeros_like(weights))
        stats = {
            "gap_mean_abs": masked_mean(log_ratio.abs(), valid),
            # Tokens come from mu: log(mu / pi_old) = -log_ratio, and k3 estimates KL(mu || pi_old).
            "kl_k3": masked_mean(kl_penalty(-log_ratio, torch.zeros_like(log_ratio), "k3"), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "weight_mean": masked_mean(weights, valid),
            "corrected_frac": masked_mean(corrected.to(ratio.dtype), valid),
        }
    return weights, stats


def value_loss_clipped(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    *,
    loss_agg: str = "token_mean",
    loss_agg_constant: Optional[float] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value-function loss (PPO2 baselines / Schulman et al. 2017 code).

    ``values_clipped = old_values + clamp(values - old_values, -clip_eps, clip_eps)``;
    ``loss = 0.5 * masked_mean(max((values - returns)**2, (values_clipped - returns)**2))``.
    Taking the max makes the loss pessimistic: the value head gets no credit
    for moving further than ``clip_eps`` from the rollout-time estimate.
    ``loss_agg`` replaces the ``masked_mean`` by another ``agg_loss`` mode.

    Args:
        values: ``(B, T)`` current value predictions (requires grad).
        old_values: ``(B, T)`` value predictions at rollout time.
        returns: ``(B, T)`` regression targets (e.g. GAE returns).
        mask: ``(B, T)``; bool or float.
        clip_eps: value clip range (absolute, in value units).
        loss_agg: reduction of the per-token loss, one of ``LOSS_AGG_MODES``.
        loss_agg_constant: ``constant`` of ``agg_loss`` (needed by
            ``"seq_mean_token_sum_norm"``).

    Returns:
        ``(loss, stats)``: scalar loss and detached scalar ``"vf_clip_frac"``
        (masked fraction of tokens where the clipped loss is strictly larger;
        a token mean whatever ``loss_agg`` is).
    """
    values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    loss_unclipped = (values - returns).square()
    loss_clipped = (values_clipped - returns).square()
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    loss = 0.5 * agg_loss(per_token, mask, loss_agg, loss_agg_constant)
    with torch.no_grad():
        vf_clip_frac = masked_mean((loss_clipped > loss_unclipped).to(values.dtype), mask)
    return loss, {"vf_clip_frac": vf_clip_frac.detach()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` along the last dimension.

    ``H = logsumexp(z) - sum(softmax(z) * z)``, which is
    ``-sum p log p`` rewritten so no ``log`` of an underflowed probability is
    ever taken. Logits are shifted by their (detached) row max first: H is
    shift-invariant, and without the shift ``logsumexp(z)`` and
    ``sum(p*z)`` are both ~max(z) and cancel catastrophically for large
    logits. Logits must be finite (``-inf`` gives ``0 * -inf = NaN``); mask
    vocabulary entries with a large negative number instead. Computed in the
    dtype of ``logits``; upcast bf16 logits first if precision matters.

    Args:
        logits: ``(..., V)``, e.g. ``(B, T, V)``.

    Returns:
        ``(...)``, e.g. ``(B, T)``.
    """
    z = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``.

    Equal to ``log_softmax(logits).gather(-1, labels)`` but computed as
    ``gather(logits) - logsumexp(logits)`` so that no second V-sized tensor
    (the full log-softmax) is materialised -- V is ~1e5 for LLMs.

    Args:
        logits: ``(..., V)``, e.g. ``(B, T, V)``.
        labels: ``(...)`` int64 token ids, e.g. ``(B, T)``.

    Returns:
        ``(...)`` log-probs, same dtype as ``logits``.
    """
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
