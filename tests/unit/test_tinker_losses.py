"""The Tinker API's built-in losses (``learners/objectives/tinker_losses.py``) against hand values
and a naive per-token loop, and their refusals of malformed inputs."""

import math

import pytest
import torch

from learners.objectives.tinker_losses import LOSSES, check_inputs, loss_names


def _inputs(n: int = 4, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g) * 3
    inputs = {
        "target_tokens": torch.arange(n),
        "logprobs": logp + 0.5 * (torch.rand(n, generator=g) - 0.5),
        "advantages": torch.randn(n, generator=g),
        "weights": torch.rand(n, generator=g),
    }
    return logp.requires_grad_(), inputs


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    inputs = {"target_tokens": torch.tensor([1, 2, 3]), "weights": torch.tensor([0.0, 1.0, 2.0])}
    loss = LOSSES["cross_entropy"](logp, inputs, {})
    assert loss.item() == pytest.approx(2.0 + 1.0)
    loss.backward()
    assert logp.grad.tolist() == [-0.0, -1.0, -2.0]  # d/dlogp = -w: forward_backward_custom relies on it
    no_weights = LOSSES["cross_entropy"](logp, {"target_tokens": inputs["target_tokens"]}, {})
    assert no_weights.item() == pytest.approx(3.5)


def test_cross_entropy_takes_several_targets_per_position():
    logp = torch.tensor([[-1.0, -3.0], [-2.0, -4.0]])
    inputs = {"target_tokens": torch.tensor([[1, 2], [3, 4]]), "weights": torch.tensor([[0.5, 0.5], [1.0, 0.0]])}
    assert LOSSES["cross_entropy"](logp, inputs, {}).item() == pytest.approx(0.5 + 1.5 + 2.0)


def _naive(loss_fn: str, logp: list[float], q: list[float], adv: list[float], low: float, high: float) -> float:
    total = 0.0
    for lp, lq, a in zip(logp, q, adv):
        ratio = math.exp(lp - lq)
        if loss_fn == "importance_sampling":
            total += -ratio * a
        elif loss_fn == "ppo":
            total += -min(ratio * a, min(max(ratio, low), high) * a)
        else:  # cispo: the clipped weight is a constant; its value is -w A log p
            total += -min(max(ratio, low), high) * a * lp
    return total


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo"])
def test_the_policy_losses_equal_a_naive_loop(loss_fn):
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    for seed in range(5):
        logp, inputs = _inputs(6, seed)
        got = LOSSES[loss_fn](logp, inputs, config).item()
        want = _naive(loss_fn, logp.tolist(), inputs["logprobs"].tolist(), inputs["advantages"].tolist(), 0.9, 1.1)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_ppo_gives_no_gradient_to_a_token_clipped_in_the_direction_of_its_advantage():
    logp = torch.tensor([0.0, 0.0], requires_grad=True)
    # ratio e^0.5 ~ 1.65 > 1.2 with A > 0: clipped; ratio e^-0.5 ~ 0.61 < 0.8 with A > 0: not clipped
    inputs = {"target_tokens": torch.tensor([1, 2]), "logprobs": torch.tensor([-0.5, 0.5]), "advantages": torch.ones(2)}
    LOSSES["ppo"](logp, inputs, {}).backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() == pytest.approx(-math.exp(-0.5))


def test_malformed_inputs_are_refused_with_the_field_named():
    _, inputs = _inputs(4)
    with pytest.raises(ValueError, match="unknown loss_fn 'nope'"):
        check_inputs("nope", inputs, 4)
    with pytest.raises(ValueError, match="needs loss_fn_inputs\\['advantages'\\]"):
        check_inputs("ppo", {"target_tokens": inputs["target_tokens"], "logprobs": inputs["logprobs"]}, 4)
    with pytest.raises(ValueError, match="the model input has 5 tokens"):
        check_inputs("cross_entropy", inputs, 5)
    with pytest.raises(ValueError, match="'weights'\\] has shape \\[3\\]"):
        check_inputs("cross_entropy", {**inputs, "weights": torch.ones(3)}, 4)
    with pytest.raises(ValueError, match="'advantages'\\] holds a non-finite value"):
        check_inputs("importance_sampling", {**inputs, "advantages": torch.tensor([0.0, math.inf, 0.0, 0.0])}, 4)
    with pytest.raises(ValueError, match="clip thresholds"):
        LOSSES["ppo"](torch.zeros(4), inputs, {"clip_low_threshold": 1.5})
    assert set(loss_names()) == set(LOSSES)
