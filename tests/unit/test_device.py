"""Learners are device-agnostic: every tensor they create lands where their model and batch are.

On a GPU learner the model and batch live on ``cuda`` while a factory call without ``device=``
(``torch.zeros(n)``) makes a CPU tensor, and mixing the two raises. This machine has no GPU, so
the tests build the same mismatch on the CPU: the model and batch stay on the CPU while the
*default* device is ``meta`` (``with torch.device("meta")``). A tensor created without an explicit
device then lands on ``meta``, apart from the model's: mixing it with real data raises, and an
index or counter created there holds garbage, which the comparison with the plain step catches.

The optimiser's own step runs with the CPU as default: torch's AdamW keeps its step counters on
the default device on purpose (CPU scalars beside CUDA parameters), so it is not ours to check.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from tests.helpers.factories import (
    experience,
    grouped_batch,
    make_dpo_learner,
    make_learner,
    make_q_learner,
    make_rm_learner,
    make_sft_learner,
    preference_batch,
    step_with_grads,
    tiny_lm,
    transitions_batch,
)

GROUPS = [10, 10, 20, 10, 20, 30, 30]
SCORES = [1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0]


@contextlib.contextmanager
def foreign_default_device(learner):
    """``meta`` as the default device of factory calls for the duration (the optimiser's step aside)."""
    step = learner.optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's mark on it
    def step_with_cpu_default(*args, **kwargs):
        with torch.device("cpu"):
            return step(*args, **kwargs)

    learner.optimizer.step = step_with_cpu_default
    try:
        with torch.device("meta"):
            yield
    finally:
        learner.optimizer.step = step


def _same_step(build, batch, evaluate=False):
    """One step (or held-out evaluation) of two identical learners, plain and with a foreign
    default device: equal gradients (before the optimiser) and metrics."""
    plain, foreign = build(), build()
    if evaluate:
        m_plain = plain.evaluate(batch)
        with foreign_default_device(foreign):
            m_foreign = foreign.evaluate(batch)
    else:
        g_plain, m_plain = step_with_grads(plain, batch)
        with foreign_default_device(foreign):
            g_foreign, m_foreign = step_with_grads(foreign, batch)
        assert g_plain["g"].abs().sum() > 0  # a real gradient
        torch.testing.assert_close(g_foreign["g"], g_plain["g"], atol=1e-6, rtol=1e-5)
    for key, value in m_plain.items():
        if key.endswith("_s"):
            continue  # timings
        assert m_foreign[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    return m_plain


def _ppo_batch(path):
    lm = tiny_lm(path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, GROUPS, seed=3)
    return experience(lm, ids, att, rm, SCORES, groups=GROUPS, ref_shift=0.05)


def test_the_sentinel_catches_a_tensor_created_without_a_device():
    """The check itself: a factory call without ``device=`` under it fails against CPU data."""
    data = torch.ones(3)
    with torch.device("meta"), pytest.raises(RuntimeError, match="meta"):
        _ = data + torch.zeros(3)
    with torch.device("meta"):
        assert (data + torch.zeros(3, device=data.device)).device == data.device


@pytest.mark.parametrize(
    ("estimator", "micro", "path_key"),
    [
        ("gae", 2, None),  # separate old-policy pass, critic, KL in the reward, ragged micro-batches
        ("grpo", 8, "learner/fused_old_pass"),
        ("grpo", 2, "learner/streamed_old_pass"),
    ],
)
def test_ppo_step_creates_every_tensor_on_the_models_device(tiny_model_path, estimator, micro, path_key):
    batch = _ppo_batch(tiny_model_path)
    kl = 0.1 if estimator == "gae" else 0.0
    ppo = {"advantage_estimator": estimator, "kl_coef": kl, "rollout_correction": "truncate"}
    metrics = _same_step(lambda: make_learner(tiny_model_path, train={"micro_batch_size": micro}, ppo=ppo), batch)
    if path_key:
        assert metrics[path_key] == 1.0
    assert metrics["learner/prefix_shared_frac"] > 0  # the shared-prompt path ran too


def test_ppo_off_policy_minibatch_epochs_and_lora_reference(tiny_model_path):
    """Shuffled minibatch epochs of a stale batch, with the LoRA learner's own reference pass."""
    batch = _ppo_batch(tiny_model_path).replace(ref_logprobs=None)
    train = {"micro_batch_size": 3, "epochs": 2, "num_minibatches": 2}
    ppo = {"advantage_estimator": "grpo", "kl_coef": 0.05}
    lora = {"r": 4, "alpha": 8.0}
    metrics = _same_step(lambda: make_learner(tiny_model_path, train=train, ppo=ppo, lora=lora), batch)
    assert metrics["learner/fused_old_pass"] == 0.0 and metrics["learner/streamed_old_pass"] == 0.0
    assert metrics["learner/ref_s"] > 0  # the reference pass ran (LoRA starts at the base: KL 0)


@pytest.mark.parametrize("evaluate", [False, True])
def test_dpo_creates_every_tensor_on_the_models_device(tiny_model_path, evaluate):
    batch = preference_batch(tiny_lm(tiny_model_path), 3, seed=1, ref_shift=0.1)
    _same_step(lambda: make_dpo_learner(tiny_model_path, train={"micro_batch_size": 2}), batch, evaluate)


@pytest.mark.parametrize("evaluate", [False, True])
def test_reward_model_creates_every_tensor_on_the_models_device(tiny_model_path, evaluate):
    batch = preference_batch(tiny_lm(tiny_model_path), 3, seed=1, ref_shift=None)
    _same_step(lambda: make_rm_learner(tiny_model_path, train={"micro_batch_size": 2}), batch, evaluate)


@pytest.mark.parametrize("evaluate", [False, True])
def test_sft_creates_every_tensor_on_the_models_device(tiny_model_path, evaluate):
    batch = _ppo_batch(tiny_model_path)
    _same_step(lambda: make_sft_learner(tiny_model_path, train={"micro_batch_size": 3}), batch, evaluate)


@pytest.mark.parametrize("evaluate", [False, True])
@pytest.mark.parametrize("rewards", ["per_token", "scores"])
def test_qlearn_creates_every_tensor_on_the_models_device(tiny_model_path, evaluate, rewards):
    batch = transitions_batch([5, 6, 7], [([10, 12, 2], [0, 0, 1.0]), ([10, 2], [0, 0.3]), ([11, 2], [0.1, 0.5])])
    if rewards == "scores":  # a sequence reward, put on the last action
        batch = batch.replace(token_rewards=None, scores=torch.tensor([1.0, -0.5, 0.25]))
    qlearn = {"n_step": 2, "mc_lower_bound": True}
    _same_step(lambda: make_q_learner(tiny_model_path, train={"micro_batch_size": 2}, qlearn=qlearn), batch, evaluate)


def test_a_cpu_batch_reaches_the_learners_device_and_checkpoints_are_cpu_tensors(tiny_model_path, tmp_path):
    """``Experience.to`` moves every tensor (a no-op on the same device); the weights a learner
    hands out for a checkpoint are CPU copies, whatever its device."""
    batch = _ppo_batch(tiny_model_path)
    assert batch.to("cpu") is batch
    moved = batch.to("meta")
    tensors = [v for v in vars(moved).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) >= 8 and all(t.device.type == "meta" for t in tensors)
    learner = make_learner(tiny_model_path)
    assert learner.device == torch.device("cpu")
    assert learner.on_device(batch) is batch
    assert all(t.device.type == "cpu" for t in learner.policy_state_dict().values())


def test_the_reference_scores_on_its_device_and_returns_on_the_records(tiny_model_path):
    """The Reference actor's class: log-probs with a foreign default device equal the plain ones,
    and come back on the record's device."""
    from actors.reference import Reference

    batch = _ppo_batch(tiny_model_path)
    ref = Reference(tiny_model_path, micro_batch_size=3)
    assert ref.device == torch.device("cpu")
    plain = ref.logprobs(batch)
    with torch.device("meta"):
        foreign = ref.logprobs(batch)
    assert foreign.device == batch.input_ids.device
    assert plain[batch.response_mask].abs().sum() > 0
    torch.testing.assert_close(foreign, plain, atol=1e-6, rtol=1e-5)
