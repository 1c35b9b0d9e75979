"""Early stopping comes with the shared step loop, so it works in the loops that never had it:
PPO and online Q-learning, on the real stack (vLLM generators, Ray Train learners).

The stopping metric is ``eval/n`` (the held-out prompts evaluated, 4 at every evaluation): it never
improves on its first value, so with patience 2 each run must stop two evaluations after its
first, whatever the model learns; a loop that ignores early stopping runs all 8 steps."""

import json
from pathlib import Path

import pytest

from cluster.config.loading import load_config
from cluster.driver import train
from cluster.run_context import RUN_STATE_FILE, latest_checkpoint

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
STOP = [
    "run.steps=8",
    "run.eval_every=1",
    "run.eval_before_train=false",
    "run.early_stop_metric=eval/n",
    "run.early_stop_mode=min",
    "run.early_stop_patience=2",
    "run.plot=false",
    "rollout.prompts_per_step=8",
    "data.eval_size=4",
]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _state(folder: Path) -> dict:
    return json.loads((folder / "trainer_state" / RUN_STATE_FILE).read_text())


def test_ppo_stops_early_and_saves_the_stopping_step(ray_cluster, tiny_model_path, tmp_path):
    result = train(load_config(ROOT / "configs" / "ppo_tiny.yaml", STOP), run_dir=tmp_path / "ppo")
    assert [r["step"] for r in _rows(tmp_path / "ppo")] == [1, 2, 3]
    ckpt = latest_checkpoint(tmp_path / "ppo")
    assert ckpt.name == "step_00003" and result.final_checkpoint == ckpt
    assert _state(ckpt)["early_stop"]["stopped"] is True and (ckpt / "model.safetensors").is_file()


def test_online_q_learning_stops_early_and_keeps_its_best_checkpoint(ray_cluster, tiny_model_path, tmp_path):
    cfg = load_config(
        ROOT / "configs" / "qlearn_tiny.yaml",
        STOP + ["run.early_stop_keep_best=true", "run.save_every=2", "run.keep_last=1"],
    )
    result = train(cfg, run_dir=tmp_path / "q")
    assert [r["step"] for r in _rows(tmp_path / "q")] == [1, 2, 3]
    # Step 1's evaluation is the best (the first value): its checkpoint is the run's final one; step 2's
    # periodic checkpoint came after it and is gone.
    best = tmp_path / "q" / "checkpoints" / "step_00001"
    assert sorted(p.name for p in best.parent.iterdir()) == ["step_00001"]
    assert result.final_checkpoint == best == latest_checkpoint(tmp_path / "q")
    state = _state(best)
    assert state["step"] == 1 and state["early_stop"]["stopped"] is True
    assert (best / "model.safetensors").is_file() and (best / "target" / "target.safetensors").is_file()
