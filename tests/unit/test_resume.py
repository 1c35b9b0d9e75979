"""Exact resume without Ray: learner state round trip, the checkpoint layout, the prompt
sampler's position, learning-rate schedules, the stale-batch guard."""

import json
import math

import pytest
import torch

from cluster.run_context import RunContext, latest_checkpoint
from cluster.data.prompts import PromptSampler
from learners.base import get_learner, load_learner_state
from learners.training.optim import lr_multiplier
from tests.helpers.factories import experience, make_learner, ragged_batch, tiny_lm


def _batches(path, n=3):
    lm = tiny_lm(path)
    out = []
    for k in range(n):
        ids, att, rm = ragged_batch(lm.config.vocab_size, seed=10 + k)
        out.append(experience(lm, ids, att, rm, [1, 0, 1, 0, 0.5, 0.2], ref_shift=0.05))
    return out


SETTINGS = dict(
    train={
        "lr": 1e-2,
        "epochs": 2,
        "num_minibatches": 2,
        "micro_batch_size": 2,
        "lr_schedule": "cosine",
        "warmup_steps": 1,
    },
    ppo={"critic_lr": 1e-2, "kl_controller": "adaptive", "kl_coef": 0.1, "kl_target": 0.01, "kl_horizon": 50},
)


def test_learner_resumes_exactly(tiny_model_path, tmp_path):
    """3 updates straight through == 1 update, save, restore into a fresh learner, 2 updates:
    same parameters (to float rounding: the same operations run in the same order), same
    optimiser / scheduler / KL-controller state."""
    batches = _batches(tiny_model_path)
    straight = make_learner(tiny_model_path, **SETTINGS)
    for b in batches:
        straight.train_step(b)

    first = make_learner(tiny_model_path, **SETTINGS)
    first.train_step(batches[0])
    folder = first.save(tmp_path / "step_1", tokenizer_from=tiny_model_path)
    resumed = make_learner(tiny_model_path, **SETTINGS)
    resumed.restore(folder)
    assert resumed.version == 1 and resumed.kl_ctl.value == first.kl_ctl.value
    for b in batches[1:]:
        resumed.train_step(b)

    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    assert resumed.version == straight.version == 3
    assert resumed.kl_ctl.value == pytest.approx(straight.kl_ctl.value, rel=1e-9)
    assert resumed.scheduler.last_epoch == straight.scheduler.last_epoch == 12
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(straight.optimizer.param_groups[0]["lr"])
    # Without the restore the run would differ: the check above can fail.
    fresh = make_learner(tiny_model_path, **SETTINGS)
    for b in batches[1:]:
        fresh.train_step(b)
    assert not torch.allclose(fresh.model.value_head.weight, straight.model.value_head.weight)


def test_checkpoint_folder_is_a_model_folder(tiny_model_path, tmp_path):
    """Only the model's safetensors at the top (vLLM loads every top-level *.safetensors);
    critic, adapter and training state in subfolders; transformers loads the folder."""
    from transformers import AutoModelForCausalLM

    learner = make_learner(tiny_model_path)
    learner.train_step(_batches(tiny_model_path, 1)[0])
    folder = learner.save(tmp_path / "ckpt", tokenizer_from=tiny_model_path)
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]
    assert (folder / "critic" / "value_head.safetensors").is_file()
    state = load_learner_state(folder)
    assert state["version"] == 1 and "optimizer" in state and "scheduler" in state
    assert json.loads((folder / "trainer_state" / "learner.json").read_text())["algorithm"] == "ppo"
    lm = AutoModelForCausalLM.from_pretrained(folder)
    with learner.policy_weights() as sd:
        torch.testing.assert_close(lm.model.embed_tokens.weight, sd["model.embed_tokens.weight"])


def test_lora_checkpoint_resumes_the_adapter(tiny_model_path, tmp_path):
    lora = {"r": 4, "alpha": 8}
    batch = _batches(tiny_model_path, 1)[0].replace(ref_logprobs=None)
    a = make_learner(tiny_model_path, train={"lr": 5e-2}, lora=lora)
    a.train_step(batch)
    folder = a.save(tmp_path / "ckpt", tokenizer_from=tiny_model_path)
    assert (folder / "adapter" / "adapter_model.safetensors").is_file()
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]
    b = make_learner(tiny_model_path, train={"lr": 5e-2}, lora=lora)
    b.restore(folder)
    torch.testing.assert_close(b.policy_state_dict(), a.policy_state_dict())
    with pytest.raises(ValueError, match="lora"):
        make_learner(tiny_model_path).restore(folder)


def test_stale_batch_takes_the_full_old_pass(tiny_model_path):
    """A batch sampled by older weights than the learner's never takes the fused path (which
    would set its ratio to 1): the old pass recomputes log-probs under the current weights."""
    learner = make_learner(tiny_model_path, train={"lr": 1e-2, "micro_batch_size": 8})
    batches = _batches(tiny_model_path, 2)
    fresh = learner.train_step(batches[0])
    assert fresh["learner/fused_old_pass"] == 1.0 and fresh["learner/stale_batch"] == 0.0
    assert fresh["logprob_gap/max_abs"] < 1e-5  # the old pass is the sampling policy
    stale = learner.train_step(batches[1])  # sampled at version 0, learner at version 1
    assert stale["learner/stale_batch"] == 1.0
    assert stale["learner/fused_old_pass"] == 0.0 and stale["learner/streamed_old_pass"] == 0.0
    # The old-policy log-probs are the current weights', not the batch's: they differ.
    assert stale["logprob_gap/mean_abs"] > 1e-4
    assert stale["policy/clip_frac"] >= 0.0
    assert learner.train_step(batches[1].replace(policy_version=2))["learner/fused_old_pass"] == 1.0


def test_lr_schedules_against_hand_values():
    kw = dict(warmup_steps=2, total_steps=12, min_ratio=0.1)
    assert [lr_multiplier(s, schedule="constant", **kw) for s in (0, 1, 2, 11)] == [0.5, 1.0, 1.0, 1.0]
    # linear: p = (s - 2) / 10
    assert lr_multiplier(7, schedule="linear", **kw) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_multiplier(12, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_multiplier(7, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(2, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(50, schedule="cosine", **kw) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, schedule="step", **kw)


def test_learner_follows_its_schedule(tiny_model_path):
    learner = make_learner(
        tiny_model_path, train={"lr": 1e-2, "lr_schedule": "linear", "warmup_steps": 2}, total_steps=4
    )
    lrs = []
    for b in _batches(tiny_model_path, 4):
        lrs.append(learner.train_step(b.replace(policy_version=learner.version))["learner/lr"])
    # warm-up over 2 steps, then linear decay to 0 over the remaining 2 (p = 0, 0.5)
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 5e-3])


def test_prompt_sampler_resumes_where_it_stopped():
    straight = PromptSampler(10, 4, seed=3)
    seen = [straight.next() for _ in range(6)]  # crosses two epoch boundaries
    first = PromptSampler(10, 4, seed=3)
    part = [first.next() for _ in range(2)]
    resumed = PromptSampler(10, 4, seed=3, **first.state_dict())
    assert part + [resumed.next() for _ in range(4)] == seen
    flat = [i for s in seen for i in s]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # each epoch reshuffled


def test_resume_needs_a_complete_checkpoint(tmp_path):
    from cluster.config import UserError
    from cluster.config.loading import load_config

    cfg = load_config(overrides=["run.steps=4"])
    with pytest.raises(UserError, match="no complete checkpoint"):
        RunContext(cfg, tmp_path / "run", resume=True)
    (tmp_path / "run" / "checkpoints" / "step_00002" / "trainer_state").mkdir(parents=True)
    assert latest_checkpoint(tmp_path / "run") is None  # a crash mid-save is not resumed from


def test_a_run_directory_named_relative_to_the_working_folder_resumes_from_an_absolute_checkpoint(
    tmp_path, monkeypatch
):
    """`rayrlhf train --resume runs/x`: the learners (Ray Train workers, in a folder of their own)
    load the checkpoint, so the run context hands them an absolute path."""
    import json
    import random

    from cluster.config.loading import load_config
    from cluster.run_context import RUN_STATE_FILE

    state = tmp_path / "runs" / "x" / "checkpoints" / "step_00002" / "trainer_state"
    state.mkdir(parents=True)
    rng = random.getstate()
    (state / RUN_STATE_FILE).write_text(
        json.dumps({"step": 2, "sampler": {"consumed": 8}, "version": 2, "python_rng": [rng[0], list(rng[1]), rng[2]]})
    )
    monkeypatch.chdir(tmp_path)
    ctx = RunContext(load_config(overrides=["run.steps=4"]), "runs/x", resume=True)
    assert ctx.dir == tmp_path / "runs" / "x"
    assert ctx.resume_from == state.parent and ctx.resume_from.is_absolute()


def test_registry_finds_the_ppo_learner():
    from learners.ppo import PPOLearner

    assert get_learner("ppo") is PPOLearner
    with pytest.raises(KeyError, match="registered: dpo, ppo, qlearn, reward_model, sft"):
        get_learner("nope")
