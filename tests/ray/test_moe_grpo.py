"""GRPO on the tiny mixture of experts with rollout routing replay, on the real stack
(``configs/grpo_tiny_moe.yaml``: vLLM generators recording routes, Ray Train learners replaying
them, weight syncs of the expert tensors that the sync probe checks every step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config.loading import load_config
from cluster.driver import train
from tests.helpers.runs import rows

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def test_grpo_with_routing_replay_learns_and_its_checkpoint_loads(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "moe"
    cfg = load_config(ROOT / "configs" / "grpo_tiny_moe.yaml", ["run.steps=6", "run.plot=false"])
    train(cfg, run_dir=run_dir)
    got = [r for r in rows(run_dir) if r["step"] > 0]
    rewards = [r["reward/mean"] for r in got]
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.1, rewards
    # fp32 engine and learner: the learner's own routing is the engine's before the update, every
    # token that decides a log-prob had its route, and the updates move the routing away (what
    # replay holds fixed).
    assert all(r["router/route_mismatch"] == 0.0 and r["router/fallback_tokens"] == 0.0 for r in got)
    assert all(r["router/replayed_tokens"] > 0 and r["router/update_route_mismatch"] > 0 for r in got)
    assert max(r["logprob_gap/max_abs"] for r in got) < 1e-3
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
