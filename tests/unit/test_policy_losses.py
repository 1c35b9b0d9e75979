"""GSPO clips one ratio per sequence (the geometric mean of its token ratios); CISPO weights every
token's REINFORCE term by a clipped, stop-gradient ratio, so clipped tokens keep their gradient;
DAPO's overlong punishment falls linearly over the buffer. Hand values, naive loops, gradients."""

import math

import pytest
import torch

from learners.objectives.losses import policy_loss_clipped
from learners.objectives.policy_losses import policy_loss, policy_loss_cispo, policy_loss_gspo
from learners.objectives.reward_shaping import overlong_penalty

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)


def test_gspo_hand_values():
    old = torch.zeros(2, 3)
    # Row 0: token log-ratios 0.2 and 0.0 -> s = exp(0.1); row 1: all 0.3 -> s = exp(0.3).
    new = torch.tensor([[0.2, 0.0, 9.0], [0.3, 0.3, 0.3]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    loss, stats = policy_loss_gspo(new, old, adv, MASK, clip_eps=0.2)
    s0, s1 = math.exp(0.1), math.exp(0.3)
    # Row 0: A > 0, s0 inside [0.8, 1.2]: -s0. Row 1: A < 0, s1 > 1.2: max(2 s1, 2 * 1.2) = 2 s1.
    assert float(loss.detach()) == pytest.approx((-s0 + 2 * s1) / 2, rel=1e-6)
    assert float(stats["clip_frac"]) == 0.0  # the clip binds only when it lowers the objective
    assert float(stats["ratio_mean"]) == pytest.approx((s0 + s1) / 2, rel=1e-6)
    loss.backward()
    # d/dlogp_t of -A_i s_i / G = -A_i s_i / (|y_i| G); nothing at the masked position.
    assert new.grad[0].tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0], rel=1e-5)
    assert new.grad[1].tolist() == pytest.approx([2 * s1 / 6] * 3, rel=1e-5)


def test_gspo_matches_a_naive_loop_and_clips_sequences_not_tokens():
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(4, 6, generator=g) * 0.1, torch.randn(4, 6, generator=g) * 0.1
    adv = torch.randn(4, 1, generator=g).expand(4, 6).clone()
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[:, 0] = True
    loss, _ = policy_loss_gspo(lp, old, adv, mask, clip_eps=0.02, clip_eps_high=0.05)
    want = []
    for i in range(4):
        ts = [t for t in range(6) if mask[i, t]]
        s = math.exp(sum(float(lp[i, t] - old[i, t]) for t in ts) / len(ts))
        a = float(adv[i, 0])
        want.append(max(-a * s, -a * min(max(s, 0.98), 1.05)))
    assert float(loss) == pytest.approx(sum(want) / 4, rel=1e-5)


def test_cispo_hand_values_and_clipped_tokens_keep_their_gradient():
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.0, math.log(2.0), math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss_cispo(new, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    w = [1.0, 1.28, 0.8]  # ratios 1, 2, 0.5 clipped to [0.8, 1.28]
    lp = [0.0, math.log(2.0), math.log(0.5)]
    assert float(loss.detach()) == pytest.approx(-sum(wi * a * l for wi, a, l in zip(w, [1, 1, -1], lp)) / 3, rel=1e-6)
    assert float(stats["clip_frac"]) == pytest.approx(2 / 3)
    loss.backward()
    # The weight is a constant: the gradient is -w A / N at every token, the clipped ones included.
    assert new.grad[0].tolist() == pytest.approx([-1.0 / 3, -1.28 / 3, 0.8 / 3], rel=1e-6)
    ppo_new = new.detach().clone().requires_grad_()
    policy_loss_clipped(ppo_new, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)[0].backward()
    assert ppo_new.grad[0, 1] == 0 and ppo_new.grad[0, 2] == 0  # PPO drops clipped tokens' gradient


def test_at_ratio_one_every_objective_has_the_ppo_gradient():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 1, generator=g).expand(3, 5).clone()
    mask = torch.ones(3, 5, dtype=torch.bool)
    grads = {}
    for kind in ("ppo", "gspo", "cispo"):
        lp = old.clone().requires_grad_()
        policy_loss(kind, lp, old, adv, mask, clip_eps=0.2, loss_agg="token_mean")[0].backward()
        grads[kind] = lp.grad
    torch.testing.assert_close(grads["gspo"], grads["ppo"])
    torch.testing.assert_close(grads["cispo"], grads["ppo"])


def test_masked_garbage_and_empty_rows_stay_out():
    lp = torch.tensor([[0.1, float("inf")], [float("nan"), float("nan")]], requires_grad=True)
    old = torch.tensor([[0.0, float("-inf")], [0.0, 0.0]])
    adv = torch.tensor([[1.0, float("nan")], [1.0, 1.0]])
    mask = torch.tensor([[True, False], [False, False]])
    for fn in (policy_loss_gspo, policy_loss_cispo):
        loss, stats = fn(lp, old, adv, mask, clip_eps=0.2, loss_agg="seq_mean_token_mean")
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(g).all() and g[1].abs().sum() == 0
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss("trpo", lp, old, adv, mask, clip_eps=0.2)


def test_overlong_punishment_falls_linearly_over_the_buffer():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    got = overlong_penalty(lengths, max_tokens=16, buffer=4, penalty=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    assert overlong_penalty(lengths, 16, 0).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="must not exceed"):
        overlong_penalty(lengths, 4, 8)


def test_the_learner_adds_the_overlong_punishment_to_the_scores(tiny_model_path):
    """A PPO learner with ``overlong_buffer`` takes the step a learner without it takes on the
    same batch with the punishment already added to the scores."""
    from tests.helpers.factories import experience, grouped_batch, make_learner, step_with_grads, tiny_lm

    lm = tiny_lm(tiny_model_path)
    groups = [0, 0, 0, 1, 1, 1]
    ids, att, rm = grouped_batch(lm.config.vocab_size, groups, seed=4)
    batch = experience(lm, ids, att, rm, [1.0, 0.0, 1.0, 0.5, 1.0, 0.0], groups=groups, ref_shift=None)
    lengths = batch.response_mask.sum(1)
    hp = {"advantage_estimator": "grpo", "kl_coef": 0.0}
    limit = int(lengths.max())
    shaped = overlong_penalty(lengths, limit, buffer=limit - int(lengths.min()) + 1, penalty=0.7)
    assert len(set(shaped.tolist())) > 2  # the batch's lengths fall across the buffer
    got, _ = step_with_grads(
        make_learner(
            tiny_model_path,
            ppo={**hp, "overlong_buffer": limit - int(lengths.min()) + 1, "overlong_penalty": 0.7},
            max_new_tokens=limit,
        ),
        batch,
    )
    want, _ = step_with_grads(
        make_learner(tiny_model_path, ppo=hp, max_new_tokens=limit), batch.replace(scores=batch.scores + shaped)
    )
    plain, _ = step_with_grads(make_learner(tiny_model_path, ppo=hp, max_new_tokens=limit), batch)
    torch.testing.assert_close(got["g"], want["g"])
    assert not torch.allclose(got["g"], plain["g"])
