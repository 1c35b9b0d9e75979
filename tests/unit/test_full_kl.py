"""The exact KL over the vocabulary (``ppo.kl_loss_estimator: full``): the pure function against
hand values, a naive loop and its closed-form gradient; the row-chunked head against one chunk;
the learner's KL-loss gradient against autograd through the whole models' logits, with the
reference as LoRA's base model and as the learners' own frozen copy."""

import math

import pytest
import torch

from learners.objectives.losses import full_kl
from learners.training.modeling import full_kl_at_positions
from tests.helpers.factories import experience, flat_grads, grouped_batch, make_learner, tiny_lm


def test_hand_values():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3).
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    ref = torch.tensor([[0.0, math.log(3.0)], [2.0, 2.0]])
    torch.testing.assert_close(full_kl(logits, ref), torch.tensor([0.5 * math.log(4 / 3), 0.0]))
    # At temperature 2 the same logits doubled give the same distributions.
    torch.testing.assert_close(full_kl(2 * logits, 2 * ref, temperature=2.0), full_kl(logits, ref))


def test_matches_a_naive_loop_and_is_not_symmetric():
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(5, 37, generator=g) * 3, torch.randn(5, 37, generator=g) * 3
    for t in (1.0, 0.7):
        naive = []
        for row, ref_row in zip(logits.tolist(), ref.tolist()):
            zp = sum(math.exp(z / t) for z in row)
            zq = sum(math.exp(z / t) for z in ref_row)
            naive.append(
                sum(
                    math.exp(a / t) / zp * (math.log(math.exp(a / t) / zp) - math.log(math.exp(b / t) / zq))
                    for a, b in zip(row, ref_row)
                )
            )
        torch.testing.assert_close(full_kl(logits, ref, t), torch.tensor(naive), atol=1e-5, rtol=1e-5)
    assert (full_kl(logits, ref) - full_kl(ref, logits)).abs().max() > 1e-2


def test_gradient_is_the_closed_form_and_reaches_the_policy_only():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 11, generator=g) * 2).requires_grad_()
    ref = (torch.randn(4, 11, generator=g) * 2).requires_grad_()
    t = 0.8
    kl = full_kl(logits, ref, t)
    kl.sum().backward()
    logp, logq = torch.log_softmax(logits.detach() / t, -1), torch.log_softmax(ref.detach() / t, -1)
    expected = logp.exp() * (logp - logq - kl.detach()[:, None]) / t
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=1e-5)
    assert ref.grad is None


def test_chunked_positions_equal_the_whole_logits():
    """Row chunks of 3 and one chunk give the KL of the full (B, L, V) logits, and the same
    gradient on the hidden states; zero outside the positions."""
    g = torch.Generator().manual_seed(2)
    b, length, h_dim, vocab = 3, 6, 8, 29
    hidden = torch.randn(b, length, h_dim, generator=g).requires_grad_()
    ref_hidden = torch.randn(b, length, h_dim, generator=g)
    head = torch.nn.Linear(h_dim, vocab, bias=False)
    ref_w = torch.randn(vocab, h_dim, generator=g)
    ids = torch.randint(0, vocab, (b, length), generator=g)
    pos = torch.zeros(b, length, dtype=torch.bool)
    pos[:, 3:] = True
    pos[2, 5] = False
    outs, grads = [], []
    for chunk in (3, 1024):
        hidden.grad = None
        out = full_kl_at_positions(hidden, ref_hidden, ids, pos, head, ref_w, temperature=0.9, chunk=chunk)
        out.sum().backward()
        outs.append(out.detach())
        grads.append(hidden.grad.clone())
    with torch.no_grad():
        whole = full_kl(head(hidden).reshape(-1, vocab), (ref_hidden @ ref_w.T).reshape(-1, vocab), 0.9)
    # hidden[:, t-1] predicts token t.
    expected = torch.zeros(b, length)
    expected[:, 1:] = whole.reshape(b, length)[:, :-1]
    expected[~pos] = 0
    for out, grad in zip(outs, grads):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, grads[0])
    assert float(expected.abs().sum()) > 0


def _naive_kl_gradient(learner, reference_lm, batch, coef):
    """coef x the token mean over the response of KL(policy || reference), through the whole
    models' (B, L, V) logits: its gradient on the learner's trainable parameters."""
    learner.model.zero_grad(set_to_none=True)
    ids, att, rm = batch.input_ids, batch.attention_mask, batch.response_mask
    logits = learner.model.lm(input_ids=ids, attention_mask=att.long()).logits[:, :-1]
    with torch.no_grad():
        if reference_lm is None:  # LoRA: the base model is the reference
            with learner.model.lm.disable_adapter():
                ref = learner.model.lm(input_ids=ids, attention_mask=att.long()).logits[:, :-1]
        else:
            ref = reference_lm(input_ids=ids, attention_mask=att.long()).logits[:, :-1]
    kl = full_kl(logits.reshape(-1, logits.shape[-1]), ref.reshape(-1, ref.shape[-1])).reshape(logits.shape[:2])
    mask = rm[:, 1:].float()
    (coef * (kl * mask).sum() / mask.sum()).backward()
    return flat_grads(learner.trainable)


@pytest.mark.parametrize("reference", ["lora", "learners"])
def test_the_learners_kl_loss_gradient_is_the_exact_kl_gradient(tiny_model_path, reference):
    """A first step moves the policy from the reference; on a second batch whose groups are scored
    evenly (no policy-gradient term) the gradient the optimiser sees is the KL term's, equal to
    autograd through both models' whole logits. The sampled k3 term's gradient differs."""
    lm = tiny_lm(tiny_model_path)
    groups = [0, 0, 1, 1, 2, 2]
    ids, att, rm = grouped_batch(lm.config.vocab_size, groups, seed=5)
    first = experience(lm, ids, att, rm, [1.0, 0.0, 0.0, 1.0, 0.3, 0.9], groups=groups, ref_shift=None)
    even = experience(lm, ids, att, rm, [0.5] * 6, groups=groups, ref_shift=None)
    lora = {"r": 4, "alpha": 8} if reference == "lora" else None
    train = {"micro_batch_size": 4, "lr": 0.05, **({} if lora else {"reference": "learners"})}
    grads = {}
    for estimator in ("full", "k3"):
        ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0, "kl_loss_coef": 0.7, "kl_loss_estimator": estimator}
        learner = make_learner(tiny_model_path, train=train, ppo=ppo, lora=lora)
        learner.train_step(first)
        captured = []
        learner.on_gradients = lambda params: captured.append(flat_grads(params))
        metrics = learner.train_step(even.replace(policy_version=learner.version))
        grads[estimator] = captured[0]
        if estimator == "full":
            assert metrics["kl/loss_term"] > 1e-4
            rewound = _rewound(tiny_model_path, train, ppo, lora, first)
            naive = _naive_kl_gradient(rewound, None if lora else tiny_lm(tiny_model_path), even, 0.7)
            torch.testing.assert_close(grads["full"], naive, atol=1e-6, rtol=1e-4)
    assert float(grads["full"].abs().sum()) > 0
    assert (grads["full"] - grads["k3"]).abs().max() > 1e-5


def _rewound(path, train, ppo, lora, first):
    """A learner after the same first step (deterministic): the weights the second step starts from."""
    learner = make_learner(path, train=train, ppo=ppo, lora=lora)
    learner.train_step(first)
    learner.model.train()
    return learner


def test_the_config_refuses_a_full_kl_it_cannot_run():
    """The full KL reads the frozen model in the learners and is the KL loss term's estimator:
    one clear line for each thing missing."""
    from cluster.config import ConfigError
    from cluster.config.loading import load_config

    full = ["ppo.kl_loss_estimator=full"]
    with pytest.raises(ConfigError, match="train.reference=learners"):
        load_config(None, full + ["ppo.kl_loss_coef=0.1"])
    with pytest.raises(ConfigError, match="kl_loss_coef > 0"):
        load_config(None, full + ["train.reference=learners"])
    with pytest.raises(ConfigError, match="without ppo.teacher"):
        load_config(None, full + ["ppo.kl_loss_coef=0.1", "lora.enabled=true", "ppo.teacher=/some/model"])
    load_config(None, full + ["ppo.kl_loss_coef=0.1", "train.reference=learners"])
    load_config(None, full + ["ppo.kl_loss_coef=0.1", "lora.enabled=true"])
