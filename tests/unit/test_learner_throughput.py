"""Learner speed-ups that must leave the maths as it was: the fused AdamW kernel, weights cast
to bf16 once per optimiser step instead of once per micro-batch (PPO, DPO, SFT), and decoder
layers under torch.compile (``train.compile``); no Ray."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import learners.dpo
import learners.ppo
import learners.sft
from learners.training.modeling import decoder_layers, shared_weight_casts
from tests.helpers.factories import (
    experience,
    grouped_batch,
    make_dpo_learner,
    make_learner,
    make_sft_learner,
    preference_batch,
    ragged_batch,
    step_with_grads,
    tiny_lm,
)


def test_optimizer_is_the_fused_adamw_kernel_with_the_plain_update(tiny_model_path):
    """The learners' AdamW runs PyTorch's fused kernel; its updates equal the per-tensor loop's
    (the reference implementation) over several steps of changing gradients."""
    learner = make_learner(tiny_model_path, train={"lr": 1e-2, "weight_decay": 0.1})
    assert learner.optimizer.defaults["fused"] is True
    params = learner.trainable
    start = [p.detach().clone() for p in params]
    twins = [s.clone().requires_grad_() for s in start]
    groups, i = [], 0
    for g in learner.optimizer.param_groups:  # the same groups and hyperparameters, looped
        n = len(g["params"])
        groups.append(
            {**{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")}, "params": twins[i : i + n]}
        )
        i += n
    loop = torch.optim.AdamW(groups, foreach=False, fused=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # past Adam's sign-like first step, so that scale errors would show
        for p, t in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            t.grad = p.grad.clone()
        learner.optimizer.step()
        loop.step()
    moved = [(p.detach() - s) for p, s in zip(params, start)]
    assert sum(float(m.abs().sum()) for m in moved) > 0
    for m, t, s in zip(moved, twins, start):
        torch.testing.assert_close(m, t.detach() - s, rtol=1e-4, atol=1e-7)


class _CountWeightCasts(TorchDispatchMode):
    """Counts casts of the given tensors' storage to bf16 (autocast's weight casts)."""

    def __init__(self, tensors):
        super().__init__()
        self.ptrs = {t.data_ptr() for t in tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.ops.aten._to_copy.default
            and kwargs.get("dtype") == torch.bfloat16
            and args[0].data_ptr() in self.ptrs
        ):
            self.count += 1
        return func(*args, **kwargs)


_TRAIN = {"bf16": True, "num_minibatches": 2, "micro_batch_size": 2, "lr": 5e-2}


def _ppo(path):
    lm = tiny_lm(path)
    ids, att, rm = ragged_batch(lm.config.vocab_size, b=8)
    exp = experience(lm, ids, att, rm, [1, 0, 1, 0, 0, 1, 1, 0], groups=[0, 0, 1, 1, 2, 2, 3, 3], ref_shift=0.05)
    return make_learner(path, train=_TRAIN), exp


def _dpo(path):  # 4 pairs: 2 per minibatch, 1 per micro-batch
    return make_dpo_learner(path, train=_TRAIN), preference_batch(tiny_lm(path), 4, seed=2, ref_shift=0.05)


def _sft(path):
    lm = tiny_lm(path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, list(range(8)), seed=1)
    return make_sft_learner(path, train=_TRAIN), experience(
        lm, ids, att, rm, [0.0] * 8, groups=list(range(8)), ref_shift=None
    )


def _two_minibatch_step(path, make, module, share: bool, monkeypatch):
    """Gradients of both optimiser steps of one step (2 minibatches x 2 micro-batches, bf16), and
    the weight casts it made in forward passes' worth; ``share=False`` runs every micro-batch's
    autocast on its own."""
    monkeypatch.setattr(
        module,
        "shared_weight_casts",
        shared_weight_casts if share else (lambda bf16, device: shared_weight_casts(False, device)),
    )
    learner, batch = make(path)
    grads = []
    learner.on_gradients = lambda params: grads.append([p.grad.detach().clone() for p in params])
    weights = [p for p in learner.model.lm.parameters() if p.dim() == 2]
    one_pass = _CountWeightCasts(weights)
    with one_pass, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        learner.model.lm(input_ids=batch.input_ids[:2])
    counter = _CountWeightCasts(weights)
    with counter:
        learner.train_step(batch)
    return grads, counter.count / one_pass.count


def _assert_same_gradients(shared, alone):
    """Equal gradients in both optimiser steps: the second step's casts are of the weights the
    first step updated (a cast kept across the optimiser step would use the old weights)."""
    assert len(shared) == len(alone) == 2
    for step in range(2):
        assert any(float(g.abs().sum()) > 0 for g in shared[step])
        for a, b in zip(shared[step], alone[step]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_weights_are_cast_once_per_optimiser_step_with_the_same_gradients(tiny_model_path, monkeypatch):
    shared, n_shared = _two_minibatch_step(tiny_model_path, _ppo, learners.ppo, True, monkeypatch)
    alone, n_alone = _two_minibatch_step(tiny_model_path, _ppo, learners.ppo, False, monkeypatch)
    # The old-policy pass takes 4 micro-batches of 2 rows (each its own autocast region either
    # way); then each of the 2 optimiser steps casts once for its 2 micro-batches, where alone
    # each micro-batch casts again.
    assert (n_shared, n_alone) == (4 + 2, 4 + 4)
    _assert_same_gradients(shared, alone)


@pytest.mark.parametrize("algorithm", ["dpo", "sft"])
def test_dpo_and_sft_share_weight_casts_with_the_same_gradients(tiny_model_path, monkeypatch, algorithm):
    make, module = {"dpo": (_dpo, learners.dpo), "sft": (_sft, learners.sft)}[algorithm]
    shared, n_shared = _two_minibatch_step(tiny_model_path, make, module, True, monkeypatch)
    alone, n_alone = _two_minibatch_step(tiny_model_path, make, module, False, monkeypatch)
    assert n_alone - n_shared == 2  # one cast fewer in each of the 2 optimiser steps
    _assert_same_gradients(shared, alone)


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}], ids=["full", "lora"])
def test_compiled_decoder_layers_give_the_eager_gradients(tiny_model_path, lora):
    """``train.compile``: the decoder layers run under ``torch.compile`` (inductor, dynamic shapes)
    with the eager gradients, fully trained or with LoRA adapters. A GRPO batch of shared prompts
    (packed tree rows) in 2 micro-batches, then from the same weights a batch of another width
    and length: a graph compiled for the first shapes must not be reused wrongly for the second."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    lm = tiny_lm(tiny_model_path)
    batches = []
    for seed, groups in ((0, [0, 0, 0, 0, 1, 1, 1, 1]), (1, [0, 0, 1, 1, 2, 2])):
        ids, att, rm = grouped_batch(lm.config.vocab_size, groups, seed=seed)
        batches.append(
            experience(lm, ids, att, rm, [float(i % 2) for i in range(len(groups))], groups=groups, ref_shift=None)
        )
    ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0, "loss_agg": "token_mean"}
    eager, compiled = (
        make_learner(tiny_model_path, train={"micro_batch_size": 4, "compile": c}, ppo=ppo, lora=lora)
        for c in (False, True)
    )
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled.model.lm))
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(eager.model.lm))
    for batch in batches:
        compiled.model.load_state_dict(eager.model.state_dict())  # the same weights for both
        want, m_eager = step_with_grads(eager, batch.replace(policy_version=eager.version))
        got, m_compiled = step_with_grads(compiled, batch.replace(policy_version=compiled.version))
        scale = float(want["g"].abs().max())
        assert scale > 0
        torch.testing.assert_close(got["g"], want["g"], atol=3e-5 * scale, rtol=1e-4)
        assert m_compiled["loss/policy"] == pytest.approx(m_eager["loss/policy"], abs=1e-6)
    # Dynamo really captured the layers (graphs compiled; the eager learner made none).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before
