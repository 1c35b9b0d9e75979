"""In a multi-turn record the environment's observation tokens are context, not actions: they
get no advantage and no gradient, and the PPO/GRPO loss is the one computed on the model's
tokens alone — whatever log-probs or values sit at the observation positions."""

import torch

from learners.objectives.advantages import gae_advantages, group_baseline_advantages
from learners.experience import Experience
from learners.training.modeling import sequence_logprobs
from tests.helpers.factories import make_learner, step_with_grads, tiny_lm

# Per row: prompt 5, turn 1 (4 actions), observation 3, turn 2 (4 actions), then padding.
PROMPT, TURN, OBS = 5, 4, 3
LENGTH = PROMPT + TURN + OBS + TURN + 2


def _multi_turn_batch(lm, scores: list[float]) -> Experience:
    g = torch.Generator().manual_seed(0)
    b = len(scores)
    ids = torch.randint(3, lm.config.vocab_size, (b, LENGTH), generator=g)
    ids[:, :PROMPT] = ids[0, :PROMPT]  # one prompt per pair of rows
    att = torch.ones(b, LENGTH, dtype=torch.bool)
    att[:, -2:] = False
    act = torch.zeros_like(att)
    act[:, PROMPT : PROMPT + TURN] = True
    act[:, PROMPT + TURN + OBS : PROMPT + 2 * TURN + OBS] = True
    with torch.no_grad():
        lp = sequence_logprobs(lm, ids, att, act)
    return Experience(
        input_ids=ids,
        attention_mask=att,
        response_mask=act,
        rollout_logprobs=lp,
        group_ids=torch.tensor([0, 0, 1, 1]),
        truncated=torch.zeros(b, dtype=torch.bool),
        policy_version=0,
        completions=[""] * b,
        meta=[{}] * b,
        scores=torch.tensor(scores),
        ref_logprobs=lp.clone(),
    ).validate()


def _observations(exp: Experience) -> torch.Tensor:
    return exp.attention_mask & ~exp.response_mask & (torch.arange(LENGTH) >= PROMPT)


def test_observation_positions_get_no_advantage():
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 1:4] = True
    mask[:, 6:9] = True
    adv = group_baseline_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, estimator="grpo")
    assert (adv[~mask] == 0).all() and (adv[0, mask[0]] > 0).all()
    rewards, values = torch.randn(2, 10), torch.randn(2, 10)
    a, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert (a[~mask] == 0).all()
    # GAE over the turns equals GAE over the actions alone, packed side by side.
    packed = [rewards[:, mask[0]], values[:, mask[0]], torch.ones(2, 6, dtype=torch.bool)]
    a_packed, _ = gae_advantages(*packed, gamma=0.9, lam=0.8)
    assert torch.allclose(a[:, mask[0]], a_packed, atol=1e-6)


def test_the_loss_is_the_loss_on_the_models_tokens_alone(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    exp = _multi_turn_batch(lm, [1.0, 0.0, 0.5, 0.0])
    hp = {"advantage_estimator": "grpo", "kl_coef": 0.0, "entropy_coef": 0.0}
    train = {"epochs": 1, "num_minibatches": 1, "lr": 1e-9}
    got, _ = step_with_grads(make_learner(tiny_model_path, ppo=hp, train=train), exp)
    # Garbage at the observation positions (log-probs, reference log-probs) changes nothing.
    obs = _observations(exp)
    noisy = exp.replace(
        rollout_logprobs=torch.where(obs, torch.tensor(-40.0), exp.rollout_logprobs),
        ref_logprobs=torch.where(obs, torch.tensor(-7.0), exp.ref_logprobs),
    ).validate()
    again, _ = step_with_grads(make_learner(tiny_model_path, ppo=hp, train=train), noisy)
    assert torch.allclose(got["g"], again["g"], atol=1e-7)
    # The naive loss: on-policy GRPO's gradient is -(1/N) sum over the action tokens of A * grad log p.
    adv = group_baseline_advantages(exp.scores, exp.group_ids, exp.response_mask, estimator="grpo")
    lm.zero_grad()
    logp = sequence_logprobs(lm, exp.input_ids, exp.attention_mask, exp.response_mask)
    acts = exp.response_mask
    (-(adv * logp)[acts].sum() / acts.sum()).backward()
    naive = torch.cat([p.grad.reshape(-1) for p in lm.parameters()])
    assert torch.allclose(got["g"], naive, atol=1e-6), float((got["g"] - naive).abs().max())
