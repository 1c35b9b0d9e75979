"""The importance correction from the rollout policy to the learner's old policy: weights, caps
and masks on a hand-made batch, against a naive loop, and inside a PPO step (through the
gradient it steps with)."""

import math

import pytest
import torch

from learners.objectives.losses import policy_loss_clipped, rollout_importance_weights
from tests.helpers.factories import experience, flat_grads, make_learner, ragged_batch, tiny_lm

# Two rows of four positions; row 1's last position is padding (mask 0) holding garbage.
OLD = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-3.0, -0.2, -1.0, 50.0]])
ROLLOUT = torch.tensor([[-1.0, -3.0, -0.1, -2.5], [-1.0, -0.2, -1.1, -40.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
# w = exp(old - rollout): e^0, e^1, e^-0.4, e^1.5 / e^-2, e^0, e^0.1 (padding: none)
W = [[1.0, math.e, math.exp(-0.4), math.exp(1.5)], [math.exp(-2.0), 1.0, math.exp(0.1), 0.0]]


def test_truncated_weights_by_hand():
    w, stats = rollout_importance_weights(OLD, ROLLOUT, MASK, "truncate", cap=2.0)
    expected = torch.tensor([[1.0, 2.0, math.exp(-0.4), 2.0], [math.exp(-2.0), 1.0, math.exp(0.1), 0.0]])
    torch.testing.assert_close(w, expected)
    assert float(stats["corrected_frac"]) == pytest.approx(2 / 7)  # e and e^1.5 were capped
    assert float(stats["weight_mean"]) == pytest.approx(float(expected.sum()) / 7)
    assert float(stats["ratio_mean"]) == pytest.approx(sum(sum(r) for r in W) / 7)
    assert float(stats["gap_mean_abs"]) == pytest.approx((0 + 1 + 0.4 + 1.5 + 2 + 0 + 0.1) / 7)


def test_masked_weights_by_hand():
    w, stats = rollout_importance_weights(OLD, ROLLOUT, MASK, "mask", low=0.5, high=2.0)
    # in the band: 1, e^-0.4 (0.67), 1, e^0.1; out: e (2.72), e^1.5, e^-2 (0.14)
    expected = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert float(stats["corrected_frac"]) == pytest.approx(3 / 7)


def test_weights_against_a_naive_loop():
    g = torch.Generator().manual_seed(3)
    old, rollout = -torch.rand(5, 9, generator=g) * 3, -torch.rand(5, 9, generator=g) * 3
    mask = torch.rand(5, 9, generator=g) > 0.3
    for mode, kw in (("truncate", {"cap": 1.5}), ("mask", {"low": 0.6, "high": 1.7}), ("none", {})):
        w, stats = rollout_importance_weights(old, rollout, mask, mode, **kw)
        kl, n = 0.0, 0
        for i in range(5):
            for t in range(9):
                r = math.exp(float(old[i, t] - rollout[i, t]))
                if not mask[i, t]:
                    want = 0.0
                elif mode == "truncate":
                    want = min(r, 1.5)
                elif mode == "mask":
                    want = 1.0 if 0.6 <= r <= 1.7 else 0.0
                else:
                    want = 1.0
                assert float(w[i, t]) == pytest.approx(want, rel=1e-5), (mode, i, t)
                if mask[i, t]:
                    x = float(rollout[i, t] - old[i, t])  # log(mu / pi_old) of a token sampled from mu
                    kl += math.exp(-x) - 1 + x
                    n += 1
        assert float(stats["kl_k3"]) == pytest.approx(kl / n, rel=1e-5)


def test_weights_are_constants_and_never_nan():
    old = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    w, _ = rollout_importance_weights(old, torch.tensor([[-100.0, 0.0]]), torch.tensor([[1, 0]]), "truncate", cap=3.0)
    assert not w.requires_grad and torch.isfinite(w).all() and float(w[0, 0]) == 3.0 and float(w[0, 1]) == 0.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="Unknown rollout correction"):
        rollout_importance_weights(OLD, ROLLOUT, MASK, "clip")
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        rollout_importance_weights(OLD, ROLLOUT, MASK, "mask", low=1.2, high=2.0)


def test_weighted_policy_loss_scales_each_tokens_gradient():
    """The per-token weight multiplies that token's term of the clipped loss (and its gradient)."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g)).requires_grad_(True)
    old = logp.detach() - 0.05
    adv = torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    w = torch.rand(3, 5, generator=g) * 2
    loss_w, _ = policy_loss_clipped(logp, old, adv, mask, weights=w)
    (grad_w,) = torch.autograd.grad(loss_w, logp)
    loss, _ = policy_loss_clipped(logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad_w, grad * w)
    ones, _ = policy_loss_clipped(logp, old, adv, mask, weights=torch.ones(3, 5))
    torch.testing.assert_close(ones, loss)


def _grad(path, exp, ppo):
    learner = make_learner(
        path,
        train={"lr": 1e-2, "epochs": 1, "num_minibatches": 1, "micro_batch_size": 6},
        ppo={"advantage_estimator": "grpo", "kl_coef": 0.0, **ppo},
    )
    captured = []
    learner.on_gradients = lambda params: captured.append(flat_grads(params))
    return learner.train_step(exp), captured[0]


def test_the_correction_inside_a_ppo_step(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    exp = experience(lm, ids, att, rm, [1.0, 0.0, 0.5, 0.0, 1.0, 0.2], groups=[0, 0, 0, 1, 1, 1], ref_shift=None)
    m_none, g_none = _grad(tiny_model_path, exp, {})
    assert "rollout_is/weight_mean" not in m_none and m_none["logprob_gap/kl_k3"] < 1e-6
    # Same weights sampled the batch: every ratio is 1, the correction changes nothing.
    m_same, g_same = _grad(tiny_model_path, exp, {"rollout_correction": "truncate"})
    assert m_same["rollout_is/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(g_same, g_none, atol=1e-6, rtol=1e-4)
    # A rollout policy that gave every token 1.0 nat more than the learner: w = e^-1 per token, so
    # truncated IS scales the policy gradient by e^-1 (the critic-free step has no other term).
    shifted = exp.replace(rollout_logprobs=exp.rollout_logprobs + rm.float())
    m_trunc, g_trunc = _grad(tiny_model_path, shifted, {"rollout_correction": "truncate", "rollout_is_cap": 2.0})
    assert m_trunc["rollout_is/weight_mean"] == pytest.approx(math.exp(-1), rel=1e-4)
    assert m_trunc["logprob_gap/mean_abs"] == pytest.approx(1.0, rel=1e-4)
    assert m_trunc["logprob_gap/kl_k3"] == pytest.approx(math.exp(-1) - 1 + 1, rel=1e-4)
    torch.testing.assert_close(g_trunc, g_none * math.exp(-1), atol=1e-6, rtol=1e-4)
    # Masked: e^-1 = 0.37 is outside [0.5, 2]: every token is left out, no policy gradient.
    m_mask, g_mask = _grad(tiny_model_path, shifted, {"rollout_correction": "mask"})
    assert m_mask["rollout_is/corrected_frac"] == pytest.approx(1.0)
    assert g_mask.abs().max() == 0.0 and m_mask["loss/policy"] == 0.0
