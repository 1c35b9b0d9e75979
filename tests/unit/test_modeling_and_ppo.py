"""The learner's forward passes and one PPO update, on the tiny model, without Ray."""

import torch

from cluster.config import PPOConfig
from learners.experience import Experience
from learners.modeling import sequence_logprobs
from learners.ppo import PPOLearner


def _batch(lm, b=6, prompt=5, resp=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = lm.config.vocab_size
    ids = torch.randint(3, vocab, (b, prompt + resp), generator=g)
    att = torch.ones_like(ids, dtype=torch.bool)
    rm = torch.zeros_like(att)
    rm[:, prompt:] = True
    for i in range(b):  # ragged responses, right-padded
        cut = prompt + resp - (i % 3)
        att[i, cut:] = False
        rm[i, cut:] = False
        ids[i, cut:] = 0
    return ids, att, rm


def test_chunked_logprobs_match_full_log_softmax(tiny_model_path):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids, att, rm = _batch(lm)
    got = sequence_logprobs(lm, ids, att, rm, chunk=5, micro_batch_size=4)
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=att.long()).logits
    naive = torch.zeros_like(got)
    for i in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if rm[i, t]:
                naive[i, t] = torch.log_softmax(logits[i, t - 1], -1)[ids[i, t]]
    torch.testing.assert_close(got, naive, atol=1e-5, rtol=1e-5)
    assert (got[~rm] == 0).all()


def test_ppo_step_moves_policy_towards_rewarded_samples(tiny_model_path):
    hp = PPOConfig(lr=1e-2, critic_lr=1e-2, epochs=4, minibatch_size=6, micro_batch_size=3, bf16=False, kl_coef=0.0)
    learner = PPOLearner(tiny_model_path, hp, seed=0)
    ids, att, rm = _batch(learner.model.lm)
    with torch.no_grad():
        lp0 = sequence_logprobs(learner.model.lm, ids, att, rm)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    exp = Experience(
        input_ids=ids, attention_mask=att, response_mask=rm, rollout_logprobs=lp0, group_ids=torch.arange(6),
        truncated=torch.zeros(6, dtype=torch.bool), policy_version=0, completions=[""] * 6, meta=[{}] * 6,
        scores=scores, ref_logprobs=lp0.clone(),
    ).validate()
    metrics = learner.train_step(exp)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    # The trainer reproduces the rollout log-probs of the same weights.
    assert metrics["logprob_gap/max_abs"] < 1e-5
    with torch.no_grad():
        lp1 = sequence_logprobs(learner.model.lm, ids, att, rm)
    seq_gain = ((lp1 - lp0) * rm).sum(1)
    assert seq_gain[scores == 1].mean() > seq_gain[scores == 0].mean()
    assert learner.version == 1
    sd = learner.policy_state_dict()
    assert "lm_head.weight" not in sd  # tied to the embedding: not sent twice
    assert not any(k.startswith("value_head") for k in sd)


def test_fused_on_policy_step_equals_separate_old_pass(tiny_model_path):
    """One epoch, one minibatch: reusing the training forward as the 'old' pass is exact."""
    torch.manual_seed(0)
    results = []
    for micro in (6, 3):  # 6: fused path; 3: separate no-grad pass, then two micro-batches
        hp = PPOConfig(lr=1e-2, critic_lr=1e-2, epochs=1, minibatch_size=6, micro_batch_size=micro, bf16=False)
        learner = PPOLearner(tiny_model_path, hp, seed=0)
        ids, att, rm = _batch(learner.model.lm)
        with torch.no_grad():
            lp0 = sequence_logprobs(learner.model.lm, ids, att, rm)
        exp = Experience(
            input_ids=ids, attention_mask=att, response_mask=rm, rollout_logprobs=lp0, group_ids=torch.arange(6),
            truncated=torch.zeros(6, dtype=torch.bool), policy_version=0, completions=[""] * 6, meta=[{}] * 6,
            scores=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.2]), ref_logprobs=lp0 - 0.01,
        )
        m = learner.train_step(exp)
        assert m["learner/fused_old_pass"] == float(micro == 6)
        results.append((m, [p.detach().clone() for p in learner.model.parameters()]))
    (m_a, p_a), (m_b, p_b) = results
    for k in ("loss/policy", "loss/value", "kl/ref_k1", "advantage/mean"):
        assert abs(m_a[k] - m_b[k]) < 1e-4, k
    # Adam's first step is about lr * sign(grad), so compare the whole update's direction.
    base = PPOLearner(tiny_model_path, PPOConfig(), seed=0)
    d_a = torch.cat([(x - z).flatten() for x, z in zip(p_a, base.model.parameters())])
    d_b = torch.cat([(y - z).flatten() for y, z in zip(p_b, base.model.parameters())])
    assert torch.nn.functional.cosine_similarity(d_a, d_b, dim=0) > 0.999


def test_streamed_on_policy_step_equals_fused(tiny_model_path):
    """No critic and no KL in the reward: the advantages need no forward pass, so one on-policy
    update can stream length-sorted, trimmed micro-batches (each its own old pass) and still
    equal the single fused pass over the whole batch."""
    results = []
    for micro in (6, 2):
        hp = PPOConfig(lr=1e-2, epochs=1, minibatch_size=6, micro_batch_size=micro, bf16=False,
                       advantage_estimator="grpo", kl_coef=0.0)
        learner = PPOLearner(tiny_model_path, hp, seed=0)
        ids, att, rm = _batch(learner.model.lm)
        with torch.no_grad():
            lp0 = sequence_logprobs(learner.model.lm, ids, att, rm)
        exp = Experience(
            input_ids=ids, attention_mask=att, response_mask=rm, rollout_logprobs=lp0,
            group_ids=torch.tensor([0, 0, 0, 1, 1, 1]), truncated=torch.zeros(6, dtype=torch.bool), policy_version=0,
            completions=[""] * 6, meta=[{}] * 6, scores=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.2]),
        )
        m = learner.train_step(exp)
        assert (m["learner/fused_old_pass"], m["learner/streamed_old_pass"]) == ((1.0, 0.0) if micro == 6 else (0.0, 1.0))
        # The old pass is the policy before the update: it matches the rollout log-probs.
        assert m["logprob_gap/max_abs"] < 1e-5
        results.append((m, [p.detach().clone() for p in learner.model.lm.parameters()]))
    (m_a, p_a), (m_b, p_b) = results
    for k in ("loss/policy", "advantage/mean", "policy/entropy"):
        assert abs(m_a[k] - m_b[k]) < 1e-5, k
    # Adam's first step is about lr * sign(grad) (lr = 1e-2 here): summation-order noise in a
    # near-zero gradient element moves it by a few 1e-6 at most.
    for x, y in zip(p_a, p_b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
