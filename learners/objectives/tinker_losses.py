"""The Tinker API's built-in losses (``loss_fn`` of ``forward_backward``) on one datum's per-token
log-probs, mapped onto this package's policy losses. Pure functions: tensors in, a scalar loss and
its metrics out; no config object.

Every loss is a **sum** over the datum's tokens (the API's ``loss:sum`` metric adds them over
datums), and position ``i`` scores target token ``i + 1`` of the model input (the inputs all have
the input's length ``N``). What each reads from ``loss_fn_inputs``:

* ``cross_entropy``: ``target_tokens``, ``weights`` (default 1);
  ``L = -sum_i w_i log p(y_i)``. Targets may be ``(N, K)`` with weights ``(N, K)`` (several
  target tokens per position, e.g. a teacher's top-K); the log-probs then have that shape too.
* ``importance_sampling``: ``target_tokens``, ``logprobs`` (the sampler's), ``advantages``;
  ``L = -sum_i exp(log p_i - log q_i) A_i`` (REINFORCE with an importance weight, Williams 1992
  with the off-policy correction; no clipping).
* ``ppo``: the same inputs; PPO's clipped surrogate (Schulman et al. 2017, eq. 7) as
  ``losses.policy_loss_clipped``, with the ratio bounds ``clip_low_threshold`` and
  ``clip_high_threshold`` (``loss_fn_config``; defaults 0.8 and 1.2).
* ``cispo``: the same inputs; CISPO's clipped stop-gradient weight
  (``policy_losses.policy_loss_cispo``, MiniMax-M1 eqs. 4-5), with the same bounds.

A missing input, a shape that is not the input's length, or a non-finite value is a
``ValueError`` naming the datum's field (the service answers it as the API's user error); an
unknown loss name is one too, listing the known ones.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from learners.objectives.losses import _LOG_RATIO_CLAMP, policy_loss_clipped
from learners.objectives.policy_losses import policy_loss_cispo

LossFn = Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]

_NEEDS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}


def loss_names() -> tuple[str, ...]:
    return tuple(_NEEDS)


def check_inputs(loss_fn: str, inputs: dict[str, Tensor], n: int) -> None:
    """Raises ``ValueError`` unless ``inputs`` are what ``loss_fn`` reads for a datum of ``n`` tokens."""
    if loss_fn not in _NEEDS:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; this service has {list(_NEEDS)}")
    for key in _NEEDS[loss_fn]:
        if key not in inputs:
            raise ValueError(f"loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]")
    target = inputs["target_tokens"]
    if target.dim() not in (1, 2) or target.shape[0] != n:
        raise ValueError(f"target_tokens has shape {list(target.shape)}; the model input has {n} tokens")
    for key, value in inputs.items():
        if key != "target_tokens" and value.shape != target.shape:
            raise ValueError(
                f"loss_fn_inputs[{key!r}] has shape {list(value.shape)}, target_tokens {list(target.shape)}"
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"loss_fn_inputs[{key!r}] holds a non-finite value")


def _row(x: Tensor) -> Tensor:
    return x.reshape(1, -1)


def cross_entropy(logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    weights = inputs.get("weights")
    w = torch.ones_like(logprobs) if weights is None else weights.to(logprobs.dtype)
    return -(logprobs * w).sum()


def importance_sampling(logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    log_ratio = logprobs - inputs["logprobs"].to(logprobs.dtype)
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    return -(ratio * inputs["advantages"].to(logprobs.dtype)).sum()


def _bounds(config: dict[str, float]) -> tuple[float, float]:
    low, high = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"clip thresholds must satisfy 0 <= low <= 1 <= high, got {low}, {high}")
    return low, high


def _clipped(policy_loss: Callable[..., tuple[Tensor, dict]]) -> LossFn:
    """A ratio-bounded policy loss of ``losses`` / ``policy_losses`` on one datum, summed over its
    tokens (one row, ``seq_mean_token_sum_norm`` with constant 1 is the row's sum)."""

    def loss(logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
        low, high = _bounds(config)
        rows = [_row(x) for x in (logprobs, inputs["logprobs"], inputs["advantages"])]
        value, _ = policy_loss(
            *rows, torch.ones_like(rows[0]), 1.0 - low, high - 1.0,
            loss_agg="seq_mean_token_sum_norm", loss_agg_constant=1.0,
        )  # fmt: skip
        return value

    return loss


ppo = _clipped(policy_loss_clipped)
cispo = _clipped(policy_loss_cispo)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
}
