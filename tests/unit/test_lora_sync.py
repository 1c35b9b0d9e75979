"""Adapter-only LoRA syncs (``learners/training/lora_sync.py``): the factors a learner sends, merged by the
generator into its base weights, are exactly the weights peft merges; the bytes are the
adapter's; a malformed stream is an error, never a silently partial load."""

import pytest
import torch

from learners.training.lora_sync import SUFFIX_A, SUFFIX_B, BaseWeights, adapter_factors, merge_into_base, module_of
from tests.helpers.factories import trained_lora as _peft


def test_merged_factors_are_peft_merged_weights_and_fused_siblings_follow(tiny_model_path):
    model = _peft(tiny_model_path, ["q_proj", "v_proj", "up_proj"])
    factors = adapter_factors(model)
    base = BaseWeights(tiny_model_path)
    got = dict(merge_into_base(factors.items(), base))
    expected = model.merge_and_unload().state_dict()
    adapted = sorted(n[: -len(SUFFIX_A)] for n in factors if n.endswith(SUFFIX_A))
    assert len(adapted) == 3 * model.config.num_hidden_layers
    for name in adapted:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)
        assert not torch.equal(got[name], base(name).float())  # the adapter moved it
    # The module's other tensors come from the base folder, unchanged (k and o beside q and v; gate
    # and down beside up): an engine that fuses q, k and v reloads the whole fused layer.
    siblings = set(got) - set(adapted)
    assert siblings == {n for n in base._where if module_of(n) in {module_of(a) for a in adapted}} - set(adapted)
    assert "model.layers.0.self_attn.k_proj.weight" in siblings and "model.layers.0.mlp.down_proj.weight" in siblings
    assert not any("norm" in n or "embed" in n for n in siblings)
    for name in siblings:
        assert torch.equal(got[name], base(name))


def test_a_sync_moves_the_adapters_bytes(tiny_model_path):
    """r (in + out) numbers per adapted weight, not in x out."""
    r = 8
    model = _peft(tiny_model_path, ["q_proj", "v_proj"], r=r)
    factors = adapter_factors(model)
    lm = model.get_base_model()
    attn = lm.model.layers[0].self_attn
    per_layer = sum(r * (m.in_features + m.out_features) for m in (attn.q_proj.base_layer, attn.v_proj.base_layer))
    assert sum(t.numel() for t in factors.values()) == per_layer * lm.config.num_hidden_layers
    dense = sum(m.base_layer.weight.numel() for m in (attn.q_proj, attn.v_proj)) * lm.config.num_hidden_layers
    assert sum(t.numel() for t in factors.values()) < dense


def test_a_malformed_factor_stream_raises(tiny_model_path):
    base = BaseWeights(tiny_model_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    a, b = torch.zeros(2, 8), torch.zeros(8, 2)
    with pytest.raises(ValueError, match="without its lora_A"):
        list(merge_into_base([(name + SUFFIX_B, b)], base))
    with pytest.raises(ValueError, match="lora_A without lora_B"):
        list(merge_into_base([(name + SUFFIX_A, a)], base))
    with pytest.raises(KeyError, match="no weight"):
        base("model.layers.99.self_attn.q_proj.weight")


def test_an_adapter_factors_cannot_carry_syncs_merged_weights(tiny_model_path):
    """An embedding's adapter is not ``s B A`` on a linear weight: factors alone would leave the
    generators' embeddings stale, so such a learner sends merged weights (the embedding included)."""
    from tests.helpers.factories import make_learner

    learner = make_learner(tiny_model_path, lora={"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "embed_tokens"]})
    with pytest.raises(ValueError, match="model.embed_tokens"):
        adapter_factors(learner.model.lm)
    with learner.sync_weights(adapter=True) as weights:
        names = set(weights)
    assert "model.embed_tokens.weight" in names and not any(n.endswith((SUFFIX_A, SUFFIX_B)) for n in names)
    plain = make_learner(tiny_model_path, lora={"r": 4, "alpha": 8.0, "target_modules": ["q_proj"]})
    with plain.sync_weights(adapter=True) as weights:
        assert all(n.endswith((SUFFIX_A, SUFFIX_B)) for n in weights)
