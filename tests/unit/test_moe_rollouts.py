"""The tiny mixture-of-experts model (``cluster/assets.py:tiny-moe``) on the real vLLM engine and
the real learner: vLLM samples from it and records each token's experts
(``actors/rollout/vllm_ext.py:RouteCaptureExtension``), the record carries them (int16), and the
learner replays them (``train.routing_replay``, ``learners/training/routing.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from learners.training.routing import routers
from tests.helpers.factories import make_learner, tiny_lm

PROMPTS = ["What is 2 + 2?", "the answer is", "What is 13 * 7?", "sum plus", "calculate the total of 5 and 9"]


@pytest.fixture(scope="module")
def moe_path(tiny_moe_path) -> str:
    return tiny_moe_path


@pytest.fixture(scope="module")
def moe_generator(moe_path):
    """The module's one vLLM engine of the MoE model, routes recorded."""
    from actors.rollout.generator import Generator
    from tests.helpers.engines import engine_config

    gen = Generator(dataclasses.replace(engine_config(moe_path, 256), capture_routes=True))
    try:
        yield gen
    finally:
        gen.close()


@pytest.fixture(scope="module")
def sampled(moe_generator):
    """Four samples of each prompt from the MoE engine."""
    return moe_generator.generate(PROMPTS, n=4, max_new_tokens=24, temperature=1.0, seed=0)


def _learner(path: str, mode: str, perturb: float = 0.0):
    ln = make_learner(path, train={"routing_replay": mode}, ppo={"advantage_estimator": "grpo"})
    if perturb:
        # The engine's and the trainer's kernels compute router logits slightly differently; a
        # small deterministic perturbation of the learner's router stands for that difference.
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for r in routers(ln.model.lm):
                r.weight.add_(perturb * torch.randn(r.weight.shape, generator=g))
    return ln


def _gap(ln, exp) -> torch.Tensor:
    lps, _ = ln.evaluate_old(exp)
    return (lps - exp.rollout_logprobs).abs()[exp.response_mask]


def test_the_engine_records_every_computed_tokens_experts_compactly(sampled):
    exp = sampled
    assert exp.routes is not None and exp.routes.dtype == torch.int16 and tuple(exp.routes.shape[2:]) == (2, 2)
    real = exp.attention_mask
    missing = (exp.routes < 0).any(-1).any(-1) & real
    last = real.long().cumsum(1) == real.long().sum(1, keepdim=True)
    # Every token but each row's last (no pass computes it) has its route, prompts included: the
    # samples the prefix cache served take the route of the one that computed the prompt.
    assert torch.equal(missing, last & real)
    assert bool((exp.routes[real & ~last] < 8).all()) and bool((exp.routes[~real] == -1).all())
    ids = exp.routes[real & ~last].long()
    assert bool((ids[..., 0] != ids[..., 1]).all())  # top-2: two distinct experts


def test_replayed_routes_equal_the_engines_and_close_the_logprob_gap(sampled, moe_path):
    """fp32 on both sides: the learner routes as the engine did and its log-probs match (the dense
    tolerance). With the learner's router a little off (as kernels differ), its own routing picks
    other experts for some tokens (route_mismatch) and the gap grows; replay restores the
    engine's experts for every replayed token and shrinks the gap."""
    exp = sampled
    same = _learner(moe_path, "record")
    assert float(_gap(same, exp).max()) < 1e-4
    assert same.router_metrics()["router/route_mismatch"] == 0.0

    off = _learner(moe_path, "record", perturb=0.002)
    gap_off = _gap(off, exp)
    m_off = off.router_metrics()
    on = _learner(moe_path, "rollout", perturb=0.002)
    gap_on = _gap(on, exp)
    m_on = on.router_metrics()
    assert m_off["router/route_mismatch"] > 0, m_off
    assert float(gap_on.mean()) < float(gap_off.mean()) and float(gap_on.max()) < float(gap_off.max())
    assert m_on["router/fallback_tokens"] == 0.0
    # The replaying pass's experts are the recorded ones at every token that has a route.
    chosen = []
    hooks = [r.register_forward_hook(lambda m, i, o: chosen.append(o[2])) for r in routers(on.model.lm)]
    with torch.no_grad():
        on.model.routed_hidden(exp.input_ids, exp.attention_mask, exp.routes)
    for h in hooks:
        h.remove()
    recorded = exp.routes.reshape(-1, 2, 2).long()
    have = (recorded >= 0).all(-1)
    for layer, picked in enumerate(chosen):
        assert torch.equal(picked[have[:, layer]], recorded[:, layer][have[:, layer]])
    print(
        f"route mismatch {m_off['router/route_mismatch']:.4f}; gap max {float(gap_off.max()):.4f} -> "
        f"{float(gap_on.max()):.4f}, mean {float(gap_off.mean()):.5f} -> {float(gap_on.mean()):.5f}"
    )


def test_a_checkpoint_is_per_expert_and_restores_into_the_fused_experts(moe_path, tmp_path):
    """The learner trains fused experts (transformers 5); its checkpoint holds the per-expert
    names vLLM and transformers read, and a learner restores it exactly."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ln = _learner(moe_path, "none")
    with torch.no_grad():
        for p in ln.model.lm.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    folder = ln.save(tmp_path / "ckpt", tokenizer_from=moe_path)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    again = _learner(moe_path, "none")
    again.restore(folder)
    for (name, a), b in zip(ln.model.lm.state_dict().items(), again.model.lm.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.tensor([[1, 5, 9, 30, 40, 41]])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert torch.allclose(hf(input_ids=ids).logits, ln.model.lm(input_ids=ids).logits, atol=1e-4)


class _TwoTurns:
    """A tool-like observation after the first reply, done after the second."""

    def reset(self, row: dict) -> str:
        self.turn = 0
        return row["prompt"]

    def step(self, action: str):
        from actors.agents.environments import Step

        self.turn += 1
        return Step(None, 1.0, True, {}) if self.turn == 2 else Step("Result: 42. Go on.", 0.0, False, {})


def test_multi_turn_rows_keep_the_routes_of_the_models_tokens_and_the_learner_routes_observations(
    moe_generator, moe_path
):
    """Episodes of two turns: every action token but the episode's last carries the experts the
    engine routed it to (a turn's last token from the next turn's prefill), observations are
    left to the learner (OBSERVED), and the replaying learner uses the engine's experts at every
    recorded token, with no fallback and a smaller gap than its own routing."""
    from actors.agents.environments import EpisodeLimits
    from actors.rollout.records import OBSERVED

    rows = [{"prompt": p, "answer": "", "meta": {}} for p in PROMPTS[:3]]
    limits = EpisodeLimits(max_turns=2, max_tokens=200, max_new_tokens=12)
    exp, counts = moe_generator.generate_episodes(rows, [0, 1, 2], _TwoTurns, limits, n=2, seed=3)
    assert counts["status_done"] == 6 and exp.routes is not None
    real, act = exp.attention_mask, exp.response_mask
    last = real.long().cumsum(1) == real.long().sum(1, keepdim=True)
    observed = real & ~act & (torch.arange(exp.seq_len)[None] >= exp.response_mask.long().argmax(1)[:, None])
    assert bool(observed.any())
    assert bool((exp.routes[observed] == OBSERVED).all())
    recorded = (exp.routes >= 0).all(-1).all(-1)
    assert torch.equal(recorded, real & ~last & ~observed)
    off, on = _learner(moe_path, "record", perturb=0.002), _learner(moe_path, "rollout", perturb=0.002)
    gap_off, gap_on = _gap(off, exp), _gap(on, exp)
    m_on = on.router_metrics()
    assert m_on["router/fallback_tokens"] == 0.0 and m_on["router/replayed_tokens"] > 0
    assert off.router_metrics()["router/route_mismatch"] > 0
    assert float(gap_on.mean()) < float(gap_off.mean())
    chosen = []
    hooks = [r.register_forward_hook(lambda m, i, o: chosen.append(o[2])) for r in routers(on.model.lm)]
    with torch.no_grad():
        on.model.routed_hidden(exp.input_ids, exp.attention_mask, exp.routes)
    for h in hooks:
        h.remove()
    flat = exp.routes.reshape(-1, 2, 2).long()
    have = recorded.reshape(-1)
    for layer, picked in enumerate(chosen):
        assert torch.equal(picked[have], flat[have, layer])


EXPERT_LORA = {
    "r": 4,
    "alpha": 8.0,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


def test_lora_on_attention_and_experts_trains_and_its_adapter_sync_serves_the_learners_weights(
    moe_generator, moe_path, sampled
):
    """peft's LoRA on the attention and on the fused expert tensors (one rank-r pair per expert):
    a replaying GRPO step moves the experts' adapters; the adapter-only sync (per-expert factors
    under checkpoint names) merged by the engine into its base weights serves the learner's
    log-probs; the merged weights are in checkpoint naming, every name the base folder's."""
    from safetensors import safe_open

    from learners.training.expert_layout import checkpoint_layout
    from learners.training.lora_sync import SUFFIX_A

    ln = make_learner(
        moe_path,
        train={"routing_replay": "rollout", "lr": 5e-2},
        ppo={"advantage_estimator": "grpo", "kl_coef": 0.0},
        lora=EXPERT_LORA,
    )
    scores = torch.tensor([float(i % 3) for i in range(sampled.batch_size)])
    ln.train_step(sampled.replace(scores=scores))
    moved = [n for n, p in ln.model.lm.named_parameters() if "experts" in n and "lora_B" in n and p.abs().sum() > 0]
    assert len(moved) == 4, moved  # gate/up and down of both layers
    factors = ln.policy_state_dict(adapter=True)
    adapted = {n[: -len(SUFFIX_A)] for n in factors if n.endswith(SUFFIX_A)}
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in adapted and len(adapted) == 2 * (2 + 8 * 3)
    with safe_open(str(Path(moe_path) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert adapted <= names and set(ln.policy_state_dict()) == names
    probe = moe_generator.encode_prompt("What is 3 + 4? The answer is 7.")
    base_lps = moe_generator.probe_logprobs(probe)
    original = checkpoint_layout(tiny_lm(moe_path).state_dict())
    moe_generator.lora_base, v0 = moe_path, moe_generator.version
    try:
        moe_generator.load_weights(factors.items(), v0 + 1)
        served = moe_generator.probe_logprobs(probe)
    finally:
        moe_generator.load_weights(original.items(), v0)
        moe_generator.lora_base = ""
    assert served == pytest.approx(ln.probe_logprobs(probe), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(served, base_lps)) > 1e-3
    assert moe_generator.probe_logprobs(probe) == pytest.approx(base_lps, abs=1e-5)


def test_expert_lora_with_sharded_learners_is_refused_in_one_line(moe_path):
    with pytest.raises(ValueError, match="lora.target_parameters .* is not built yet"):
        make_learner(moe_path, train={"sharding": "fsdp"}, lora=EXPERT_LORA)
