"""Shared-prefix forward passes: a prompt's samples run the prompt once; outputs and gradients
must equal running every row in full."""

import pytest
import torch

from learners.training.modeling import PolicyWithValueHead, decoder_hidden, sequence_logprobs, shared_prefix_hidden
from tests.helpers.factories import assert_grads_close, experience, flat_grads, grouped_batch, make_learner, tiny_lm


# Three prompts (lengths 5, 7, 4) with 3, 2 and 1 samples of ragged response lengths, rows
# right-padded, groups interleaved (not contiguous).
GROUPS = [10, 20, 10, 30, 20, 10]
PROMPT_LENS = {10: 5, 20: 7, 30: 4}


def _grouped_batch(vocab: int, seed: int = 0):
    ids, att, rm = grouped_batch(vocab, GROUPS, prompt_lens=PROMPT_LENS, seed=seed)
    return ids, att, rm, torch.tensor(GROUPS)


def _policy(tiny_model_path):
    torch.manual_seed(0)
    lm = tiny_lm(tiny_model_path)
    lm.config.use_cache = False
    model = PolicyWithValueHead(lm)
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    return model


def test_shared_prefix_matches_full_rows(tiny_model_path):
    model = _policy(tiny_model_path)
    ids, att, rm, groups = _grouped_batch(model.lm.config.vocab_size)
    outs, grads = [], []
    for group_ids in (None, groups):
        model.zero_grad()
        model.rows_shared = model.rows_total = 0
        out = model(ids, att, rm, with_values=True, with_entropy=True, group_ids=group_ids)
        # The grouped pass really ran through the shared-prefix path (every row of it).
        assert model.rows_shared == (0 if group_ids is None else len(GROUPS))
        ((out["logprobs"] * rm).sum() + (out["values"] * rm).sum()).backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    full, shared = outs
    for k in ("logprobs", "values", "entropy"):
        torch.testing.assert_close(shared[k], full[k], atol=1e-5, rtol=1e-5)
        assert (shared[k][~rm] == 0).all()
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4)


def test_shared_prefix_falls_back_when_it_cannot_share(tiny_model_path):
    model = _policy(tiny_model_path)
    decoder = model.lm.get_decoder()
    ids, att, rm, groups = _grouped_batch(model.lm.config.vocab_size)
    # Every row its own group: nothing to share.
    assert shared_prefix_hidden(decoder, ids, att, rm, torch.arange(len(groups))) is None
    # A group whose rows disagree on the prompt: refused rather than silently wrong.
    bad = ids.clone()
    bad[2, 1] = (bad[2, 1] + 1) % model.lm.config.vocab_size
    assert shared_prefix_hidden(decoder, bad, att, rm, groups) is None
    # A row with no output position (e.g. masked out as truncated).
    rm2 = rm.clone()
    rm2[3] = False
    assert shared_prefix_hidden(decoder, ids, att, rm2, groups) is None
    # ... and the forward still works (rows in full), matching the ungrouped pass.
    torch.testing.assert_close(model(bad, att, rm, group_ids=groups)["logprobs"], model(bad, att, rm)["logprobs"])


def test_sequence_logprobs_with_groups_matches(tiny_model_path):
    """The reference / old-policy pass: grouped micro-batches (a micro-batch boundary inside the
    batch, so ordering and scatter-back are exercised) give the same log-probs."""
    model = _policy(tiny_model_path)
    ids, att, rm, groups = _grouped_batch(model.lm.config.vocab_size, seed=1)
    with torch.no_grad():
        plain = sequence_logprobs(model.lm, ids, att, rm, micro_batch_size=4)
        grouped = sequence_logprobs(model.lm, ids, att, rm, micro_batch_size=4, group_ids=groups)
    torch.testing.assert_close(grouped, plain, atol=1e-5, rtol=1e-5)
    assert (grouped[~rm] == 0).all() and (grouped[rm] < 0).all()


def test_learner_update_is_the_same_with_and_without_sharing(tiny_model_path):
    """The gradient the optimiser gets (captured before clipping and the step) and the losses
    are those of the unshared passes; Adam's update is not compared (its first step is about
    lr * sign(grad), blind to the gradient's scale)."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm, groups = _grouped_batch(lm.config.vocab_size, seed=2)
    exp = experience(lm, ids, att, rm, [1.0, 0.0, 0.0, 1.0, 1.0, 0.5], groups=GROUPS, ref_shift=None)
    results = {}
    for shared in (False, True):
        learner = make_learner(
            tiny_model_path,
            seed=0,
            train={"lr": 1e-2, "epochs": 1, "num_minibatches": 1, "micro_batch_size": 3, "shared_prefix": shared},
            # Every row runs (the single-sample group has advantage 0), so the micro-batches are as below.
            ppo={"advantage_estimator": "grpo", "kl_coef": 0.0, "skip_zero_advantage": False},
        )
        captured = []
        learner.on_gradients = lambda params: captured.append(flat_grads(params))
        m = learner.train_step(exp)
        # Micro-batches of 3 rows keep groups together (sizes 3, 2, 1): the two multi-row groups share.
        assert m["learner/prefix_shared_frac"] == (0.0 if not shared else 1.0), m["learner/prefix_shared_frac"]
        assert m["learner/streamed_old_pass"] == 1.0
        assert m["logprob_gap/max_abs"] < 1e-5
        assert len(captured) == 1
        results[shared] = (m, captured[0])
    (m_full, g_full), (m_shared, g_shared) = results[False], results[True]
    assert g_full.abs().sum() > 0  # a real gradient, not two zeros agreeing
    torch.testing.assert_close(g_shared, g_full, atol=1e-6, rtol=1e-4)
    for k in ("loss/policy", "loss/total", "policy/entropy", "advantage/mean", "policy/grad_norm"):
        torch.testing.assert_close(m_shared[k], m_full[k], atol=1e-6, rtol=1e-4, msg=k)


def _decoder_calls(decoder):
    """A forward pre-hook spy: the mask rank of every decoder call (4: a custom tree mask)."""
    calls = []
    decoder.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["attention_mask"].dim()), with_kwargs=True)
    return calls


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("max_packed_len, expected_calls", [(1024, [4]), (0, [2, 2])])
def test_packed_tree_and_prompt_cache_equal_full_rows(tiny_model_path, attn, max_packed_len, expected_calls):
    """Both ways of sharing a prompt (one tree-masked packed row per group; the prompt's
    cache) give the full rows' hidden states and gradients, under both attention kernels that
    take a custom mask. The spy shows which way ran: one call with a (G, 1, T, T) mask, or the
    prompt pass then the continuation pass with 2-D padding masks."""
    lm = tiny_lm(tiny_model_path)
    lm.set_attn_implementation(attn)
    decoder = lm.get_decoder()
    ids, att, rm, groups = _grouped_batch(lm.config.vocab_size, seed=3)
    predicts = torch.zeros_like(rm)
    predicts[:, :-1] = rm[:, 1:]  # hidden[:, t-1] predicts token t
    full = decoder(input_ids=ids, attention_mask=att.long()).last_hidden_state
    (full[predicts] ** 2).sum().backward()
    g_full = {n: p.grad.clone() for n, p in decoder.named_parameters() if p.grad is not None}
    decoder.zero_grad()
    calls = _decoder_calls(decoder)
    shared = shared_prefix_hidden(decoder, ids, att, rm, groups, max_packed_len=max_packed_len)
    assert calls == expected_calls
    torch.testing.assert_close(shared[predicts], full[predicts], atol=1e-5, rtol=1e-5)
    assert (shared[~(predicts | rm)] == 0).all()  # prompt and padding states are not kept
    (shared[predicts] ** 2).sum().backward()
    assert_grads_close({n: p.grad for n, p in decoder.named_parameters() if p.grad is not None}, g_full)


def test_packed_rows_are_bounded(tiny_model_path):
    """A group whose packed row would exceed the bound goes through the prompt cache instead
    (the tree's attention grows with the square of the whole group's length)."""
    lm = tiny_lm(tiny_model_path)
    decoder = lm.get_decoder()
    ids, att, rm, groups = _grouped_batch(lm.config.vocab_size)
    packed_len = max(
        PROMPT_LENS[g] + sum(int(rm[i].sum()) for i, h in enumerate(GROUPS) if h == g) for g in PROMPT_LENS
    )
    calls = _decoder_calls(decoder)
    for bound, expected in ((packed_len, [4]), (packed_len - 1, [2, 2])):
        calls.clear()
        with torch.no_grad():
            shared_prefix_hidden(decoder, ids, att, rm, groups, max_packed_len=bound)
        assert calls == expected


def test_one_call_per_layer_runs_long_groups_in_full(tiny_model_path):
    """Sharded learners need every pass to run the decoder once (each layer's run is a collective):
    without the prompt cache, a group too long to pack is left to the caller's full rows (one
    call), and a packable group still takes its one packed call."""
    lm = tiny_lm(tiny_model_path)
    decoder = lm.get_decoder()
    ids, att, rm, groups = _grouped_batch(lm.config.vocab_size)
    calls = _decoder_calls(decoder)
    with torch.no_grad():
        assert shared_prefix_hidden(decoder, ids, att, rm, groups, max_packed_len=0, prompt_cache=False) is None
        assert calls == []
        full, shared = decoder_hidden(decoder, ids, att, rm, groups, one_call=True)
        assert calls == [4] and shared  # packable: one tree-masked call
        expected = decoder(input_ids=ids, attention_mask=att.long()).last_hidden_state
    predicts = torch.zeros_like(rm)
    predicts[:, :-1] = rm[:, 1:]
    torch.testing.assert_close(full[predicts], expected[predicts], atol=1e-5, rtol=1e-5)
