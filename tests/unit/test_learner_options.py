"""Learner options without Ray: LoRA (reference = disabled adapter, merged export),
truncation handling, critic-free estimators, the KL controller state in checkpoints."""

import json

import pytest
import torch

from cluster.config import LoRAConfig, PPOConfig
from learners.experience import Experience
from learners.modeling import sequence_logprobs
from learners.ppo import PPOLearner
from tests.unit.test_modeling_and_ppo import _batch


def _exp(lm, scores, truncated=None, ref=True, groups=None):
    ids, att, rm = _batch(lm)
    with torch.no_grad():
        lp = sequence_logprobs(lm, ids, att, rm)
    b = ids.shape[0]
    return Experience(
        input_ids=ids, attention_mask=att, response_mask=rm, rollout_logprobs=lp,
        group_ids=torch.tensor(groups if groups is not None else list(range(b))),
        truncated=torch.tensor(truncated if truncated is not None else [False] * b), policy_version=0,
        completions=[""] * b, meta=[{}] * b, scores=torch.tensor(scores, dtype=torch.float32),
        ref_logprobs=lp.clone() if ref else None,
    )


def test_lora_reference_is_the_base_model_and_export_is_merged(tiny_model_path):
    from transformers import AutoModelForCausalLM

    hp = PPOConfig(lr=5e-2, bf16=False, minibatch_size=6, micro_batch_size=6)
    learner = PPOLearner(tiny_model_path, hp, lora=LoRAConfig(enabled=True, r=4, alpha=8))
    assert 0 < learner.trainable_fraction < 0.5
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    exp = _exp(base, [1, 0, 1, 0, 1, 0], ref=False)
    learner.train_step(exp)
    learner.train_step(exp)
    # The reference (adapter disabled) is still exactly the base model after training ...
    ref = learner.reference_logprobs(exp)
    torch.testing.assert_close(ref, sequence_logprobs(base, exp.input_ids, exp.attention_mask, exp.response_mask))
    # ... while the exported (merged) weights are the trained policy.
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    missing, unexpected = policy.load_state_dict(learner.policy_state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    policy.tie_weights()
    with torch.no_grad():
        trained = learner.model.lm(input_ids=exp.input_ids, attention_mask=exp.attention_mask.long()).logits
        merged = policy(input_ids=exp.input_ids, attention_mask=exp.attention_mask.long()).logits
    torch.testing.assert_close(trained, merged, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, sequence_logprobs(policy, exp.input_ids, exp.attention_mask, exp.response_mask))
    # Exporting did not leave the adapter merged into the trainable model.
    torch.testing.assert_close(learner.reference_logprobs(exp), ref)


@pytest.mark.parametrize("mode", ["keep", "penalize", "mask"])
def test_truncation_modes(tiny_model_path, mode):
    hp = PPOConfig(bf16=False, minibatch_size=6, micro_batch_size=6, advantage_estimator="reinforce_pp", kl_coef=0.0)
    learner = PPOLearner(tiny_model_path, hp, truncation=mode, truncation_penalty=-2.0)
    exp = _exp(learner.model.lm, [1.0] * 6, truncated=[True, False, True, False, False, False])
    out = learner._apply_truncation(exp)
    if mode == "keep":
        assert torch.equal(out.scores, exp.scores) and torch.equal(out.response_mask, exp.response_mask)
    elif mode == "penalize":
        assert out.scores.tolist() == [-1.0, 1.0, -1.0, 1.0, 1.0, 1.0]
    else:
        assert not out.response_mask[[0, 2]].any() and torch.equal(out.response_mask[1], exp.response_mask[1])
    m = learner.train_step(exp)
    assert m["response/truncated"] == 2.0
    assert all(v == v for v in m.values())  # no NaN


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_critic_free_estimators_train_without_value_loss(tiny_model_path, estimator):
    hp = PPOConfig(bf16=False, minibatch_size=6, micro_batch_size=3, advantage_estimator=estimator, lr=1e-2)
    learner = PPOLearner(tiny_model_path, hp)
    exp = _exp(learner.model.lm, [1, 0, 0, 1, 1, 0], groups=[5, 5, 5, 9, 9, 9])
    m = learner.train_step(exp)
    assert "loss/value" not in m and "value/mean" not in m
    assert m["policy/grad_norm"] > 0
    assert learner.model.value_head.weight.grad is None


def test_adaptive_kl_controller_state_is_checkpointed(tiny_model_path, tmp_path):
    hp = PPOConfig(bf16=False, minibatch_size=6, micro_batch_size=6, kl_controller="adaptive", kl_coef=0.1,
                   kl_target=1e-6, kl_horizon=10)
    learner = PPOLearner(tiny_model_path, hp)
    exp = _exp(learner.model.lm, [1, 0, 1, 0, 1, 0])
    exp = exp.replace(ref_logprobs=exp.ref_logprobs - 0.5)  # far from the reference: KL above target
    m = learner.train_step(exp)
    assert m["kl/coef"] == pytest.approx(0.1) and m["kl/coef_next"] > 0.1
    folder = learner.save(tmp_path / "ckpt", tokenizer_from=tiny_model_path)
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["kl_controller"]["value"] == pytest.approx(m["kl/coef_next"])
    assert (folder / "model.safetensors").is_file()


def test_empty_batch_is_a_counted_no_op(tiny_model_path):
    learner = PPOLearner(tiny_model_path, PPOConfig(bf16=False))
    exp = _exp(learner.model.lm, [1, 0, 1, 0, 1, 0])
    before = [p.detach().clone() for p in learner.model.parameters()]
    m = learner.train_step(exp.select([]))
    assert m["learner/empty_batch"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))


def test_no_kl_term_means_no_reference(tiny_model_path):
    """beta = 0 and no KL loss: the learner trains without reference log-probs (none is run) and
    reports no KL-to-reference; with a KL term, missing reference log-probs are an error."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    hp = PPOConfig(bf16=False, minibatch_size=6, micro_batch_size=6, advantage_estimator="grpo", kl_coef=0.0, lr=1e-2)
    assert not hp.uses_reference
    learner = PPOLearner(tiny_model_path, hp)
    before = {n: p.detach().clone() for n, p in learner.model.lm.named_parameters()}
    metrics = learner.train_step(_exp(base, [1, 0, 1, 0, 1, 0], ref=False, groups=[0, 0, 1, 1, 2, 2]))
    assert not any(k.startswith("kl/ref") for k in metrics)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert any(not torch.equal(before[n], p) for n, p in learner.model.lm.named_parameters())

    with_kl = PPOConfig(bf16=False, minibatch_size=6, micro_batch_size=6, advantage_estimator="grpo", kl_coef=0.1)
    assert with_kl.uses_reference and PPOConfig(kl_coef=0, kl_controller="adaptive").uses_reference
    with pytest.raises(RuntimeError, match="needs LoRA"):
        PPOLearner(tiny_model_path, with_kl).train_step(_exp(base, [1, 0, 1, 0, 1, 0], ref=False, groups=[0, 0, 1, 1, 2, 2]))
