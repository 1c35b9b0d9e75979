"""Many LoRA adapters on one base model (``actors/lora_tenants.py``): a tenant trained beside
others ends exactly as the same tenant trained alone, a tenant loaded from its saved state
continues exactly as the uninterrupted one, and a refused request leaves its tenant untouched."""

import json

import pytest
import torch

from actors.lora_tenants import AdamStep, AdapterSpec, Datum, LoraTenants

ADAM = AdamStep(learning_rate=1e-2)


@pytest.fixture(scope="module")
def tenants(tiny_model_path):
    return LoraTenants(tiny_model_path, max_adapters=16)


def _batch(seed: int) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (7, 4):
        tokens = torch.randint(0, 500, (n + 1,), generator=g).tolist()
        out.append(Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(n)}))
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tenant_trained_beside_others_ends_as_trained_alone(tenants):
    tenants.create("alone", AdapterSpec(rank=4, seed=11))
    losses = []
    for _ in range(3):
        losses.append(tenants.forward_backward("alone", _batch(0), "cross_entropy", {})["metrics"]["loss:sum"])
        tenants.optim_step("alone", ADAM)
    assert losses[2] < losses[1] < losses[0]

    tenants.create("a", AdapterSpec(rank=4, seed=11))
    tenants.create("b", AdapterSpec(rank=8, seed=12, train_mlp=False))
    for _ in range(3):  # b's calls land between a's forward_backward and its optim_step
        tenants.forward_backward("a", _batch(0), "cross_entropy", {})
        tenants.forward_backward("b", _batch(1), "cross_entropy", {})
        tenants.optim_step("b", ADAM)
        tenants.forward_backward("b", _batch(1), "cross_entropy", {}, forward_only=True)
        tenants.optim_step("a", ADAM)
    assert _equal(tenants.adapter_weights("a"), tenants.adapter_weights("alone"))
    assert not _equal(tenants.adapter_weights("b"), tenants.adapter_weights("alone"))


def test_a_tenant_loaded_from_its_state_continues_as_the_uninterrupted_one(tenants, tmp_path):
    tenants.create("orig", AdapterSpec(rank=4, seed=3))
    for _ in range(2):
        tenants.forward_backward("orig", _batch(2), "cross_entropy", {})
        tenants.optim_step("orig", ADAM)
    folder = tenants.save("orig", str(tmp_path / "state"))
    config = json.loads((tmp_path / "state" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == tenants.base_path
    tenants.load("copy", folder)
    assert _equal(tenants.adapter_weights("copy"), tenants.adapter_weights("orig"))
    for _ in range(2):
        for m in ("orig", "copy"):
            tenants.forward_backward(m, _batch(3), "cross_entropy", {})
            tenants.optim_step(m, ADAM)
    # Equal only if Adam's moments and step counts came back too.
    assert _equal(tenants.adapter_weights("copy"), tenants.adapter_weights("orig"))
    tenants.load("fresh-optimizer", folder, optimizer=False)
    tenants.forward_backward("fresh-optimizer", _batch(3), "cross_entropy", {})
    tenants.optim_step("fresh-optimizer", ADAM)
    tenants.load("again", folder)
    tenants.forward_backward("again", _batch(3), "cross_entropy", {})
    tenants.optim_step("again", ADAM)
    assert not _equal(tenants.adapter_weights("fresh-optimizer"), tenants.adapter_weights("again"))


def test_a_refused_request_leaves_its_tenant_untouched(tenants):
    tenants.create("t", AdapterSpec(rank=4, seed=5))
    before = tenants.adapter_weights("t")
    bad_token = [Datum([1, 2, 10**6], {"target_tokens": torch.tensor([2, 3, 4])})]
    with pytest.raises(ValueError, match="datum 0: a token is outside the vocabulary"):
        tenants.forward_backward("t", bad_token, "cross_entropy", {})
    bad_shape = [Datum([1, 2, 3], {"target_tokens": torch.tensor([2, 3])})]
    with pytest.raises(ValueError, match="datum 2: target_tokens has shape"):
        tenants.forward_backward("t", _batch(0) + bad_shape, "cross_entropy", {})
    with pytest.raises(ValueError, match="unknown model_id"):
        tenants.optim_step("nobody", ADAM)
    with pytest.raises(ValueError, match="rank 500"):
        tenants.create("big", AdapterSpec(rank=500))
    assert all(p.grad is None for p in tenants.tenants["t"]["params"])
    tenants.optim_step("t", ADAM)  # no gradient: Adam moves nothing
    assert _equal(tenants.adapter_weights("t"), before)
