"""The collective weight transport on the real stack (2 vLLM generators, a Ray Train learner, fp32): after
every sync each generator serves exactly the learner's weights, checked by the verified-sync
probe and by the log-probs it generates, which the trainer reproduces."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.driver import train

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


def test_the_collective_transport_leaves_every_generator_with_the_learners_weights(ray_cluster, tmp_path):
    """(The object-store transport, the default, is checked the same way in every PPO run's rows,
    e.g. tests/ray/test_async.py.)"""
    transport = "collective"
    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml", [
        f"rollout.weight_transport={transport}", "rollout.num_generators=2", "rollout.bucket_mb=1",
        "run.steps=3", f"run.output_dir={tmp_path}", f"run.name={transport}", "run.plot=false",
        "cluster.metrics_export=false", "run.tensorboard=false"])
    rows = [r for r in train(cfg).history if r["step"] > 0]
    assert [r["generate/policy_version"] for r in rows] == [0, 1, 2]
    for r in rows:
        # Both generators answer the probe as the learner does (fp32: to about 1e-6) ...
        assert r["sync/probe_gap"] < 1e-5 and r["sync/probe_spread"] < 1e-6, r
        # ... and the batch they generated with the synced weights carries the trainer's log-probs.
        assert r["logprob_gap/max_abs"] < 1e-4, r
    # Broadcast (in 1 MiB buckets), not through the object store.
    assert all(r["sync/broadcast_s"] > 0 and r["sync/bytes"] > 0 for r in rows)
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"]
