"""A sharded mixture-of-experts learner (``train.sharding: fsdp``, the fused expert tensors
sharded with the rest) replaying recorded routes takes the step one replicated learner takes on
the same batch: GRPO with the frozen reference sharded beside the policy (its pass replays the
routes too), LoRA on the attention projections (the reference: the adapter off), Q-learning
replaying the routes in its online and target passes, and SFT, DPO, Q-learning and the reward
model with their own routing.

The ranks are real processes in a gloo group (``tests/helpers/ranks.py``); the batch's 5 and 2
rows per rank make them run different numbers of passes (idle passes keep them aligned).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.factories import (
    assert_grads_close,
    experience,
    grouped_batch,
    make_dpo_learner,
    make_learner,
    make_q_learner,
    make_rm_learner,
    make_sft_learner,
    preference_batch,
    tiny_lm,
)
from tests.helpers.ranks import run_processes

GROUPS = [10, 10, 20, 10, 20, 30, 30]
SCORES = [1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0]
LR = 1e-4
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
REPLAY = {"micro_batch_size": 2, "reference": "learners", "routing_replay": "rollout"}
GRPO = {"advantage_estimator": "grpo", "kl_coef": 0.1}
CASES = {
    "grpo_replay": (lambda p, t: make_learner(p, train={**REPLAY, **t}, ppo=GRPO), "routed"),
    "grpo_replay_lora": (
        lambda p, t: make_learner(p, train={**REPLAY, "reference": "actor", **t}, ppo=GRPO, lora=LORA),
        "routed",
    ),
    "sft": (lambda p, t: make_sft_learner(p, train={"micro_batch_size": 1, **t}), "routed"),
    "dpo": (lambda p, t: make_dpo_learner(p, train={"micro_batch_size": 2, **t}, dpo={"beta": 0.5}), "pairs"),
    "qlearn": (lambda p, t: make_q_learner(p, train={"micro_batch_size": 2, **t}, qlearn={"n_step": 2}), "routed"),
    # the target network's and the online network's passes replay the routes too
    "qlearn_replay": (
        lambda p, t: make_q_learner(
            p, train={"micro_batch_size": 2, "routing_replay": "rollout", **t}, qlearn={"n_step": 2}
        ),
        "routed",
    ),
    "reward_model": (lambda p, t: make_rm_learner(p, train={"micro_batch_size": 2, **t}), "pairs"),
}


def _routes(exp, seed: int) -> torch.Tensor:
    """Random top-2 routes over the 8 experts at every real token but each row's last (-1 there),
    and none at all for the last row (a record from before routes: counted fallbacks)."""
    g = torch.Generator().manual_seed(seed)
    b, length = exp.input_ids.shape
    scores = torch.rand(b, length, 2, 8, generator=g)
    routes = scores.topk(2, -1).indices.to(torch.int16)
    real = exp.attention_mask
    last = real.long().cumsum(1) == real.long().sum(1, keepdim=True)
    routes[~real | last] = -1
    routes[-1] = -1
    return routes


def _batches(path: str) -> dict:
    lm = tiny_lm(path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, GROUPS, seed=3)
    exp = experience(lm, ids, att, rm, SCORES, groups=GROUPS, ref_shift=None)
    return {"routed": exp.replace(routes=_routes(exp, 0)).validate(), "pairs": preference_batch(lm, 3, seed=5)}


def _step(learner, batch) -> tuple:
    """(global gradient of the first update, metrics, policy weights after the step)."""
    captured: dict = {}

    def on_gradients(params):
        if "g" not in captured:
            captured["g"] = torch.cat(
                [
                    (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).reshape(-1).clone()
                    for p in params
                ]
            )

    learner.on_gradients = on_gradients
    metrics = learner.train_step(batch)
    return captured["g"], metrics, learner.policy_state_dict()


def _learner(path: str, case: str, sharded: bool):
    build, _ = CASES[case]
    return build(path, {"lr": LR, "sharding": "fsdp" if sharded else "replicated"})


def _ranks(rank: int, world: int, path: str, batches: dict) -> dict:
    from learners.training.distributed import default_collective

    out = {}
    for case, (_, batch) in CASES.items():
        learner = _learner(path, case, sharded=True)
        learner.comm = default_collective()
        out[case] = _step(learner, batches[batch])
        if case == "grpo_replay":  # what this rank holds of the fused experts
            out["experts"] = {
                n: (tuple(p.shape), tuple(p.to_local().shape))
                for n, p in learner.model.named_parameters()
                if n.endswith("experts.gate_up_proj")
            }
    return out


@pytest.fixture(scope="module")
def runs(tiny_moe_path):
    path = tiny_moe_path
    batches = _batches(path)
    replicated = {case: _step(_learner(path, case, sharded=False), batches[b]) for case, (_, b) in CASES.items()}
    own = make_learner(path, train={**REPLAY, "routing_replay": "record", "lr": LR}, ppo=GRPO)
    replicated["own_routing"] = _step(own, batches["routed"])
    return replicated, run_processes(2, _ranks, path, batches)


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_moe_ranks_take_the_replicated_step(runs, case):
    replicated, ranks = runs
    g1, m1, w1 = replicated[case]
    for g, m, w in (r[case] for r in ranks):
        assert_grads_close({"g": g}, {"g": g1})
        assert w.keys() == w1.keys()
        for name, ref in w1.items():
            diff = (w[name] - ref).abs()
            assert float(diff.max()) <= 2.5 * LR and float(diff.mean()) <= 0.002 * LR, name
        for key in ("router/route_mismatch", "router/fallback_tokens", "router/replayed_tokens"):
            if key in m1:
                assert m[key] == pytest.approx(m1[key]), key


def test_the_replayed_step_is_not_the_models_own_routing(runs):
    """The random routes differ from the router's own choice, so a step that ignored them (in the
    policy's passes or the reference's) would take another step; the fallback row is counted."""
    replicated, _ = runs
    g_replay, m_replay, _ = replicated["grpo_replay"]
    g_own, m_own, _ = replicated["own_routing"]
    assert not torch.allclose(g_replay, g_own, atol=1e-6)
    assert m_replay["router/route_mismatch"] > 0.5 and m_replay["router/fallback_tokens"] > 0
    assert m_own["router/replayed_tokens"] == m_replay["router/replayed_tokens"]
    g_q, m_q, _ = replicated["qlearn_replay"]
    assert not torch.allclose(g_q, replicated["qlearn"][0], atol=1e-6)
    assert m_q["router/replayed_tokens"] > 0 and m_q["router/fallback_tokens"] > 0


def test_the_fused_experts_are_sharded_across_the_ranks(runs):
    _, ranks = runs
    experts = ranks[0]["experts"]
    assert len(experts) == 2  # one fused gate/up tensor per MoE layer
    for whole, local in experts.values():
        assert whole[0] == 8 and local[0] == 4 and local[1:] == whole[1:]  # 4 of the 8 experts each
