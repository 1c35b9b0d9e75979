"""``qlearn.state_value=reference``: a calibrated Q's TD error reads each state's value as the
reference's (0) instead of the online logits' soft value, so the log-ratio ``log p - log p_ref`` is
regressed on the target itself. By hand: the values are the log-ratio, unchanged by a common shift
of either model's logits; the gradient is the log-prob's (``e_a - p``); the learner's gradient
after the model has moved off the reference equals one taken by hand on full forward passes, and
differs from the soft value's (``state_value=model``), whose untrained level the TD errors carry;
bootstraps read 0, run no target pass and keep no target copy (and the Monte-Carlo bound lifts the targets it should);
the config refuses what it cannot run."""

import copy

import pytest
import torch
import torch.nn.functional as F

from cluster.config import ConfigError
from cluster.config.loading import load_config
from learners.objectives.td_losses import reference_valued
from tests.helpers.factories import flat_grads, make_q_learner, mdp_batch, step_with_grads, taken_logits, tiny_lm

HP = {
    "calibration": "reference",
    "conservative": "logsumexp",
    "conservative_weight": 0.0,
    "value_grad": 0.0,
    "n_step": 3,
    "mc_lower_bound": False,
}
TRAIN = {"epochs": 1, "num_minibatches": 1, "lr": 1e-2, "reference": "learners", "shared_prefix": False}


def test_the_value_is_the_log_ratio_and_the_gradient_the_log_probs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g).requires_grad_()
    ref = torch.randn(2, 3, 7, generator=g)
    actions = torch.randint(0, 7, (2, 3), generator=g)
    q, lse = taken_logits(logits, actions)
    ref_taken, ref_lse = taken_logits(ref, actions)
    out = reference_valued(q - ref_taken, lse, ref_lse)
    want = (F.log_softmax(logits, 2) - F.log_softmax(ref, 2)).gather(2, actions[..., None]).squeeze(2)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    torch.testing.assert_close(logits.grad, F.one_hot(actions, 7).float() - torch.softmax(logits.detach(), 2))
    # A common shift of a state's logits (either model's) changes neither value.
    shifted = reference_valued(q + 3.0 - (ref_taken - 2.0), lse + 3.0, ref_lse - 2.0)
    torch.testing.assert_close(shifted, out.detach())


def _hand_gradient(lm, ref_lm, batch, returns, mask) -> tuple[torch.Tensor, float]:
    """The gradient of 1/2 (log p(a|s) - log p_ref(a|s) - return-to-go)^2, meaned over the actions."""
    att = batch.attention_mask.long()
    logp = F.log_softmax(lm(input_ids=batch.input_ids, attention_mask=att).logits.float(), 2)
    with torch.no_grad():
        ref = F.log_softmax(ref_lm(input_ids=batch.input_ids, attention_mask=att).logits.float(), 2)
    rows, cols = mask.nonzero(as_tuple=True)
    actions = batch.input_ids[rows, cols]
    ratio = logp[rows, cols - 1].gather(1, actions[:, None]).squeeze(1) - ref[rows, cols - 1].gather(
        1, actions[:, None]
    ).squeeze(1)
    loss = (0.5 * (ratio - returns[rows, cols]) ** 2).mean()
    loss.backward()
    return flat_grads([p for p in lm.parameters() if p.requires_grad]), loss.item()


def test_the_learners_gradient_is_the_log_ratio_regression_by_hand(tiny_model_path):
    """One step moves the model off the reference (both variants take the same first step: at the
    reference every V is 0); the second step's gradient is the log-ratio regression's, by hand."""
    batch = mdp_batch()
    learners = {
        sv: make_q_learner(tiny_model_path, train=TRAIN, qlearn={**HP, "state_value": sv})
        for sv in ("reference", "model")
    }
    firsts = {sv: step_with_grads(q, batch)[0]["g"] for sv, q in learners.items()}
    torch.testing.assert_close(firsts["reference"], firsts["model"], atol=1e-5, rtol=1e-4)

    learner = learners["reference"]
    lm = copy.deepcopy(learner.model.lm).float()
    lm.zero_grad(set_to_none=True)
    mask, rewards, _ = learner.episodes(batch)
    returns = rewards.flip(1).cumsum(1).flip(1)  # gamma 1, n_step 3 covers each episode
    want, want_loss = _hand_gradient(lm, tiny_lm(tiny_model_path), batch, returns, mask)
    got, metrics = step_with_grads(learner, batch)
    torch.testing.assert_close(got["g"], want, atol=1e-5, rtol=1e-4)
    assert metrics["loss/td"] == pytest.approx(want_loss, abs=1e-5)
    soft, _ = step_with_grads(learners["model"], batch)  # the same weights, V(s) the model's own
    assert (soft["g"] - want).abs().max() > 1e-3


def test_bootstraps_read_zero_and_run_no_target_pass(tiny_model_path):
    """n_step 1: a target is the token's own reward, plus 0 where the soft value would bootstrap."""
    batch = mdp_batch()
    learner = make_q_learner(tiny_model_path, train=TRAIN, qlearn={**HP, "n_step": 1, "state_value": "reference"})
    metrics = learner.train_step(batch)
    mask, rewards, _ = learner.episodes(batch)
    assert metrics["learner/target_pass"] == 0.0
    assert learner.target_params == [] and metrics["learner/target_updates"] == 0.0  # no copy kept
    assert learner.evaluate(batch)["eval/q/target"] == pytest.approx(float(rewards[mask].mean()), abs=1e-6)
    soft = make_q_learner(tiny_model_path, train=TRAIN, qlearn={**HP, "n_step": 1})
    assert soft.train_step(batch)["learner/target_pass"] == 1.0 and len(soft.target_params) > 0
    # The Monte-Carlo bound lifts each target to its return-to-go where rewards follow: the first
    # two actions of A C EOS (0 0 1) and the first of A EOS (0 .3) and of B EOS (.1 .5), 4 of 7.
    bounded = make_q_learner(
        tiny_model_path, train=TRAIN, qlearn={**HP, "n_step": 1, "state_value": "reference", "mc_lower_bound": True}
    )
    assert bounded.evaluate(batch)["eval/q/mc_bound_active"] == pytest.approx(4 / 7)


def test_the_config_refuses_state_value_reference_without_calibration_or_with_a_level_gradient():
    base = [
        "run.algorithm=qlearn",
        "qlearn.state_value=reference",
        "train.reference=learners",
        "qlearn.conservative=logsumexp",
    ]
    with pytest.raises(ConfigError, match="state_value=reference"):
        load_config(None, base + ["qlearn.value_grad=0"])  # uncalibrated
    with pytest.raises(ConfigError, match="value_grad=0"):
        load_config(None, base + ["qlearn.calibration=reference"])  # value_grad 1
    load_config(None, base + ["qlearn.calibration=reference", "qlearn.value_grad=0"])
