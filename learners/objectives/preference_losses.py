"""Preference losses: the DPO family (Rafailov et al. 2023 and its variants) and the
Bradley–Terry reward-model loss, with the implicit rewards and their metrics.

Inputs are per-pair sequence log-probabilities ``(P,)``: the sum over the response tokens of
log pi(y_t | x, y_<t) for the chosen (w) and the rejected (l) response of each of P pairs, under
the policy and under the frozen reference. The loss is returned per pair, so that the caller
normalises by the global pair count across ranks and micro-batches.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from learners.objectives.registry import Registry
from torch import Tensor


def _dpo_log_ratio(chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor) -> Tensor:
    """h_theta = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l), ``(P,)``."""
    return (chosen - ref_chosen) - (rejected - ref_rejected)


# ------------------------------------------------------------ preference-loss registry --
# A preference loss is one function decorated with ``register_preference_loss``: it reads the
# pairs (``PreferenceInputs``) and returns the per-pair losses ``(P,)``. ``dpo.loss`` names it.


class PreferenceInputs(NamedTuple):
    """What a preference loss may read: ``(P,)`` summed response log-probs of the chosen and
    rejected responses under the policy and the reference (the reference's None for a loss
    registered with ``uses_reference=False``), the responses' token counts (may be None), and
    ``beta``, ``label_smoothing`` and ``simpo_gamma`` as in ``dpo.*``."""

    chosen_logps: Tensor
    rejected_logps: Tensor
    ref_chosen_logps: Optional[Tensor]
    ref_rejected_logps: Optional[Tensor]
    chosen_lengths: Optional[Tensor]
    rejected_lengths: Optional[Tensor]
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def log_ratio(self) -> Tensor:
        """h = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l), ``(P,)`` (needs the reference)."""
        return _dpo_log_ratio(self.chosen_logps, self.rejected_logps, self.ref_chosen_logps, self.ref_rejected_logps)


PreferenceLossFn = Callable[[PreferenceInputs], Tensor]


class PreferenceLossSpec(NamedTuple):
    """A registered preference loss: its function and whether it reads reference log-probs."""

    name: str
    fn: PreferenceLossFn
    uses_reference: bool


_PREFERENCE_LOSSES: Registry[PreferenceLossSpec] = Registry("preference loss")


def register_preference_loss(
    name: str, *, uses_reference: bool = True
) -> Callable[[PreferenceLossFn], PreferenceLossFn]:
    """Decorator: register ``fn(inputs: PreferenceInputs) -> (P,) losses`` as ``name``."""

    def add(fn: PreferenceLossFn) -> PreferenceLossFn:
        _PREFERENCE_LOSSES.add(name, PreferenceLossSpec(name, fn, uses_reference))
        return fn

    return add


def unregister_preference_loss(name: str) -> None:
    """Remove preference loss ``name`` (e.g. one a test registered); KeyError if there is none."""
    _PREFERENCE_LOSSES.remove(name)


def preference_loss_names() -> tuple[str, ...]:
    """Every registered preference loss, in registration order."""
    return _PREFERENCE_LOSSES.names()


def get_preference_loss(name: str) -> PreferenceLossSpec:
    """The preference loss registered as ``name``; a one-line ValueError naming the known ones."""
    return _PREFERENCE_LOSSES.get(name)


def uses_reference(name: str) -> bool:
    """Whether preference loss ``name`` compares against the reference's log-probs."""
    return get_preference_loss(name).uses_reference


def __getattr__(name: str) -> tuple[str, ...]:
    # PREFERENCE_LOSSES: a view of the registry at the moment it is read.
    if name == "PREFERENCE_LOSSES":
        return preference_loss_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_logsig = torch.nn.functional.logsigmoid


@register_preference_loss("sigmoid")
def _sigmoid_loss(x: PreferenceInputs) -> Tensor:
    """DPO; cDPO with label smoothing eps: ``-(1-eps) log sigma(beta h) - eps log sigma(-beta h)``."""
    h, eps = x.log_ratio(), x.label_smoothing
    return -(1.0 - eps) * _logsig(x.beta * h) - eps * _logsig(-x.beta * h)


@register_preference_loss("ipo")
def _ipo_loss(x: PreferenceInputs) -> Tensor:
    """IPO: ``(h - 1/(2 beta))^2``."""
    return (x.log_ratio() - 1.0 / (2.0 * x.beta)) ** 2


@register_preference_loss("hinge")
def _hinge_loss(x: PreferenceInputs) -> Tensor:
    """SLiC-HF's hinge: ``max(0, 1 - beta h)``."""
    return torch.relu(1.0 - x.beta * x.log_ratio())


@register_preference_loss("robust")
def _robust_loss(x: PreferenceInputs) -> Tensor:
    """Robust DPO for labels flipped with probability eps < 0.5."""
    eps = x.label_smoothing
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {eps}")
    h = x.log_ratio()
    return ((1.0 - eps) * -_logsig(x.beta * h) + eps * _logsig(-x.beta * h)) / (1.0 - 2.0 * eps)


@register_preference_loss("simpo", uses_reference=False)
def _simpo_loss(x: PreferenceInputs) -> Tensor:
    """SimPO: ``-log sigma(beta log pi(y_w)/|y_w| - beta log pi(y_l)/|y_l| - gamma)``."""
    if x.chosen_lengths is None or x.rejected_lengths is None:
        raise ValueError("simpo needs chosen_lengths and rejected_lengths")
    margin = (
        x.beta * x.chosen_logps / x.chosen_lengths.clamp(min=1)
        - x.beta * x.rejected_logps / x.rejected_lengths.clamp(min=1)
        - x.simpo_gamma
    )
    return -_logsig(margin)


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
        kind: a registered preference loss (``preference_loss_names()``).
        beta: inverse temperature of the implicit reward (SimPO: its reward scale).
        label_smoothing: eps for ``sigmoid`` and ``robust`` (``robust`` needs eps < 0.5).
        chosen_lengths, rejected_lengths: ``(P,)`` response token counts (``simpo`` only).
        simpo_gamma: SimPO's target reward margin gamma.

    Returns:
        ``(P,)`` losses; average them over the global batch.
    """
    spec = get_preference_loss(kind)
    if spec.uses_reference and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError(f"{kind} needs the reference log-probs")
    return spec.fn(
        PreferenceInputs(
            chosen_logps,
            rejected_logps,
            ref_chosen_logps,
            ref_rejected_logps,
            chosen_lengths,
            rejected_lengths,
            beta,
            label_smoothing,
            simpo_gamma,
        )
    )


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
            return (
                beta * chosen_logps / chosen_lengths.clamp(min=1),
                beta * rejected_logps / rejected_lengths.clamp(min=1),
            )
        return beta * (chosen_logps - ref_chosen_logps), beta * (rejected_logps - ref_rejected_logps)


def preference_metrics(
    chosen_rewards: Tensor, rejected_rewards: Tensor, chosen_logps: Tensor, rejected_logps: Tensor
) -> dict[str, Tensor]:
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


def bradley_terry_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, margin: float = 0.0, center_coef: float = 0.0
) -> Tensor:
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
