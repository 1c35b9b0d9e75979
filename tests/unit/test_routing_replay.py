"""Rollout routing replay (``learners/training/routing.py``): replayed experts, R3's gate weights,
their gradient against a reference forward that takes the recorded experts explicitly, the
fallback where a route is missing, and the router health metrics."""

from __future__ import annotations

import pytest
import torch

from learners.training.routing import (
    RouterStats,
    load_balancing_loss,
    replay_routes,
    replayed_topk,
    route_mismatch,
    routers,
)


def _tiny_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        mlp_only_layers=[],
        decoder_sparse_step=1,
    )
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for r in routers(model):
            r.weight.normal_(0, 0.5)
    return model


def test_hand_values_of_the_replayed_weights():
    # softmax([0, ln 2, ln 3, ln 4]) = [0.1, 0.2, 0.3, 0.4]; the router's own top-2 is {3, 2}.
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    w, e, rep, own = replayed_topk(logits, torch.tensor([[0, 1]]), 2, normalise=True)
    assert e.tolist() == [[0, 1]] and rep.tolist() == [True] and sorted(own[0].tolist()) == [2, 3]
    assert torch.allclose(w, torch.tensor([[1 / 3, 2 / 3]]))
    w, _, _, _ = replayed_topk(logits, torch.tensor([[0, 1]]), 2, normalise=False)
    assert torch.allclose(w, torch.tensor([[0.1, 0.2]]))
    # A missing route (-1 anywhere in the row) falls back to the router's own choice.
    w, e, rep, _ = replayed_topk(logits, torch.tensor([[0, -1]]), 2, normalise=True)
    assert rep.tolist() == [False] and sorted(e[0].tolist()) == [2, 3]
    assert torch.allclose(w.sort(-1).values, torch.tensor([[3 / 7, 4 / 7]]))


def test_mismatch_ignores_the_order_within_the_top_k():
    own = torch.tensor([[1, 2], [1, 2], [0, 3]])
    assert route_mismatch(own, torch.tensor([[2, 1], [1, 3], [3, 0]])).tolist() == [False, True, False]


def _explicit_forward(model, ids, routes):
    """Reference: each MoE block computed by hand from the recorded experts (R3 eq. 4 weights)."""
    inner = model.model
    h = inner.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    cos_sin = inner.rotary_emb(h, pos)
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
    for layer_index, layer in enumerate(inner.layers):
        res = h
        a, _ = layer.self_attn(layer.input_layernorm(h), position_embeddings=cos_sin, attention_mask=mask)
        h = res + a
        x = layer.post_attention_layernorm(h).reshape(-1, h.shape[-1])
        gate, experts = layer.mlp.gate, layer.mlp.experts
        probs = torch.softmax(x @ gate.weight.T, -1)
        chosen = routes[:, :, layer_index].reshape(-1, 2).long()
        w = probs.gather(-1, chosen)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for slot in range(2):
                e = int(chosen[t, slot])
                g, u = (x[t] @ experts.gate_up_proj[e].T).chunk(2)
                out[t] += w[t, slot] * ((torch.nn.functional.silu(g) * u) @ experts.down_proj[e].T)
        h = h + out.reshape(h.shape)
    return model.lm_head(inner.norm(h))


def test_replayed_gradient_equals_a_forward_that_takes_the_recorded_experts():
    """The replayed pass and a hand-written forward over the recorded experts agree in outputs and,
    by autograd, in every gradient, the router's included; the router's own routing differs."""
    model = _tiny_moe()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    routes = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2 * 5 * 2)]).reshape(2, 5, 2, 2)
    counted = torch.ones(2, 5, dtype=torch.bool)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    stats = RouterStats()
    with replay_routes(model, routes.to(torch.int16), counted, stats):
        replayed = model(input_ids=ids).logits
    ref = _explicit_forward(model, ids, routes)
    own = model(input_ids=ids).logits
    assert torch.allclose(replayed, ref, atol=1e-5) and not torch.allclose(own, ref, atol=1e-3)
    got = grads(replayed.square().mean())
    want = grads(_explicit_forward(model, ids, routes).square().mean())
    assert got.keys() == want.keys() and any("gate.weight" in n for n in got)
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-5), name
    assert stats.compared == 2 * 5 * 2 and stats.mismatched > 0


def test_without_routes_the_pass_is_the_models_own_and_missing_routes_are_counted():
    model = _tiny_moe()
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(3))
    counted = torch.ones(2, 4, dtype=torch.bool)
    own = model(input_ids=ids).logits
    stats = RouterStats()
    with replay_routes(model, None, counted, stats):
        same = model(input_ids=ids).logits
    assert torch.equal(own, same) and stats.fallback == 2 * 4 * 2 and stats.compared == 0
    # Recorded routes equal to the model's own: replayed or not, the same logits, no mismatch.
    recorded = RouterStats()
    with replay_routes(model, None, counted, recorded):
        pass
    captured = []
    hooks = [r.register_forward_hook(lambda m, i, o: captured.append(o[2])) for r in routers(model)]
    model(input_ids=ids)
    for h in hooks:
        h.remove()
    routes = torch.stack(captured, 1).reshape(2, 4, 2, 2).to(torch.int16)
    routes[0, 0] = -1  # one token without a route: its own routing, counted once per layer
    stats = RouterStats()
    with replay_routes(model, routes, counted, stats, replay=False):
        off = model(input_ids=ids).logits
    assert torch.allclose(off, own) and stats.mismatched == 0 and stats.fallback == 2
    m = stats.metrics()
    assert m["router/route_mismatch"] == 0.0 and 0 < m["router/layer0/load_entropy"] <= 1.0
    assert m["router/layer1/load_max"] >= 0.25 >= m["router/layer1/load_min"]


def test_load_balancing_loss_is_k_when_balanced_and_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    probs = torch.full((4, 4), 0.25)
    experts = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert torch.isclose(load_balancing_loss(probs, experts, torch.ones(4, dtype=torch.bool)), torch.tensor(2.0))
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    p = torch.softmax(logits, -1)
    own = torch.topk(p, 2, -1).indices
    ours = load_balancing_loss(p, own, torch.ones(12, dtype=torch.bool))
    assert torch.isclose(ours, load_balancing_loss_func((logits,), num_experts=4, top_k=2), atol=1e-6)
    stats = RouterStats()
    stats.add(
        0, 1, p, own, torch.ones(12, dtype=torch.bool), torch.zeros(12, dtype=torch.bool), own[:, 0] < 0, own[:, 0] < 0
    )
    assert abs(stats.metrics()["router/aux_loss"] - float(ours)) < 1e-5


def test_a_routes_shape_that_does_not_fit_the_model_is_an_error():
    model = _tiny_moe()
    with pytest.raises(ValueError, match="3 MoE layers, the model has 2 routers"):
        with replay_routes(model, torch.zeros(1, 4, 3, 2, dtype=torch.int16), torch.ones(1, 4, dtype=torch.bool)):
            pass


def _random_routes(shape, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    n = 1
    for d in lead:
        n *= d
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]).reshape(shape).to(torch.int16)


def test_the_reference_pass_replays_the_routes_in_micro_batches_of_padded_rows():
    """``sequence_logprobs(routes=)`` (the reference's and the frozen base's pass) gives each row
    the log-probs of a forward over its recorded experts, whatever the micro-batching and padding;
    without the routes, the model's own routing gives others."""
    from learners.training.modeling import sequence_logprobs

    model = _tiny_moe()
    lengths = [6, 4, 5]
    ids = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(4))
    att = torch.arange(6)[None] < torch.tensor(lengths)[:, None]
    pos = att.clone()
    pos[:, :2] = False
    routes = _random_routes((3, 6, 2, 2), 4, seed=5)
    routes[~att] = -1
    want = torch.zeros(3, 6)
    for i, n in enumerate(lengths):
        logits = _explicit_forward(model, ids[i : i + 1, :n], routes[i : i + 1, :n])[0]
        lp = torch.log_softmax(logits[:-1].double(), -1).gather(-1, ids[i, 1:n, None].long())[:, 0]
        want[i, 1:n] = lp.float()
    want = want * pos
    groups = torch.tensor([0, 0, 1])
    with torch.no_grad():
        for mb in (1, 2, 3):
            got = sequence_logprobs(model, ids, att, pos, micro_batch_size=mb, group_ids=groups, routes=routes)
            assert torch.allclose(got, want, atol=1e-5), mb
        own = sequence_logprobs(model, ids, att, pos, micro_batch_size=2)
    assert not torch.allclose(own, want, atol=1e-3)
