"""Short-row attention as matrix multiplies (``learners/training/attention.py``): the same attention as
PyTorch's sdpa for every mask form transformers passes, and the models that use it give sdpa's
hidden states and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from learners.training import attention
from learners.training.attention import ATTENTION, matmul_attention, register, use_matmul_attention
from learners.training.modeling import shared_prefix_hidden
from tests.helpers.factories import assert_grads_close, grouped_batch, make_learner, tiny_lm


def _qkv(b=2, heads=6, kv_heads=2, q=5, k=5, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, heads, q, d, generator=g),
        torch.randn(b, kv_heads, k, d, generator=g),
        torch.randn(b, kv_heads, k, d, generator=g),
    )


def _sdpa(q, k, v, mask=None, is_causal=False):
    """The reference: torch's sdpa with the key/value heads repeated for grouped queries."""
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, is_causal=is_causal
    )
    return out.transpose(1, 2)


def test_matmul_attention_equals_sdpa_for_every_mask_form():
    q, k, v = _qkv()
    scale = q.shape[-1] ** -0.5
    # No mask, causal (queries and keys aligned, as transformers passes it).
    torch.testing.assert_close(matmul_attention(q, k, v, None, scale, True), _sdpa(q, k, v, is_causal=True))
    # No mask, not causal.
    torch.testing.assert_close(matmul_attention(q, k, v, None, scale, False), _sdpa(q, k, v))
    # A boolean (B, 1, q, k) mask: padding keys and a tree pattern.
    mask = torch.ones(5, 5, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
    mask[0, 0, 3:, 1] = False
    mask[1, 0, :, 4] = False
    mask[1, 0, 4, 4] = True
    torch.testing.assert_close(matmul_attention(q, k, v, mask, scale, False), _sdpa(q, k, v, mask))
    # The same mask as additive floats.
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    torch.testing.assert_close(matmul_attention(q, k, v, additive, scale, False), _sdpa(q, k, v, additive))
    # Fewer queries than keys (continuations against a cached prompt) with a boolean mask.
    q2, k2, v2 = _qkv(q=3, k=7, seed=1)
    mask2 = torch.ones(3, 7, dtype=torch.bool).tril(4)[None, None].repeat(2, 1, 1, 1)
    mask2[1, 0, :, 0] = False
    torch.testing.assert_close(matmul_attention(q2, k2, v2, mask2, scale, False), _sdpa(q2, k2, v2, mask2))


def test_a_fully_masked_row_stays_finite():
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[0, 0, 2] = False
    out = matmul_attention(q, k, v, mask, 1.0, False)
    assert torch.isfinite(out).all()


def test_only_short_rows_on_the_cpu_run_as_matmuls():
    cpu = torch.device("cpu")
    assert use_matmul_attention(cpu, 160, 160)
    assert use_matmul_attention(cpu, 1, attention.SHORT_MAX_PAIRS)
    assert not use_matmul_attention(cpu, 257, 256)
    assert not use_matmul_attention(torch.device("cuda"), 16, 16)
    assert not use_matmul_attention(torch.device("meta"), 16, 16)


def _counting(monkeypatch):
    calls = []
    real = attention.matmul_attention

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(attention, "matmul_attention", spy)
    return calls


@pytest.mark.parametrize("packed", [False, True])
def test_a_model_on_it_equals_sdpa_in_values_and_gradients(tiny_model_path, monkeypatch, packed):
    """Full padded rows (transformers builds the mask) and packed tree rows (a custom 4-D mask):
    hidden states and every parameter's gradient equal sdpa's, and the matmul path really ran."""
    results = {}
    for impl in ("sdpa", register()):
        lm = tiny_lm(tiny_model_path)
        lm.set_attn_implementation(impl)
        decoder = lm.get_decoder()
        ids, att, rm = grouped_batch(lm.config.vocab_size, [1, 2, 1, 2, 1], prompt_lens={1: 5, 2: 3})
        calls = _counting(monkeypatch)
        if packed:
            hidden = shared_prefix_hidden(decoder, ids, att, rm, torch.tensor([1, 2, 1, 2, 1]))
        else:
            hidden = decoder(input_ids=ids, attention_mask=att.long()).last_hidden_state
        (hidden[att] ** 2).sum().backward()
        assert len(calls) == (lm.config.num_hidden_layers if impl == ATTENTION else 0)
        results[impl] = hidden.detach(), {n: p.grad.clone() for n, p in decoder.named_parameters()}
    (h_ref, g_ref), (h, g) = results["sdpa"], results[ATTENTION]
    torch.testing.assert_close(h[att], h_ref[att], atol=1e-5, rtol=1e-5)
    assert_grads_close(g, g_ref)


def test_learners_and_the_reference_load_their_models_with_it(tiny_model_path):
    from actors.reference import Reference

    assert make_learner(tiny_model_path).model.lm.config._attn_implementation == ATTENTION
    assert Reference(tiny_model_path, micro_batch_size=3).model.config._attn_implementation == ATTENTION
