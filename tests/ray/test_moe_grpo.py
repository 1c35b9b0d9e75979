"""GRPO on the tiny mixture of experts with rollout routing replay, on the real stack
(``configs/grpo_tiny_moe.yaml``: vLLM generators recording routes, Ray Train learners replaying
them, weight syncs of the expert tensors that the sync probe checks every step): it learns, its
checkpoint loads, and a run whose generator and learner are killed mid-run keeps each row's routes
with its row and ends as the uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.ops.ledger import read_ledger, summarize
from learners.base import load_model_weights
from tests.helpers.kills import finish, kill_during_run, steps_logged
from tests.helpers.runs import rows

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
RUN = [f"run.steps={STEPS}", "run.plot=false", "run.save_every=2", "run.keep_last=0"]


def _launch(ray_cluster, run_dir: Path) -> subprocess.Popen:
    env = {**ray_cluster["env"], "RAY_ADDRESS": ray_cluster["address"]}
    rayrlhf = str(Path(sys.executable).parent / "rayrlhf")
    sets = [arg for s in RUN for arg in ("--set", s)]
    cmd = [rayrlhf, "train", "configs/grpo_tiny_moe.yaml", "--run-dir", str(run_dir), *sets]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("moe") / "uninterrupted"
    finish(_launch(ray_cluster, run_dir))
    return run_dir


def _routes_held_every_step(run_dir: Path) -> list[dict]:
    """fp32 engine and learner: the learner's own routing is the engine's before the update, so a
    route that went with another row than its own would show as a mismatch and a log-prob gap;
    every token that decides a log-prob had its route; the updates move the routing away (what
    replay holds fixed)."""
    got = [r for r in rows(run_dir) if r["step"] > 0]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert all(r["router/route_mismatch"] == 0.0 and r["router/fallback_tokens"] == 0.0 for r in got), got
    assert all(r["router/replayed_tokens"] > 0 and r["router/update_route_mismatch"] > 0 for r in got)
    assert max(r["logprob_gap/max_abs"] for r in got) < 1e-3
    return got


def test_grpo_with_routing_replay_learns_and_its_checkpoint_loads(uninterrupted):
    from transformers import AutoModelForCausalLM

    rewards = [r["reward/mean"] for r in _routes_held_every_step(uninterrupted)]
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.1, rewards
    final = sorted((uninterrupted / "checkpoints").glob("step_*"))[-1]
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_a_killed_generator_and_learner_keep_routes_with_their_rows_and_end_as_uninterrupted(
    ray_cluster, uninterrupted, tmp_path
):
    """The generator killed inside ``generate`` (its unit issued again) and a learner worker killed
    after step 3 (the group restores step 2's checkpoint and replays the steps after it, their
    records' routes included): every step's routes still fit its rows, and the final weights are
    the uninterrupted run's."""
    run_dir = tmp_path / "kills"
    kills, _ = kill_during_run(
        _launch(ray_cluster, run_dir),
        run_dir,
        [
            (lambda: steps_logged(run_dir) >= 1, "GeneratorWorker", "generate"),
            (lambda: steps_logged(run_dir) >= 3, "RayTrainWorker", None),
        ],
    )
    assert kills[-1][1] < STEPS, kills  # the learner's kill still had steps to go
    summary = summarize(read_ledger(run_dir))
    assert summary["restarts"].get("generator") == 1 and summary["restarts"].get("learner") == 1, summary
    assert summary["prompts"]["lost"] == 0 and summary["prompts"]["trained_twice"] == 0, summary
    got = _routes_held_every_step(run_dir)
    want = [r for r in rows(uninterrupted) if r["step"] > 0]
    assert [r["reward/mean"] for r in got] == pytest.approx([r["reward/mean"] for r in want], abs=1e-6)
    final = Path("checkpoints") / f"step_{STEPS:05d}"
    a, b = load_model_weights(run_dir / final), load_model_weights(uninterrupted / final)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)
