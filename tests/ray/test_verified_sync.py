"""Verified weight sync on real vLLM generators: after a sync every generator must serve the
learner's weights, checked by its log-probs of a fixed probe sequence (and its policy version);
a sync that failed on one generator is caught and named."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from cluster.roles.rollout_group import RolloutGroup
from cluster.config.loading import load_config
from cluster.roles.weight_sync import SyncError, pack, probe_token_ids
from learners.training.modeling import sequence_logprobs
from tests.helpers.factories import make_learner

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray
TOL = 1e-3  # float32 generators (the default for generator_dtype=float32)


def test_every_generator_serves_the_learners_weights_and_a_failed_sync_is_named(ray_cluster, tiny_model_path):
    from transformers import AutoTokenizer

    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml", [f"model.path={tiny_model_path}", "rollout.num_generators=2"])
    rollout = RolloutGroup(cfg, tiny_model_path, with_reference=False)
    try:
        rollout.wait_ready()
        probe = probe_token_ids(AutoTokenizer.from_pretrained(tiny_model_path))
        assert len(probe) > 10
        learner = make_learner(tiny_model_path)
        start = {k: v.clone() for k, v in learner.model.lm.state_dict().items()}
        # Before any sync both generators serve the starting weights, as the learner holds them.
        checked = rollout.verify_sync(probe, learner.probe_logprobs(probe), 0, TOL)
        assert checked["sync/probe_gap"] < 1e-5 and checked["sync/probe_spread"] < 1e-6

        # An update (noise stands in for an optimiser step), then a sync that reached generator 0 only.
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for p in learner.model.lm.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        expected = learner.probe_logprobs(probe)
        with learner.policy_weights() as w:
            new = ray.put(pack(w, "float32", version=1))
        ray.get(rollout.generators[0].load_weights.remote([new]))
        with pytest.raises(SyncError, match="generator 1 holds policy version 0, not 1") as err:
            rollout.verify_sync(probe, expected, 1, TOL)
        assert "generator 0" not in str(err.value).split("generator 1")[0]
        # Stale bytes labelled with the new version (a transport that silently sent old weights).
        start_sd = {k: v for k, v in start.items() if k != "lm_head.weight"}
        ray.get(rollout.generators[1].load_weights.remote([ray.put(pack(start_sd, "float32", version=1))]))
        with pytest.raises(SyncError, match=r"generator 1 serves log-probs [0-9.e-]+ nats from the learner's"):
            rollout.verify_sync(probe, expected, 1, TOL)

        # The real sync: both generators pass, and what they generate carries the trainer's log-probs.
        rollout.sync_weights(new, version=1)
        checked = rollout.verify_sync(probe, expected, 1, TOL)
        assert checked["sync/probe_gap"] < 1e-5
        rows = [{"prompt": f"What is {i} + {i}?", "meta": {}} for i in range(4)]
        exp_refs, stats = rollout.generate_checked(rows, list(range(4)), seed=3)
        # Two work units per generator, all sampled by the synced weights; both generators took units.
        assert [s["policy_version"] for s in stats] == [1, 1, 1, 1]
        assert {s["generator"] for s in stats} == {0, 1}
        for exp in ray.get(exp_refs):
            trainer = sequence_logprobs(learner.model.lm.eval(), exp.input_ids, exp.attention_mask, exp.response_mask)
            gap = (trainer - exp.rollout_logprobs)[exp.response_mask].abs()
            assert gap.numel() > 0 and float(gap.max()) < 1e-4, float(gap.max())
        # Text prompts (SPIN's own replies) go through the same pool: units by load, in unit
        # order, seeded by unit, so a second call with the same seed gives the same replies.
        texts = [f"Tell me about {w}." for w in ("cats", "rain", "maps", "salt")]
        exp_refs, stats = rollout.generate_texts(texts, [10, 11, 12, 13], n=2, temperature=1.0, seed=5)
        first = ray.get(exp_refs)
        assert [e.group_ids.tolist() for e in first] == [[10, 10], [11, 11], [12, 12], [13, 13]]
        assert {s["generator"] for s in stats} == {0, 1} and all(s["sequences"] == 2 for s in stats)
        again = ray.get(rollout.generate_texts(texts, [10, 11, 12, 13], n=2, temperature=1.0, seed=5)[0])
        assert [e.completions for e in again] == [e.completions for e in first]
    finally:
        rollout.shutdown()
