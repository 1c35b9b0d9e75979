"""Sharded learners (``train.sharding: fsdp``) take the step one replicated learner takes on the
same global batch — PPO with either critic, GRPO, SFT, DPO, Q-learning (its EMA target network
too) and the reward model, with LoRA on and off, with the frozen reference sharded beside the
policy (``train.reference=learners``), with the shards in host memory (``train.cpu_offload``), on 2
and on 4 ranks, every rank but rank 0 receiving the initial weights instead of reading them; with
bf16 weights gathered from fp32 shards they take the replicated bf16 step within bf16 rounding —
and a sharded run resumes with another number of ranks as if uninterrupted.

The ranks are real processes in a gloo group (``tests/helpers/ranks.py``): FSDP2 shards the
parameters into DTensors and gathers / reduce-scatters them in every pass. Shards of unequal size
(5 and 2 rows; 3 and 0; over 4 ranks 3, 2, 2 and 0) make the ranks run different numbers of
passes of their own, so the idle passes that keep their collectives aligned are exercised.
Gradients are compared before the optimiser step (gathered from the shards), weights after it.
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

GROUPS = [10, 10, 20, 10, 20, 30, 30]  # over 2 ranks: 5 rows (groups 10, 30) and 2 (group 20)
SCORES = [1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0]
ONE_GROUP = [7, 7, 7]  # over 2 ranks: 3 rows and none
LR = 1e-4
# name -> (learner, train overrides, its own section's overrides, batch): each runs a different
# pass structure.
CASES = {
    # old-policy pass, then 3 vs 1 training micro-batches; the KL term reads the reference
    "grpo_kl": ("ppo", {"micro_batch_size": 2}, {"advantage_estimator": "grpo", "kl_coef": 0.1}, "groups"),
    # the shared value head (trained with the trunk), two epochs: two optimiser steps
    "gae": ("ppo", {"micro_batch_size": 2, "epochs": 2}, {"advantage_estimator": "gae"}, "groups"),
    # two epochs of two global minibatches (each rank's share of each), the shared critic
    "gae_minibatches": (
        "ppo",
        {"micro_batch_size": 2, "epochs": 2, "num_minibatches": 2},
        {"advantage_estimator": "gae", "kl_coef": 0.1},
        "groups",
    ),
    # a separate critic: its own decoder's layers sharded beside the policy's
    "gae_separate_critic": (
        "ppo",
        {"micro_batch_size": 2},
        {"advantage_estimator": "gae", "critic": "separate", "critic_lr": 1e-4},
        "groups",
    ),
    # activation checkpointing: each layer runs again in the backward pass, gathered again
    "grpo_checkpointed": (
        "ppo",
        {"micro_batch_size": 2, "gradient_checkpointing": True},
        {"advantage_estimator": "grpo", "kl_coef": 0.1},
        "groups",
    ),
    # one fused pass on rank 0 while rank 1, with no rows, runs an idle one
    "fused_empty_rank": ("ppo", {"micro_batch_size": 8}, {"advantage_estimator": "grpo", "kl_coef": 0.0}, "one_group"),
    # 7 demonstrations in minibatches of 4 and 3, every other row to each rank, one row per pass:
    # 2 and 2 passes, then 2, and 1 and an idle one
    "sft": ("sft", {"micro_batch_size": 1, "num_minibatches": 2}, {}, "groups"),
    # 3 pairs, one pair per pass: 2 passes on rank 0, 1 and an idle one on rank 1
    "dpo": ("dpo", {"micro_batch_size": 2}, {"beta": 0.5}, "pairs"),
    # LoRA: the learner's own reference pass (adapter off) on its rows, the weights merged shard by shard
    "grpo_lora": (
        "ppo_lora",
        {"micro_batch_size": 2},
        {"advantage_estimator": "grpo", "kl_coef": 0.1},
        "groups_no_ref",
    ),
    "dpo_lora": ("dpo_lora", {"micro_batch_size": 2}, {"beta": 0.5}, "pairs_no_ref"),
    # the shared critic trained through the adapter beside its value head
    "gae_lora": ("ppo_lora", {"micro_batch_size": 2}, {"advantage_estimator": "gae"}, "groups"),
    "sft_lora": ("sft_lora", {"micro_batch_size": 1, "num_minibatches": 2}, {}, "groups"),
    # Q-learning: per update a target-network pass and an online pass (2 updates: the second's
    # target is the EMA after the first), 2-step backups, the KL anchor to the given reference
    "qlearn": ("qlearn", {"micro_batch_size": 2, "num_minibatches": 2}, {"n_step": 2, "kl_coef": 0.1}, "groups"),
    # calibrated Q: the frozen copy's log-normaliser of every state (sharded beside the policy)
    # shifts the online Q and the target's maximum
    "qlearn_calibrated": (
        "qlearn",
        {"micro_batch_size": 2, "reference": "learners"},
        {"n_step": 2, "calibration": "reference", "conservative": "logsumexp"},
        "groups_no_ref",
    ),
    # the EMA of the adapter alone; the reference is the base model, computed by the learner
    "qlearn_lora": ("qlearn_lora", {"micro_batch_size": 2, "num_minibatches": 2}, {"kl_coef": 0.1}, "groups_no_ref"),
    # train.reference=learners: a frozen copy of the initial model sharded beside the policy; PPO
    # runs it on each rank's own rows (over 4 ranks one has none: an idle reference pass)
    "grpo_kl_own_reference": (
        "ppo",
        {"micro_batch_size": 2, "reference": "learners"},
        {"advantage_estimator": "grpo", "kl_coef": 0.1},
        "groups_no_ref",
    ),
    # the exact KL loss over the vocabulary: the frozen model's hidden states and its LM head
    # (gathered once from its shards) beside the policy's, two epochs (the second's KL moves)
    "grpo_full_kl_own_reference": (
        "ppo",
        {"micro_batch_size": 2, "reference": "learners", "epochs": 2},
        {"advantage_estimator": "grpo", "kl_coef": 0.0, "kl_loss_coef": 0.5, "kl_loss_estimator": "full"},
        "groups_no_ref",
    ),
    "grpo_full_kl_lora": (
        "ppo_lora",
        {"micro_batch_size": 2, "epochs": 2},
        {"advantage_estimator": "grpo", "kl_coef": 0.0, "kl_loss_coef": 0.5, "kl_loss_estimator": "full"},
        "groups_no_ref",
    ),
    "dpo_own_reference": ("dpo", {"micro_batch_size": 2, "reference": "learners"}, {"beta": 0.5}, "pairs_no_ref"),
    # a reward model: the trunk and the reward head, one pair per pass (2 passes; 1 and an idle one)
    "reward_model": ("reward_model", {"micro_batch_size": 2}, {}, "pairs"),
    # train.cpu_offload: shards, gradients and AdamW state in host memory (on a CPU device FSDP's
    # offload path runs with its copies landing where they are)
    "grpo_kl_offloaded": (
        "ppo",
        {"micro_batch_size": 2, "cpu_offload": True},
        {"advantage_estimator": "grpo", "kl_coef": 0.1},
        "groups",
    ),
}
# bf16 learners: the sharded units gather bf16 weights (FSDP's mixed precision), the replicated
# learner casts its fp32 weights under autocast: the same step within bf16 rounding.
MIXED = {
    "grpo_kl_bf16": (
        "ppo",
        {"micro_batch_size": 2, "bf16": True},
        {"advantage_estimator": "grpo", "kl_coef": 0.1},
        "groups",
    )
}
LORA = {"r": 4, "alpha": 8.0}
PROBE = [5, 17, 3, 42, 8, 11, 29]  # token ids of a verified-sync probe
# Over 4 ranks (rows 3, 2, 2 and 0): one case of each pass structure.
FOUR_RANKS = (
    "grpo_kl",
    "gae_minibatches",
    "gae_separate_critic",
    "fused_empty_rank",
    "sft",
    "dpo_lora",
    "qlearn",
    "reward_model",
    "grpo_kl_own_reference",
)
BUILDERS = {
    "ppo": lambda path, train, own: make_learner(path, train=train, ppo=own),
    "sft": lambda path, train, own: make_sft_learner(path, train=train),
    "dpo": lambda path, train, own: make_dpo_learner(path, train=train, dpo=own),
    "ppo_lora": lambda path, train, own: make_learner(path, train=train, ppo=own, lora=LORA),
    "dpo_lora": lambda path, train, own: make_dpo_learner(path, train=train, dpo=own, lora=LORA),
    "sft_lora": lambda path, train, own: make_sft_learner(path, train=train, lora=LORA),
    "qlearn": lambda path, train, own: make_q_learner(path, train=train, qlearn=own),
    "qlearn_lora": lambda path, train, own: make_q_learner(path, train=train, qlearn=own, lora=LORA),
    "reward_model": lambda path, train, own: make_rm_learner(path, train=train, rm=own),
}


def _batches(path: str) -> dict:
    lm = tiny_lm(path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, GROUPS, seed=3)
    one = grouped_batch(lm.config.vocab_size, ONE_GROUP, seed=4)
    return {
        "groups": experience(lm, ids, att, rm, SCORES, groups=GROUPS, ref_shift=0.05),
        "one_group": experience(lm, *one, [1.0, 0.0, 0.5], groups=ONE_GROUP, ref_shift=None),
        "pairs": preference_batch(lm, 3, seed=5, ref_shift=0.1),
        "groups_no_ref": experience(lm, ids, att, rm, SCORES, groups=GROUPS, ref_shift=None),
        "pairs_no_ref": preference_batch(lm, 3, seed=5, ref_shift=None),
    }


def _learner(path: str, case: str, sharded: bool):
    kind, train, own, _ = {**CASES, **MIXED}[case]
    return BUILDERS[kind](path, {**train, "lr": LR, "sharding": "fsdp" if sharded else "replicated"}, own)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(learner, batch) -> tuple[torch.Tensor, dict, dict]:
    """(global gradient of the first update, metrics, weights after the step: policy, value head
    and a Q-learner's target network)."""
    captured: dict = {}

    def on_gradients(params):
        if "g" not in captured:  # gathered on every rank (a collective), kept once
            captured["g"] = torch.cat([_full(p.grad).reshape(-1).clone() for p in params])

    learner.on_gradients = on_gradients
    metrics = learner.train_step(batch)
    weights = learner.policy_state_dict()
    head, critic = learner.model.value_head, getattr(learner.model, "critic", None)
    weights.update(
        {f"value_head.{k}": _full(v).detach().clone() for k, v in (head.state_dict() if head else {}).items()}
    )
    weights.update(
        {f"critic.{k}": _full(v).detach().clone() for k, v in (critic.state_dict() if critic else {}).items()}
    )
    weights.update(
        {
            f"target.{n}": _full(t).clone()
            for n, t in zip(getattr(learner, "target_names", ()), getattr(learner, "target_params", ()))
        }
    )
    return captured["g"], metrics, weights


def _every_case(
    rank: int, world: int, path: str, batches: dict, save_to: str | None = None, cases: tuple[str, ...] = tuple(CASES)
) -> dict:
    from learners.training.distributed import default_collective

    out = {}
    for case in cases:
        learner = _learner(path, case, sharded=True)
        learner.comm = default_collective()
        seen = _watch_dtypes(learner)
        out[case] = _step(learner, batches[{**CASES, **MIXED}[case][3]])
        out[f"{case}.held"] = _held(learner, seen)
        if case in MIXED:  # the verified-sync probe's answer, from the bf16 gathers
            out[f"{case}.probe"] = learner.probe_logprobs(PROBE)
        if save_to and case in ("grpo_lora", "reward_model"):
            learner.save(f"{save_to}_{case}")
    return out


def _watch_dtypes(learner) -> list:
    """The dtype of the first decoder layer's query weight whenever that layer computes."""
    from learners.training.modeling import decoder_layers

    seen: list = []
    layer = decoder_layers(learner.model.lm)[0]
    layer.register_forward_pre_hook(lambda module, args: seen.append(module.self_attn.q_proj.weight.dtype))
    return seen


def _held(learner, seen: list) -> dict:
    """What the rank holds after its step: the dtypes of the weights its layer computed with, of
    its shards, their gradients and AdamW moments, and whether FSDP keeps the shards in host
    memory (FSDP's own record: a CPU device gives no other sign of it)."""
    params = [p for p in learner.model.parameters() if p.requires_grad]
    moments = [v for p in params for v in learner.optimizer.state[p].values() if v.dim()]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in learner.model.modules() if hasattr(m, "_get_fsdp_state")]
    offloaded = {fp.offload_to_cpu for g in groups if g is not None for fp in g.fsdp_params}
    return {
        "computed_in": set(seen),
        "shards": {p.dtype for p in params},
        "grads": {p.grad.dtype for p in params if p.grad is not None},
        "moments": {v.dtype for v in moments},
        "offloaded": offloaded,
    }


def _count_model_loads() -> list:
    """Every read of a causal LM's weights from its folder in this process, from now on."""
    from transformers import AutoModelForCausalLM

    loads: list = []
    read = AutoModelForCausalLM.from_pretrained
    AutoModelForCausalLM.from_pretrained = lambda *a, **k: (loads.append(a[0]), read(*a, **k))[1]
    return loads


def _two_ranks(rank: int, world: int, path: str, batches: dict, resume_from: str, save_to: str) -> dict:
    from learners.training.distributed import default_collective

    loads = _count_model_loads()
    out = _every_case(rank, world, path, batches, save_to, (*CASES, *MIXED))
    out["model_loads"] = len(loads)
    learner = _learner(path, "grpo_kl", sharded=True)
    learner.comm = default_collective()
    learner.restore(resume_from)
    out["resumed"] = _step(learner, batches["groups"])
    learner.save(save_to)
    return out


def _one_rank(rank: int, world: int, path: str, batch, resume_from: str | None, save_to: str | None) -> tuple:
    learner = _learner(path, "grpo_kl", sharded=True)
    if resume_from:
        learner.restore(resume_from)
    result = _step(learner, batch)
    if save_to:
        learner.save(save_to)
    if resume_from:  # also the LoRA learner and the reward model the two ranks saved, restored
        for case in ("grpo_lora", "reward_model"):
            other = _learner(path, case, sharded=True)
            other.restore(f"{resume_from}_{case}")
            result = (*result, other.policy_state_dict())
    return result


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    """The replicated learner's steps, and the sharded ranks' same steps: every case on 2 ranks
    and on 4; the resume chain 1 rank -> 2 ranks -> 1 rank (a checkpoint between each)."""
    path, tmp = tiny_model_path, tmp_path_factory.mktemp("sharded")
    batches = _batches(path)
    replicated = {case: _step(_learner(path, case, sharded=False), batches[spec[3]]) for case, spec in CASES.items()}
    bf16 = _learner(path, "grpo_kl_bf16", sharded=False)
    replicated["grpo_kl_bf16"] = _step(bf16, batches["groups"])
    replicated["grpo_kl_bf16.probe"] = bf16.probe_logprobs(PROBE)
    chain = _learner(path, "grpo_kl", sharded=False)
    replicated["chain"] = [_step(chain, batches["groups"]) for _ in range(3)]
    first = run_processes(1, _one_rank, path, batches["groups"], None, str(tmp / "a"))[0]
    both = run_processes(2, _two_ranks, path, batches, str(tmp / "a"), str(tmp / "b"))
    *last, lora_restored, rm_restored = run_processes(1, _one_rank, path, batches["groups"], str(tmp / "b"), None)[0]
    replicated["lora_restored"], replicated["rm_restored"] = lora_restored, rm_restored
    replicated["four"] = run_processes(4, _every_case, path, batches, None, FOUR_RANKS)
    return replicated, both, [first, both[0]["resumed"], tuple(last)], tmp


def _assert_weights_close(got: dict, ref: dict) -> None:
    """Each weight within 0.002 lr of the reference on average, and none further than the two
    sides of one Adam step (2.5 lr). Adam moves every weight by about lr whatever its gradient's
    size, so where a gradient is rounding noise around 0 (a critic's embedding row of a token seen
    once) its sign, and the weight's step, can flip (0.43 lr seen, 1 element in 65536); a wrong
    gradient, moment or schedule moves the average by a large part of lr."""
    assert got.keys() == ref.keys()
    for name, w in ref.items():
        diff = (got[name] - w).abs()
        assert float(diff.max()) <= 2.5 * LR and float(diff.mean()) <= 0.002 * LR, (
            f"{name}: max {float(diff.max()) / LR:.3g} lr, mean {float(diff.mean()) / LR:.3g} lr"
        )


@pytest.mark.parametrize("case, ranks", [(c, 2) for c in CASES] + [(c, 4) for c in FOUR_RANKS])
def test_sharded_ranks_take_the_replicated_step(runs, case, ranks):
    replicated, both, _, _ = runs
    both = both if ranks == 2 else replicated["four"]
    g1, m1, w1 = replicated[case]
    for g, m, w in (r[case] for r in both):
        assert_grads_close({"g": g}, {"g": g1})
        _assert_weights_close(w, w1)
        # (Not the implicit-reward accuracy: with a fresh adapter the policy is its reference,
        # every implicit reward is 0 up to rounding, and rounding decides which side wins.)
        # The margin is a difference of sums of log-probs (tens of nats): float32 rounding of
        # those sums, which depends on the CPU's vector width, is a few 1e-6.
        for key, tol in (("loss/policy", 1e-6), ("loss/total", 1e-6), ("rewards/margin", 2e-5)):
            if key in m1:
                assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=tol), key
    if CASES[case][0] == "ppo":
        # The one group's middle score is its mean: that row's advantage is 0 and it runs no pass.
        # Whole groups are dealt round-robin: over 4 ranks groups 10, 20 and 30 and none.
        expected = {2: ([0.0, 2.0], [2.0, 5.0]), 4: ([0.0, 0.0, 0.0, 2.0], [0.0, 2.0, 2.0, 3.0])}[ranks]
        assert sorted(m["learner/local_sequences"] for _, m, _ in (r[case] for r in both)) == (
            expected[0] if case == "fused_empty_rank" else expected[1]
        )


def test_only_rank_0_reads_the_initial_model(runs):
    """Rank 1 builds every learner above (policies, a separate critic, the own reference) without
    reading the model's weights: its shards come from rank 0 (and its steps equal the replicated
    ones above, so they came whole)."""
    _, both, _, _ = runs
    assert both[0]["model_loads"] >= len(CASES) + len(MIXED) and both[1]["model_loads"] == 0


def test_offloaded_shards_take_the_replicated_step_from_host_memory(runs):
    """train.cpu_offload: FSDP holds every shard in host memory (its record of each parameter),
    and the step is the replicated one (compared with the others above)."""
    _, both, _, _ = runs
    for r in both:
        assert r["grpo_kl_offloaded.held"]["offloaded"] == {True}
        assert r["grpo_kl.held"]["offloaded"] == {False}


def test_bf16_sharded_ranks_gather_bf16_weights_and_keep_fp32_masters(runs):
    """Under bf16 the layers compute with bf16 weights gathered from fp32 shards (half the bytes
    in each all-gather), the gradients are summed into fp32 shards and AdamW's moments are fp32;
    the step is the replicated bf16 learner's (autocast over fp32 weights) within bf16 rounding:
    the gradients point the same way (cosine > 0.9995) and agree in size within 0.5%, the weights
    after the step within 0.02 learning rates on average."""
    replicated, both, _, _ = runs
    g1, m1, w1 = replicated["grpo_kl_bf16"]
    for r in both:
        g, m, w = r["grpo_kl_bf16"]
        assert r["grpo_kl_bf16.held"] == {
            "computed_in": {torch.bfloat16},
            "shards": {torch.float32},
            "grads": {torch.float32},
            "moments": {torch.float32},
            "offloaded": {False},
        }
        assert r["grpo_kl.held"]["computed_in"] == {torch.float32}
        cosine = float(torch.nn.functional.cosine_similarity(g.double(), g1.double(), dim=0))
        # measured: cosine 0.99998, norms within 1e-5, weights 0.004 lr apart on average
        assert cosine > 0.9995 and abs(float(g.norm() / g1.norm()) - 1) < 0.005, (cosine, float(g.norm() / g1.norm()))
        mean_gap = sum(float((w[k] - v).abs().mean()) for k, v in w1.items()) / len(w1)
        assert mean_gap < 0.02 * LR, mean_gap / LR
        assert m["loss/policy"] == pytest.approx(m1["loss/policy"], rel=1e-3)
        # The probe (what a sync is verified by) reads bf16 weights here, fp32 ones replicated: within
        # the bf16 probe tolerance (measured 0.03 at most).
        probe, probe1 = torch.tensor(r["grpo_kl_bf16.probe"]), torch.tensor(replicated["grpo_kl_bf16.probe"])
        assert torch.isfinite(probe).all() and float((probe - probe1).abs().max()) < 0.1, probe - probe1


def test_a_sharded_run_resumes_with_another_number_of_ranks(runs):
    """1 rank -> save -> 2 ranks -> save -> 1 rank: the weights after every step are the
    uninterrupted replicated run's, so the optimiser's moments and schedule came through."""
    replicated, _, chain, tmp = runs
    for (g, _, w), (g_ref, _, w_ref) in zip(chain, replicated["chain"]):
        assert_grads_close({"g": g}, {"g": g_ref})
        _assert_weights_close(w, w_ref)
    # The optimiser's state: each of the 2 ranks wrote its own shards (torch.distributed.checkpoint),
    # none of it gathered into the learner's state file; 1 rank resumed from them above.
    shards = sorted(p.name for p in (tmp / "b" / "trainer_state" / "optimizer").iterdir())
    assert ".metadata" in shards and sum(name.endswith(".distcp") for name in shards) == 2, shards
    assert torch.load(tmp / "b" / "trainer_state" / "learner.pt", weights_only=True)["optimizer"] is None
    # The checkpoint is a model folder: full tensors, as transformers loads it.
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(tmp / "b"))
    after_two = replicated["chain"][1][2]
    _assert_weights_close(
        {"w": lm.model.layers[0].mlp.up_proj.weight.detach()}, {"w": after_two["model.layers.0.mlp.up_proj.weight"]}
    )


def test_a_sharded_lora_checkpoint_restores_on_another_number_of_ranks(runs, tiny_model_path):
    """Saved by 2 sharded ranks (adapter gathered), restored by 1: the merged weights are the
    replicated LoRA learner's after its step, and the checkpoint folder holds them merged."""
    from transformers import AutoModelForCausalLM

    replicated, _, _, tmp = runs
    after = {k: v for k, v in replicated["grpo_lora"][2].items() if not k.startswith("value_head.")}
    _assert_weights_close(replicated["lora_restored"], after)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert not torch.equal(
        after["model.layers.0.self_attn.q_proj.weight"], start["model.layers.0.self_attn.q_proj.weight"]
    )
    merged = AutoModelForCausalLM.from_pretrained(str(tmp / "b_grpo_lora")).state_dict()
    _assert_weights_close({k: merged[k] for k in after}, after)


def test_a_sharded_reward_model_checkpoint_restores_on_one_rank(runs):
    """Saved by 2 sharded ranks as a sequence-classification folder, restored by 1: the trunk and
    the reward head are the replicated reward model's after its step, and the folder loads in
    transformers with that head."""
    from transformers import AutoModelForSequenceClassification

    replicated, _, _, tmp = runs
    after = replicated["reward_model"][2]
    restored = replicated["rm_restored"]
    _assert_weights_close(restored, {k: after[k] for k in restored})
    assert not torch.equal(restored["score.weight"], torch.zeros_like(restored["score.weight"]))
    loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp / "b_reward_model"))
    _assert_weights_close({"score.weight": loaded.score.weight.detach()}, {"score.weight": after["score.weight"]})


def test_a_learner_not_built_for_sharding_says_so(tiny_model_path, monkeypatch):
    """A learner class that does not declare itself shardable (one of a user's own, say), or a LoRA
    learner adapting more than linear layers, stops with one line when built with
    train.sharding=fsdp."""
    from learners.sft import SFTLearner

    monkeypatch.setattr(SFTLearner, "shardable", False)
    with pytest.raises(ValueError, match="train.sharding=fsdp is not built for the sft learner yet"):
        make_sft_learner(tiny_model_path, train={"sharding": "fsdp"})
    # Sharded LoRA weights are merged shard by shard as s B A: an embedding's adapter is refused.
    with pytest.raises(ValueError, match=r"adapts linear layers only, not \['model.embed_tokens'\]"):
        make_learner(
            tiny_model_path,
            train={"sharding": "fsdp"},
            lora={"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "embed_tokens"]},
        )
