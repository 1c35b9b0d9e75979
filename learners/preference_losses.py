"""Preference losses: the DPO family (Rafailov et al. 2023 and its variants) and the
Bradley–Terry reward-model loss, with the implicit rewards and their metrics.

Inputs are per-pair sequence log-probabilities ``(P,)``: the sum over the response tokens of
log pi(y_t | x, y_<t) for the chosen (w) and the rejected (l) response of each of P pairs, under
the policy and under the frozen reference. The loss is returned per pair, so that the caller
normalises by the global pair count across ranks and micro-batches.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

PREFERENCE_LOSSES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "robust", "simpo")


def _dpo_log_ratio(chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor) -> Tensor:
    """h_theta = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l), ``(P,)``."""
    return (chosen - ref_chosen) - (rejected - ref_rejected)


def preference_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Optional[Tensor] = None,
    ref_rejected_logps: Optional[Tensor] = None,
    kind: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: Optional[Tensor] = None,
    rejected_lengths: Optional[Tensor] = None,
    simpo_gamma: float = 0.5,
) -> Tensor:
    """Per-pair preference loss, ``(P,)``. With h = log-ratio difference (``_dpo_log_ratio``):

    - ``sigmoid`` -- DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing eps
      (cDPO, Mitchell 2023): ``-(1-eps) log sigma(beta h) - eps log sigma(-beta h)``;
      eps = 0 is plain DPO.
    - ``ipo`` -- IPO (Azar et al. 2023, eq. 17): ``(h - 1/(2 beta))^2``.
    - ``hinge`` -- the SLiC-HF rank-calibration hinge (Zhao et al. 2023) on the reference-normalised
      log-ratio, margin 1/beta, scaled by beta: ``max(0, 1 - beta h)``.
    - ``robust`` -- "Provably Robust DPO" (Chowdhury et al. 2024), the de-biased loss for labels
      flipped with probability eps: ``[(1-eps)(-log sigma(beta h)) - eps(-log sigma(-beta h))] / (1 - 2 eps)``.
    - ``simpo`` -- SimPO (Meng et al. 2024, eq. 6), reference-free and length-normalised:
      ``-log sigma(beta log pi(y_w)/|y_w| - beta log pi(y_l)/|y_l| - gamma)``.

    Args:
        chosen_logps, rejected_logps: ``(P,)`` summed response log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: ``(P,)`` the same under the reference (unused, and
            may be None, for ``simpo``).
        kind: one of ``PREFERENCE_LOSSES``.
        beta: inverse temperature of the implicit reward (SimPO: its reward scale).
        label_smoothing: eps for ``sigmoid`` and ``robust`` (``robust`` needs eps < 0.5).
        chosen_lengths, rejected_lengths: ``(P,)`` response token counts (``simpo`` only).
        simpo_gamma: SimPO's target reward margin gamma.

    Returns:
        ``(P,)`` losses; average them over the global batch.
    """
    if kind not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {kind!r}; choose one of {PREFERENCE_LOSSES}")
    if kind == "simpo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("simpo needs chosen_lengths and rejected_lengths")
        margin = (beta * chosen_logps / chosen_lengths.clamp(min=1) - beta * rejected_logps / rejected_lengths.clamp(min=1)
                  - simpo_gamma)
        return -torch.nn.functional.logsigmoid(margin)
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"{kind} needs the reference log-probs")
    h = _dpo_log_ratio(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    logsig = torch.nn.functional.logsigmoid
    if kind == "sigmoid":
        return -(1.0 - label_smoothing) * logsig(beta * h) - label_smoothing * logsig(-beta * h)
    if kind == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    if kind == "hinge":
        return torch.relu(1.0 - beta * h)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    return ((1.0 - label_smoothing) * -logsig(beta * h) + label_smoothing * logsig(-beta * h)) / (1.0 - 2.0 * label_smoothing)


def preference_rewards(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Optional[Tensor] = None,
    ref_rejected_logps: Optional[Tensor] = None,
    beta: float = 0.1,
    chosen_lengths: Optional[Tensor] = None,
    rejected_lengths: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Implicit rewards ``(P,)`` of the chosen and rejected responses, detached.

    With a reference: r(x, y) = beta (log pi(y|x) - log pi_ref(y|x)) (DPO, eq. 5). Without one
    (SimPO): r(x, y) = beta log pi(y|x) / |y|.
    """
    with torch.no_grad():
        if ref_chosen_logps is None or ref_rejected_logps is None:
            if chosen_lengths is None or rejected_lengths is None:
                raise ValueError("reference-free rewards need chosen_lengths and rejected_lengths")
            return (beta * chosen_logps / chosen_lengths.clamp(min=1),
                    beta * rejected_logps / rejected_lengths.clamp(min=1))
        return beta * (chosen_logps - ref_chosen_logps), beta * (rejected_logps - ref_rejected_logps)


def preference_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor, chosen_logps: Tensor,
                       rejected_logps: Tensor) -> dict[str, Tensor]:
    """Per-pair sums ``(scalars)`` of the usual DPO metrics; divide by the global pair count.

    ``rewards/accuracy``: pairs whose chosen implicit reward exceeds the rejected one;
    ``rewards/margin``: chosen minus rejected reward; the rewards and log-probs themselves.
    """
    with torch.no_grad():
        return {
            "rewards/accuracy": (chosen_rewards > rejected_rewards).float().sum(),
            "rewards/margin": (chosen_rewards - rejected_rewards).sum(),
            "rewards/chosen": chosen_rewards.sum(),
            "rewards/rejected": rejected_rewards.sum(),
            "logps/chosen": chosen_logps.detach().sum(),
            "logps/rejected": rejected_logps.detach().sum(),
        }


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: float = 0.0,
                       center_coef: float = 0.0) -> Tensor:
    """Per-pair reward-model loss of a Bradley–Terry preference model ``(P,)``.

    InstructGPT (Ouyang et al. 2022) eq. 1: ``-log sigma(r(x, y_w) - r(x, y_l) - m)`` with an
    optional fixed margin ``m`` (Llama 2 uses a rating-dependent one), plus
    ``center_coef * (r_w + r_l)^2`` (Eisenstein et al. 2023), which pins the reward's free offset
    near 0 so that rewards stay on one scale across runs.

    chosen_rewards, rejected_rewards: ``(P,)`` scalar rewards of each pair's two responses.
    """
    loss = -torch.nn.functional.logsigmoid(chosen_rewards - rejected_rewards - margin)
    if center_coef:
        loss = loss + center_coef * (chosen_rewards + rejected_rewards) ** 2
    return loss

