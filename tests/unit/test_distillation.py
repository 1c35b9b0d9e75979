"""On-policy distillation: the teacher's per-token advantage (learners/advantages.teacher_advantages)
against hand values and a naive loop; its policy gradient is the reverse KL's exact gradient on
a categorical policy; the PPO learner adds it to the task advantage, and two learners take the one
learner's step with it."""

import math

import pytest
import torch

from cluster.config import ConfigError
from cluster.config.loading import load_config
from learners.objectives.advantages import group_baseline_advantages, teacher_advantages


def test_hand_values():
    student = torch.tensor([[-1.0, -2.0, -3.0, -1.0]])
    teacher = torch.tensor([[-0.5, -2.5, -1.0, -9.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    # gaps at the response tokens: -0.5, 2.0; the prompt and padding give 0
    torch.testing.assert_close(teacher_advantages(student, teacher, mask), torch.tensor([[0.0, -0.5, 2.0, 0.0]]))
    torch.testing.assert_close(teacher_advantages(student, teacher, mask, 1.0), torch.tensor([[0.0, 1.5, 2.0, 0.0]]))
    torch.testing.assert_close(teacher_advantages(student, teacher, mask, 0.5), torch.tensor([[0.0, 0.5, 2.0, 0.0]]))
    with pytest.raises(ValueError, match="discount"):
        teacher_advantages(student, teacher, mask, 1.5)


def test_matches_a_naive_loop():
    gen = torch.Generator().manual_seed(0)
    student, teacher = -torch.rand(5, 9, generator=gen) * 4, -torch.rand(5, 9, generator=gen) * 4
    mask = torch.rand(5, 9, generator=gen) > 0.3
    mask[2] = False  # a row without a response token
    for discount in (0.0, 0.7, 1.0):
        got = teacher_advantages(student, teacher, mask, discount)
        for b in range(5):
            idx = [t for t in range(9) if mask[b, t]]
            for t in range(9):
                want = 0.0
                if mask[b, t]:
                    later = [k for k in idx if k >= t]
                    want = sum(discount**j * float(teacher[b, k] - student[b, k]) for j, k in enumerate(later))
                assert math.isclose(float(got[b, t]), want, rel_tol=1e-5, abs_tol=1e-6), (b, t, discount)


def test_its_policy_gradient_is_the_reverse_kl_gradient():
    """On one categorical step, E_{a~pi_S}[grad log pi_S(a) * A(a)] with A = log pi_T - log pi_S
    is exactly -grad KL(pi_S || pi_T): the surrogate below (actions enumerated, weighted by their
    detached probabilities, ratio 1) has the gradient of the reverse KL, negated."""
    logits = torch.randn(6, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(6), -1)
    logp = torch.log_softmax(logits, -1)
    adv = teacher_advantages(logp.unsqueeze(1), teacher.unsqueeze(1), torch.ones(6, 1)).squeeze(1)
    p = logp.exp()
    surrogate = (p.detach() * torch.exp(logp - logp.detach()) * adv).sum()
    (g_pg,) = torch.autograd.grad(surrogate, logits, retain_graph=True)
    kl = (p * (logp - teacher)).sum()
    (g_kl,) = torch.autograd.grad(kl, logits)
    torch.testing.assert_close(g_pg, -g_kl)


def _batch(path):
    from tests.helpers.factories import experience, grouped_batch, tiny_lm

    lm = tiny_lm(path)
    groups = [10, 10, 20, 10, 20, 30, 30]
    ids, att, rm = grouped_batch(lm.config.vocab_size, groups, seed=3)
    exp = experience(lm, ids, att, rm, [1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0], groups=groups)
    noise = torch.randn(exp.rollout_logprobs.shape, generator=torch.Generator().manual_seed(1))
    return exp.replace(ref_logprobs=exp.rollout_logprobs - noise.abs())  # the teacher's log-probs


def test_the_learner_adds_the_teacher_advantage_to_the_task_advantage(tiny_model_path):
    from tests.helpers.factories import make_learner

    exp = _batch(tiny_model_path)
    ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0, "teacher": "t", "distill_coef": 2.0, "task_coef": 0.5}
    learner = make_learner(tiny_model_path, ppo=ppo)
    old = exp.rollout_logprobs
    adv, _, _ = learner._advantages(exp, old, torch.zeros_like(old), exp.ref_logprobs, 0.0)
    task = group_baseline_advantages(exp.scores, exp.group_ids, exp.response_mask, estimator="grpo")
    want = 0.5 * task + 2.0 * teacher_advantages(old, exp.ref_logprobs, exp.response_mask) * exp.response_mask
    torch.testing.assert_close(adv, want)


def test_two_learners_match_one_with_distillation(tiny_model_path):
    from tests.unit.test_multi_learner import _compare

    exp = _batch(tiny_model_path)
    ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0, "teacher": "t", "distill_coef": 1.0, "task_coef": 0.0}
    g, _, _ = _compare(tiny_model_path, exp, {"micro_batch_size": 2}, ppo)
    g_task, _, _ = _compare(
        tiny_model_path, exp, {"micro_batch_size": 2}, {"advantage_estimator": "grpo", "kl_coef": 0.0}
    )
    assert not torch.allclose(g, g_task)  # the teacher's term moved the step


def test_config_pairs_the_teacher_with_its_weight():
    with pytest.raises(ConfigError, match="needs both ppo.teacher"):
        load_config(overrides=["ppo.distill_coef=1.0"])
    with pytest.raises(ConfigError, match="needs both ppo.teacher"):
        load_config(overrides=["ppo.teacher=/x"])
    with pytest.raises(ConfigError, match="task_coef=0"):
        load_config(overrides=["ppo.task_coef=0"])
    assert load_config(overrides=["ppo.teacher=/x", "ppo.distill_coef=1", "ppo.kl_coef=0"]).ppo.uses_reference


def test_centering_subtracts_the_batch_mean_over_response_tokens():
    gen = torch.Generator().manual_seed(2)
    student, teacher = -torch.rand(3, 6, generator=gen) * 3, -torch.rand(3, 6, generator=gen) * 3
    mask = torch.rand(3, 6, generator=gen) > 0.4
    plain = teacher_advantages(student, teacher, mask, 0.5)
    centred = teacher_advantages(student, teacher, mask, 0.5, center=True)
    torch.testing.assert_close(centred[mask], plain[mask] - plain[mask].mean())
    assert float(centred[~mask].abs().sum()) == 0
    assert abs(float(centred[mask].sum())) < 1e-4


def test_a_teacher_must_read_the_policys_token_ids(tiny_model_path, tmp_path):
    """The same tokenizer passes; a tokenizer with other ids (here one token swapped) is one line."""
    import json as _json
    import shutil

    from cluster.config import UserError
    from cluster.recipes.ppo import check_teacher

    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(tiny_model_path, same)
    shutil.copytree(tiny_model_path, other)
    tok = _json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10], list(vocab)[11]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(_json.dumps(tok))
    base = ["model.path=tiny", "ppo.distill_coef=1", "ppo.kl_coef=0"]
    check_teacher(load_config(overrides=base + [f"ppo.teacher={same}"]))
    with pytest.raises(UserError, match="2 of .* tokens differ"):
        check_teacher(load_config(overrides=base + [f"ppo.teacher={other}"]))
