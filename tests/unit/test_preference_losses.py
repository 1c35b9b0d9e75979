"""DPO-family losses against hand-computed values, a naive per-pair loop and autograd."""

import math

import pytest
import torch

from learners.objectives.preference_losses import (
    PREFERENCE_LOSSES,
    preference_loss,
    preference_metrics,
    preference_rewards,
)

# Two pairs. Pair 0: policy prefers the chosen more than the reference does (h = 1.0);
# pair 1: the other way round (h = -0.5).
PI_W = torch.tensor([-10.0, -12.0], dtype=torch.float64)
PI_L = torch.tensor([-14.0, -11.0], dtype=torch.float64)
REF_W = torch.tensor([-10.5, -11.5], dtype=torch.float64)
REF_L = torch.tensor([-13.5, -11.0], dtype=torch.float64)
LEN_W = torch.tensor([5.0, 4.0], dtype=torch.float64)
LEN_L = torch.tensor([7.0, 2.0], dtype=torch.float64)
H = [(-10.0 + 10.5) - (-14.0 + 13.5), (-12.0 + 11.5) - (-11.0 + 11.0)]  # [1.0, -0.5]


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _naive(kind: str, beta: float, eps: float, gamma: float) -> list[float]:
    out = []
    for i in range(2):
        h = H[i]
        if kind == "sigmoid":
            out.append(-(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h))
        elif kind == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        elif kind == "hinge":
            out.append(max(0.0, 1 - beta * h))
        elif kind == "robust":
            out.append(((1 - eps) * -_logsig(beta * h) - eps * -_logsig(-beta * h)) / (1 - 2 * eps))
        else:
            m = beta * PI_W[i].item() / LEN_W[i].item() - beta * PI_L[i].item() / LEN_L[i].item() - gamma
            out.append(-_logsig(m))
    return out


def _loss(kind: str, beta: float = 0.1, eps: float = 0.0, gamma: float = 0.5, **tensors):
    args = dict(
        chosen_logps=PI_W,
        rejected_logps=PI_L,
        ref_chosen_logps=REF_W,
        ref_rejected_logps=REF_L,
        chosen_lengths=LEN_W,
        rejected_lengths=LEN_L,
    )
    args.update(tensors)
    return preference_loss(kind=kind, beta=beta, label_smoothing=eps, simpo_gamma=gamma, **args)


def test_hand_computed_values():
    # DPO, beta 0.1: -log sigma(0.1) and -log sigma(-0.05).
    assert _loss("sigmoid").tolist() == pytest.approx([0.6443966600735709, 0.7184596480132914], abs=1e-12)
    # IPO, beta 0.1: (1 - 5)^2, (-0.5 - 5)^2.
    assert _loss("ipo").tolist() == pytest.approx([16.0, 30.25])
    # Hinge, beta 2: max(0, 1 - 2), max(0, 1 + 1).
    assert _loss("hinge", beta=2.0).tolist() == pytest.approx([0.0, 2.0])
    # SimPO, beta 2, gamma 0.5: margins 2(-2 + 2) - 0.5 = -0.5 and 2(-3 + 5.5) - 0.5 = 4.5.
    assert _loss("simpo", beta=2.0).tolist() == pytest.approx([-_logsig(-0.5), -_logsig(4.5)], abs=1e-12)


@pytest.mark.parametrize("kind", PREFERENCE_LOSSES)
@pytest.mark.parametrize("beta, eps, gamma", [(0.1, 0.0, 0.5), (0.5, 0.2, 1.0), (2.0, 0.1, 0.0)])
def test_matches_a_naive_loop(kind, beta, eps, gamma):
    assert _loss(kind, beta, eps, gamma).tolist() == pytest.approx(_naive(kind, beta, eps, gamma), abs=1e-12)


def test_label_smoothing_zero_is_plain_dpo_and_robust_zero_too():
    plain = -torch.nn.functional.logsigmoid(0.3 * torch.tensor(H, dtype=torch.float64))
    assert torch.allclose(_loss("sigmoid", beta=0.3, eps=0.0), plain)
    assert torch.allclose(_loss("robust", beta=0.3, eps=0.0), plain)
    # Smoothing pulls the loss of a confidently right pair up (it also pays for the flipped label).
    assert _loss("sigmoid", beta=0.3, eps=0.1)[0] > plain[0]


def test_simpo_needs_no_reference():
    with_ref = _loss("simpo", beta=2.0)
    without = preference_loss(PI_W, PI_L, kind="simpo", beta=2.0, chosen_lengths=LEN_W, rejected_lengths=LEN_L)
    assert torch.equal(with_ref, without)
    with pytest.raises(ValueError, match="lengths"):
        preference_loss(PI_W, PI_L, kind="simpo")
    with pytest.raises(ValueError, match="reference"):
        preference_loss(PI_W, PI_L, kind="sigmoid")


@pytest.mark.parametrize("kind", PREFERENCE_LOSSES)
def test_gradients_against_autograd_gradcheck(kind):
    # Hinge is not differentiable at its kink; these inputs keep beta*h away from 1.
    w = PI_W.clone().requires_grad_(True)
    l_ = PI_L.clone().requires_grad_(True)
    fn = lambda a, b: preference_loss(
        a, b, REF_W, REF_L, kind=kind, beta=0.7, label_smoothing=0.1, chosen_lengths=LEN_W, rejected_lengths=LEN_L
    ).sum()
    assert torch.autograd.gradcheck(fn, (w, l_))


def test_dpo_gradient_is_the_papers():
    # d/d log pi(y_w) of -log sigma(beta h) = -beta sigma(-beta h) (Rafailov et al. 2023, sec. 4).
    w = PI_W.clone().requires_grad_(True)
    _loss("sigmoid", beta=0.5, chosen_logps=w).sum().backward()
    expected = -0.5 * torch.sigmoid(-0.5 * torch.tensor(H, dtype=torch.float64))
    assert torch.allclose(w.grad, expected)


def test_rewards_and_metrics():
    rw, rl = preference_rewards(PI_W, PI_L, REF_W, REF_L, beta=0.1)
    assert rw.tolist() == pytest.approx([0.05, -0.05]) and rl.tolist() == pytest.approx([-0.05, 0.0])
    m = preference_metrics(rw, rl, PI_W, PI_L)
    assert m["rewards/accuracy"].item() == 1.0  # pair 0 right, pair 1 wrong
    assert m["rewards/margin"].item() == pytest.approx(0.1 - 0.05)
    assert m["logps/chosen"].item() == -22.0
    sw, sl = preference_rewards(PI_W, PI_L, beta=2.0, chosen_lengths=LEN_W, rejected_lengths=LEN_L)
    assert sw.tolist() == pytest.approx([-4.0, -6.0]) and sl.tolist() == pytest.approx([-4.0, -11.0])


def test_unknown_kind_and_bad_robust_smoothing_are_errors():
    with pytest.raises(ValueError, match="unknown preference loss"):
        _loss("dpo")
    with pytest.raises(ValueError, match="label_smoothing"):
        _loss("robust", eps=0.5)
