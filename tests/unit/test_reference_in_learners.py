"""``train.reference=learners``: without LoRA, a learner computes the frozen reference's log-probs
with its own frozen copy of the initial model, and takes exactly the step it takes when a
Reference actor hands it the same log-probs; training does not move that copy. (Sharded, the
copy is sharded with the policy: tests/unit/test_sharded_learners.py.)"""

import pytest
import torch

from tests.helpers.factories import (
    assert_grads_close,
    experience,
    grouped_batch,
    make_dpo_learner,
    make_learner,
    preference_batch,
    step_with_grads,
    tiny_lm,
)

GROUPS = [1, 1, 2, 2]
PPO = {"advantage_estimator": "grpo", "kl_coef": 0.2}


def test_a_learners_own_reference_takes_the_step_of_the_reference_actors_log_probs(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, GROUPS, seed=7)
    given = experience(lm, ids, att, rm, [1.0, 0.0, 0.0, 1.0], groups=GROUPS, ref_shift=0.0)  # the initial model's
    g_ref, m_ref = step_with_grads(make_learner(tiny_model_path, ppo=PPO), given)
    learner = make_learner(tiny_model_path, train={"reference": "learners"}, ppo=PPO)
    g, m = step_with_grads(learner, given.replace(ref_logprobs=None))
    assert_grads_close(g, g_ref)
    assert m["kl/ref_k1"] == pytest.approx(m_ref["kl/ref_k1"], abs=1e-6)
    # A second step: the policy moved, the reference did not (a KL term now, against the start).
    _, second = step_with_grads(learner, given.replace(ref_logprobs=None))
    assert second["kl/ref_k1"] != pytest.approx(0.0, abs=1e-7)
    start = tiny_lm(tiny_model_path).state_dict()
    frozen = learner._frozen_reference().lm.state_dict()
    assert all(torch.equal(frozen[k], start[k]) for k in start)


def test_dpo_with_its_own_reference(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    pairs = preference_batch(lm, 3, seed=2, ref_shift=0.0)
    g_ref, m_ref = step_with_grads(make_dpo_learner(tiny_model_path, dpo={"beta": 0.5}), pairs)
    g, m = step_with_grads(
        make_dpo_learner(tiny_model_path, train={"reference": "learners"}, dpo={"beta": 0.5}),
        pairs.replace(ref_logprobs=None),
    )
    assert_grads_close(g, g_ref)
    assert m["loss/total"] == pytest.approx(m_ref["loss/total"], rel=1e-5)


def test_without_a_reference_source_the_batch_is_refused(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    pairs = preference_batch(lm, 2, seed=2, ref_shift=None)
    with pytest.raises(Exception, match="needs ref_logprobs"):
        make_dpo_learner(tiny_model_path, dpo={"beta": 0.5}).train_step(pairs)
