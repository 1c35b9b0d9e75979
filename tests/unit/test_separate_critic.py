"""ppo.critic=separate: a value network of its own (token or mean-pooled values). Initialised from a reward model it values
each state as that model scores the sequence up to it; the value loss never reaches the policy's
gradients (the shared head's does); a stopped and restored learner continues as the
uninterrupted one, critic and policy."""

import pytest
import torch

from learners.training.critic import build_critic
from tests.helpers.factories import experience, flat_grads, grouped_batch, make_learner, tiny_lm

GAE = {"advantage_estimator": "gae", "kl_coef": 0.0}


def _sequences(rows, length, first, seed):
    """Random unpadded token rows and the positions valued: every token from ``first`` on."""
    ids = torch.randint(3, 200, (rows, length), generator=torch.Generator().manual_seed(seed))
    att = torch.ones_like(ids, dtype=torch.bool)
    positions = torch.zeros_like(att)
    positions[:, first:] = True
    return ids, att, positions


def _reward_model(path, folder):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(path, num_labels=1)
    cfg.pad_token_id = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 0
    torch.manual_seed(5)
    rm = AutoModelForSequenceClassification.from_pretrained(path, config=cfg, dtype=torch.float32)
    rm.save_pretrained(folder, safe_serialization=True)
    return rm


def test_from_a_reward_model_its_first_values_are_the_models_scores(tiny_model_path, tmp_path):
    from learners.reward_model import load_reward_model, sequence_rewards

    _reward_model(tiny_model_path, tmp_path / "rm")
    rm = load_reward_model(tmp_path / "rm")
    critic = build_critic(tiny_model_path, str(tmp_path / "rm"))
    ids, att, positions = _sequences(rows=2, length=12, first=4, seed=0)
    with torch.no_grad():
        values = critic(ids, att, positions)
        for t in range(4, 12):  # the state before token t is the sequence up to t - 1
            scores, _ = sequence_rewards(rm, ids[:, :t], att[:, :t])
            torch.testing.assert_close(values[:, t], scores.float(), atol=1e-5, rtol=1e-4)
    assert float(values[:, :4].abs().sum()) == 0


def _batch(path):
    lm = tiny_lm(path)
    groups = [10, 10, 20, 20]
    ids, att, rm = grouped_batch(lm.config.vocab_size, groups, seed=4)
    return experience(lm, ids, att, rm, [1.0, 0.0, 0.5, 0.2], groups=groups)


def _grads(learner, batch):
    with torch.no_grad():  # a shared head starts at 0, which would pass no gradient to the trunk at first
        learner.model.value_head.weight.copy_(
            torch.randn(learner.model.value_head.weight.shape, generator=torch.Generator().manual_seed(2))
        )
    policy = [p for p in learner.model.lm.parameters() if p.requires_grad]
    got = {}
    learner.on_gradients = lambda params: got.update(policy=flat_grads(policy))
    learner.train_step(batch)
    return got["policy"]


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_the_value_loss_reaches_the_policy_only_through_a_shared_trunk(tiny_model_path, critic):
    batch = _batch(tiny_model_path)
    without = _grads(make_learner(tiny_model_path, ppo={**GAE, "critic": critic, "vf_coef": 0.0}), batch)
    with_value = _grads(make_learner(tiny_model_path, ppo={**GAE, "critic": critic, "vf_coef": 1.0}), batch)
    assert without.abs().sum() > 0
    if critic == "separate":
        torch.testing.assert_close(with_value, without, rtol=0, atol=0)
    else:
        assert not torch.allclose(with_value, without)


def test_a_restored_learner_continues_as_the_uninterrupted_one(tiny_model_path, tmp_path):
    batch = _batch(tiny_model_path)
    ppo = {**GAE, "critic": "separate", "critic_weight_decay": 0.1, "critic_lr": 1e-3}
    straight = make_learner(tiny_model_path, ppo=ppo)
    straight.train_step(batch)
    straight.train_step(batch)
    first = make_learner(tiny_model_path, ppo=ppo)
    first.train_step(batch)
    first.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "critic" / "critic.safetensors").is_file()
    resumed = make_learner(tiny_model_path, ppo=ppo)
    resumed.restore(tmp_path / "ckpt")
    resumed.train_step(batch)
    for a, b in zip(straight.model.critic.state_dict().values(), resumed.model.critic.state_dict().values()):
        torch.testing.assert_close(a, b)
    for a, b in zip(straight.model.lm.state_dict().values(), resumed.model.lm.state_dict().values()):
        torch.testing.assert_close(a, b)
    fresh = make_learner(tiny_model_path, ppo=ppo)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(fresh.model.critic.state_dict().values(), straight.model.critic.state_dict().values())
    ]
    assert any(moved)  # the critic trained


def test_with_lora_the_critic_has_its_own_adapter_rank(tiny_model_path):
    learner = make_learner(
        tiny_model_path,
        ppo={**GAE, "critic": "separate", "critic_lora_r": 2},
        lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
    )
    critic_a = [p for n, p in learner.model.critic.named_parameters() if "lora_A" in n]
    policy_a = [p for n, p in learner.model.lm.named_parameters() if "lora_A" in n]
    assert critic_a and policy_a and critic_a[0].shape[0] == 2 and policy_a[0].shape[0] == 4
    trained = {n for n, p in learner.model.critic.named_parameters() if p.requires_grad}
    assert all("lora_" in n or n.startswith("head.") for n in trained)


def test_mean_pooled_values_read_the_running_mean_of_the_states(tiny_model_path):
    critic = build_critic(tiny_model_path, pooling="mean")
    ids, att, positions = _sequences(rows=1, length=9, first=3, seed=1)
    with torch.no_grad():
        values = critic(ids, att, positions)
        hidden = critic.decoder(input_ids=ids, attention_mask=att.long()).last_hidden_state
        for t in range(3, 9):  # the naive loop: the mean of the states before token t
            want = critic.head(hidden[0, :t].mean(0)).squeeze()
            torch.testing.assert_close(values[0, t], want, atol=1e-5, rtol=1e-4)


def test_the_critic_is_clipped_on_its_own_norm(tiny_model_path):
    """A value loss with huge gradients must not shrink the policy's clipped step: the policy's
    gradient after clipping is the same whatever the value loss weighs."""
    batch = _batch(tiny_model_path)
    steps = []
    for vf in (0.0, 1e4):
        learner = make_learner(
            tiny_model_path, train={"max_grad_norm": 1e-3}, ppo={**GAE, "critic": "separate", "vf_coef": vf}
        )
        steps.append([p.detach().clone() for p in learner.model.lm.parameters()])
        learner.train_step(batch)
        steps[-1] = [a - p.detach() for a, p in zip(steps[-1], learner.model.lm.parameters())]
    for a, b in zip(*steps):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_learners_train_the_separate_critic_in_float32_values(tiny_model_path):
    """Under bf16 autocast the critic's head runs in bf16; its values (and the loss) stay float32,
    as the shared head's do, and close to the fp32 learner's (the make-train preset on a CPU with
    native bf16 crashed here)."""
    batch = _batch(tiny_model_path)
    metrics = {}
    for bf16 in (False, True):
        learner = make_learner(tiny_model_path, train={"bf16": bf16}, ppo={**GAE, "critic": "separate"})
        ids, att, rm = batch.input_ids, batch.attention_mask, batch.response_mask
        from learners.training.modeling import autocast

        with torch.no_grad(), autocast(bf16, ids.device):
            values = learner.model.critic(ids, att, rm)
        assert values.dtype == torch.float32
        metrics[bf16] = learner.train_step(batch)
    assert metrics[True]["loss/value"] == pytest.approx(metrics[False]["loss/value"], rel=0.05)
