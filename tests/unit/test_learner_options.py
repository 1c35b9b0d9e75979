"""Learner options without Ray: LoRA (reference = disabled adapter, merged export),
truncation handling, critic-free estimators, the KL controller state in checkpoints."""

import json
import math

import pytest
import torch

from cluster.config import PPOConfig
from learners.training.modeling import sequence_logprobs
from tests.helpers.factories import experience, flat_grads, make_learner, ragged_batch, tiny_lm


def _exp(lm, scores, truncated=None, ref=True, groups=None, ref_shift=0.0):
    """An on-policy record of ``lm`` over the shared ragged batch (6 rows)."""
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    return experience(
        lm, ids, att, rm, scores, groups=groups, truncated=truncated, ref_shift=ref_shift if ref else None
    )


def test_lora_reference_is_the_base_model_and_export_is_merged(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    learner = make_learner(tiny_model_path, train={"lr": 5e-2, "micro_batch_size": 6}, lora={"r": 4, "alpha": 8})
    assert 0 < learner.trainable_fraction < 0.5
    base = tiny_lm(tiny_model_path)
    exp = _exp(base, [1, 0, 1, 0, 1, 0], ref=False)
    learner.train_step(exp)
    learner.train_step(exp)
    # The reference (adapter disabled) is still exactly the base model after training ...
    ref = learner.reference_logprobs(exp)
    torch.testing.assert_close(ref, sequence_logprobs(base, exp.input_ids, exp.attention_mask, exp.response_mask))
    # ... while the exported (merged) weights are the trained policy.
    policy = tiny_lm(tiny_model_path)
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

    # The checkpoint folder is a plain (merged) model folder; the adapter lives in adapter/.
    folder = learner.save(tmp_path / "ckpt", tokenizer_from=tiny_model_path)
    assert (folder / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]
    served = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        served_logits = served(input_ids=exp.input_ids, attention_mask=exp.attention_mask.long()).logits
    torch.testing.assert_close(served_logits, merged, atol=1e-4, rtol=1e-4)
    assert json.loads((folder / "trainer_state" / "learner.json").read_text())["lora"] is True
    # restore() brings the adapter back into a fresh LoRA learner (same policy, same reference).
    fresh = make_learner(tiny_model_path, train={"lr": 5e-2, "micro_batch_size": 6}, lora={"r": 4, "alpha": 8})
    fresh.restore(folder)
    assert fresh.version == 2
    with torch.no_grad():
        restored = fresh.model.lm(input_ids=exp.input_ids, attention_mask=exp.attention_mask.long()).logits
    torch.testing.assert_close(restored, trained, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fresh.reference_logprobs(exp), ref)


@pytest.mark.parametrize("mode", ["keep", "penalize", "mask"])
def test_truncation_modes(tiny_model_path, mode):
    learner = make_learner(
        tiny_model_path,
        train={"micro_batch_size": 6},
        ppo={"advantage_estimator": "reinforce_pp", "kl_coef": 0.0, "truncation": mode, "truncation_penalty": -2.0},
    )
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
    # The mode reached the update: equal scores leave nothing to learn unless the truncated
    # rows were penalised; masking them leaves out their tokens.
    tokens = float(exp.response_mask.sum())
    if mode == "mask":
        assert m["learner/tokens"] == tokens - float(exp.response_mask[[0, 2]].sum())
    else:
        assert m["learner/tokens"] == tokens
    if mode == "penalize":
        assert m["policy/grad_norm"] > 0
    else:
        assert m["policy/grad_norm"] == pytest.approx(0.0, abs=1e-6)


def _expected_group_advantages(scores, groups, estimator):
    """Per-row advantages written out from each estimator's definition."""
    out = []
    for s, g in zip(scores, groups):
        members = [x for x, h in zip(scores, groups) if h == g]
        n, mean = len(members), sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
        if estimator == "grpo":
            out.append((s - mean) / (std + 1e-6))
        elif estimator == "dr_grpo":
            out.append(s - mean)
        else:  # rloo: the mean of the other samples is the baseline
            out.append(s - (sum(members) - s) / (n - 1))
    return torch.tensor(out)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_critic_free_estimators_train_without_value_loss(tiny_model_path, estimator):
    scores, groups = [1, 0, 0, 1, 1, 0], [5, 5, 5, 9, 9, 9]
    learner = make_learner(
        tiny_model_path, train={"micro_batch_size": 3, "lr": 1e-2}, ppo={"advantage_estimator": estimator}
    )
    seen = {}
    orig = learner._advantages

    def spy(exp, *a, **k):
        seen["adv"], ret, kl = orig(exp, *a, **k)
        return seen["adv"], ret, kl

    learner._advantages = spy
    grads = []
    learner.on_gradients = lambda params: grads.append(flat_grads(params))
    exp = _exp(learner.model.lm, scores, groups=groups)
    m = learner.train_step(exp)
    assert "loss/value" not in m and "value/mean" not in m
    assert m["policy/grad_norm"] > 0 and grads[0].abs().sum() > 0
    assert learner.model.value_head.weight.grad is None
    # The named estimator ran: its advantages follow its own formula.
    adv, rm = seen["adv"], exp.response_mask
    assert (adv[~rm] == 0).all()
    if estimator == "reinforce_pp":
        # No KL (reference = rollout policy): every token's return-to-go is its row's score,
        # whitened over all response tokens of the batch (unbiased std).
        ret = torch.tensor(scores, dtype=torch.float32)[:, None].expand_as(adv)[rm]
        torch.testing.assert_close(adv[rm], (ret - ret.mean()) / ret.std(), atol=1e-4, rtol=1e-4)
    else:
        expected = _expected_group_advantages(scores, groups, estimator)
        torch.testing.assert_close(adv, expected[:, None].expand_as(adv) * rm, atol=1e-5, rtol=1e-5)


def test_adaptive_kl_controller_state_is_checkpointed(tiny_model_path, tmp_path):
    ppo = {"kl_controller": "adaptive", "kl_coef": 0.1, "kl_target": 1e-6, "kl_horizon": 10}
    learner = make_learner(tiny_model_path, train={"micro_batch_size": 6}, ppo=ppo)
    # Far from the reference (shifted by 0.5 per token): KL above target.
    exp = _exp(learner.model.lm, [1, 0, 1, 0, 1, 0], ref_shift=0.5)
    m = learner.train_step(exp)
    assert m["kl/coef"] == pytest.approx(0.1) and m["kl/coef_next"] > 0.1
    folder = learner.save(tmp_path / "ckpt", tokenizer_from=tiny_model_path)
    # A plain model folder: weights and tokenizer at the top, the rest in subfolders.
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert (folder / "tokenizer_config.json").is_file()
    assert not (folder / "trainer_state.json").exists() and not (folder / "value_head.safetensors").exists()
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]
    assert (folder / "critic" / "value_head.safetensors").is_file()  # gae: the critic is saved
    state = json.loads((folder / "trainer_state" / "learner.json").read_text())
    assert state["algorithm"] == "ppo" and state["version"] == 1 and state["lora"] is False
    assert state["kl_controller"]["value"] == pytest.approx(m["kl/coef_next"])
    # The binary state loads without running code and holds the same controller value.
    binary = torch.load(folder / "trainer_state" / "learner.pt", weights_only=True)
    assert binary["kl_controller"]["value"] == pytest.approx(m["kl/coef_next"])
    # restore() brings back weights, critic, optimiser and the controller.
    fresh = make_learner(tiny_model_path, train={"micro_batch_size": 6}, ppo=ppo)
    assert fresh.kl_ctl.value == pytest.approx(0.1)
    fresh.restore(folder)
    assert fresh.version == 1 and fresh.kl_ctl.value == pytest.approx(m["kl/coef_next"])
    for a, b in zip(fresh.model.parameters(), learner.model.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert fresh.model.value_head.weight.abs().sum() > 0  # the trained (non-zero) critic, not a new one


def test_critic_free_checkpoint_has_no_critic(tiny_model_path, tmp_path):
    learner = make_learner(
        tiny_model_path, train={"micro_batch_size": 6}, ppo={"advantage_estimator": "grpo", "kl_coef": 0.0}
    )
    learner.train_step(_exp(learner.model.lm, [1, 0, 1, 0, 1, 0], groups=[0, 0, 1, 1, 2, 2], ref=False))
    folder = learner.save(tmp_path / "ckpt")
    assert not (folder / "critic").exists() and not (folder / "value_head.safetensors").exists()
    assert json.loads((folder / "trainer_state" / "learner.json").read_text())["version"] == 1


def test_empty_batch_is_a_counted_no_op(tiny_model_path):
    learner = make_learner(tiny_model_path)
    exp = _exp(learner.model.lm, [1, 0, 1, 0, 1, 0])
    before = [p.detach().clone() for p in learner.model.parameters()]
    m = learner.train_step(exp.select([]))
    assert m["learner/empty_batch"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
    assert learner.version == 0


def test_no_kl_term_means_no_reference(tiny_model_path):
    """beta = 0 and no KL loss: the learner trains without reference log-probs (none is run) and
    reports no KL-to-reference; with a KL term, missing reference log-probs are an error."""
    base = tiny_lm(tiny_model_path)
    ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0}
    assert not PPOConfig(**ppo).uses_reference
    learner = make_learner(tiny_model_path, train={"micro_batch_size": 6, "lr": 1e-2}, ppo=ppo)
    grads = []
    learner.on_gradients = lambda params: grads.append(flat_grads(params))
    metrics = learner.train_step(_exp(base, [1, 0, 1, 0, 1, 0], ref=False, groups=[0, 0, 1, 1, 2, 2]))
    assert not any(k.startswith("kl/ref") for k in metrics)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    # It did train: a non-zero gradient reached the optimiser.
    assert len(grads) == 1 and grads[0].abs().sum() > 0

    with_kl = {"advantage_estimator": "grpo", "kl_coef": 0.1}
    assert PPOConfig(**with_kl).uses_reference and PPOConfig(kl_coef=0, kl_controller="adaptive").uses_reference
    with pytest.raises(RuntimeError, match="needs LoRA"):
        make_learner(tiny_model_path, train={"micro_batch_size": 6}, ppo=with_kl).train_step(
            _exp(base, [1, 0, 1, 0, 1, 0], ref=False, groups=[0, 0, 1, 1, 2, 2])
        )
