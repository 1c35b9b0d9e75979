"""Asynchronous PPO (generation of the next batch overlaps learning) on the real stack, with 2
generators fed by the collective weight transport: it learns, no sample is older than the bound,
it draws the synchronous run's prompts in order (the synchronous loop draws the sampler's
sequence: tests/ray/test_resume_and_serve_checkpoint.py compares a run with an uninterrupted one
prompt for prompt), and after every broadcast both generators serve the learner's weights.
(The object-store transport is checked the same way with 2 generators in tests/ray/test_multinode.py
and tests/ray/test_verified_sync.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.driver import train
from cluster.ledger import read_ledger
from cluster.run_context import PromptSampler

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray
STEPS = 6


def _run(tmp_path: Path, staleness: int):
    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml", [
        f"rollout.max_staleness={staleness}", f"run.steps={STEPS}", f"run.output_dir={tmp_path}",
        "rollout.weight_transport=collective", "rollout.num_generators=2", "rollout.bucket_mb=1",
        f"run.name=stale{staleness}", "run.plot=false", "cluster.metrics_export=false"])
    result = train(cfg)
    return result, [r for r in result.history if r["step"] > 0]


def test_async_ppo_learns_within_the_staleness_bound_in_the_synchronous_prompt_order(ray_cluster, tmp_path):
    result, rows = _run(tmp_path, 1)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Overlap ran: from step 2 on, each batch was sampled one policy version behind the learners
    # (the generation of step k+1 ran while the learners trained on step k), never more.
    assert [r["policy/staleness"] for r in rows] == [0] + [1] * (STEPS - 1)
    assert [r["generate/policy_version"] for r in rows] == [0] + list(range(STEPS - 1))
    trained = [r for r in read_ledger(result.run_dir) if r["event"] == "trained"]
    assert len(trained) == STEPS * 32
    assert max(r["learner_version"] - r["sampled_version"] for r in trained) == 1
    # Stale batches take the full old-policy pass, with the truncated-IS correction (on by default).
    assert all(r["learner/stale_batch"] == 1.0 for r in rows[1:]) and rows[0]["learner/stale_batch"] == 0.0
    assert all(0 < r["rollout_is/weight_mean"] <= 2.0 for r in rows)
    assert all(r["logprob_gap/kl_k3"] > 0 for r in rows[1:])
    assert all(r["skipped"].get("stale", 0) == 0 for r in rows)
    # It learns the tiny task (fraction of digits in the reply) as the synchronous run does.
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"] + 0.3, [r["reward/mean"] for r in rows]
    # Both generators served the learner's weights after every broadcast (fp32: the probe's
    # log-probs agree to about 1e-6), and the weights went by broadcast, not the object store.
    assert all(r["sync/probe_gap"] < 1e-5 and r["sync/probe_spread"] < 1e-6 for r in rows)
    assert all(r["sync/broadcast_s"] > 0 and r["sync/bytes"] > 0 for r in rows)
    # The prompts of the synchronous loop (rollout.max_staleness=0 is that loop), in its order:
    # the sampler's sequence for the run's seed, one batch per step.
    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml")
    sampler = PromptSampler(cfg.data.train_size, cfg.rollout.prompts_per_step, cfg.run.seed)
    assert [r["data/prompt_ids"] for r in rows] == [sampler.next() for _ in range(STEPS)]
