"""``qlearn.value_grad``: the share of each TD error's gradient that moves its state's value (the
common level of the state's logits, which sampling ignores) rather than the policy. The values never
change; the gradient in the logits is ``e_a - (1 - w) p`` by hand; at 0 a token the policy is sure
of gets none, nor does a common shift of a state's logits; the learner's gradient equals one taken
by hand on ``log p(a|s)`` plus the detached level (0) or on the logit itself (1)."""

import pytest
import torch
import torch.nn.functional as F

from learners.objectives.td_losses import value_graded
from tests.helpers.factories import flat_grads, make_q_learner, mdp_batch, step_with_grads, taken_logits, tiny_lm


@pytest.mark.parametrize("weight", [0.0, 0.25, 1.0])
def test_values_are_the_same_and_the_logit_gradient_is_e_a_less_a_share_of_p(weight):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g).requires_grad_()
    actions = torch.randint(0, 7, (2, 3), generator=g)
    q, lse = taken_logits(logits, actions)
    out = value_graded(q, lse, weight)
    torch.testing.assert_close(out, q, atol=0, rtol=0)
    out.sum().backward()
    expected = F.one_hot(actions, 7).float() - (1 - weight) * torch.softmax(logits.detach(), 2)
    torch.testing.assert_close(logits.grad, expected)


def test_at_zero_a_sure_token_and_a_common_shift_get_no_gradient():
    logits = torch.tensor([[[14.0, 0.0, -1.0, 0.5], [0.3, 0.1, -0.2, 0.0]]], requires_grad=True)
    actions = torch.tensor([[0, 2]])
    value_graded(*taken_logits(logits, actions), 0.0).sum().backward()
    assert logits.grad[0, 0].abs().max() < 1e-5  # p(a) ~ 1: the policy cannot move it
    assert logits.grad[0, 1, 2] == pytest.approx(1 - float(torch.softmax(logits[0, 1].detach(), 0)[2]))
    torch.testing.assert_close(logits.grad.sum(2), torch.zeros(1, 2), atol=1e-6, rtol=0)  # a shift: none
    plain = logits.detach().clone().requires_grad_()
    value_graded(*taken_logits(plain, actions), 1.0).sum().backward()
    assert plain.grad[0, 0, 0] == 1.0  # plain Q-learning lifts the sure token's level all the same


def test_below_one_it_needs_the_logsumexp():
    q = torch.zeros(1, 2)
    assert value_graded(q, None, 1.0) is q
    with pytest.raises(ValueError, match="logsumexp"):
        value_graded(q, None, 0.5)


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_the_learners_gradient_is_the_td_gradient_taken_by_hand(tiny_model_path, weight):
    """Monte-Carlo targets (n_step 3 covers every episode), no regulariser: the learner's gradient is
    that of 1/2 (log p(a|s) + level - return-to-go)^2 over the actions, the level detached at 0."""
    hp = {"value_grad": weight, "conservative_weight": 0.0, "n_step": 3, "mc_lower_bound": False}
    learner = make_q_learner(tiny_model_path, train={"epochs": 1, "num_minibatches": 1}, qlearn=hp)
    batch = mdp_batch()
    mask, rewards, _ = learner.episodes(batch)
    got, metrics = step_with_grads(learner, batch)

    lm = tiny_lm(tiny_model_path)
    logits = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.float()
    returns = rewards.flip(1).cumsum(1).flip(1)  # gamma 1, one episode per row
    rows, cols = mask.nonzero(as_tuple=True)
    state = logits[rows, cols - 1]
    level = torch.logsumexp(state, 1)
    q = torch.log_softmax(state, 1).gather(1, batch.input_ids[rows, cols][:, None]).squeeze(1)
    q = q + (level.detach() if weight == 0 else level)
    loss = (0.5 * (q - returns[rows, cols]) ** 2).mean()
    loss.backward()
    want = flat_grads([p for p in lm.parameters() if p.requires_grad])
    torch.testing.assert_close(got["g"], want, atol=1e-5, rtol=1e-4)
    assert metrics["loss/td"] == pytest.approx(loss.item(), abs=1e-5)
    if weight == 0:  # and not the plain step's
        learner = make_q_learner(
            tiny_model_path, train={"epochs": 1, "num_minibatches": 1}, qlearn={**hp, "value_grad": 1.0}
        )
        plain, plain_metrics = step_with_grads(learner, batch)
        assert (plain["g"] - want).abs().max() > 1e-3
        assert plain_metrics["loss/td"] == pytest.approx(metrics["loss/td"], abs=1e-6)
