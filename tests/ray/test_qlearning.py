"""Token-level Q-learning through the real entry point: online (vLLM generators acting with the
Boltzmann Q-policy, a replay actor, Ray Train learners, weight sync, resume with the buffer
refilled) and offline on transitions a PPO run exported, with bad rows counted and the KL anchor
fed by a Reference actor."""

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.data.transitions import read_transitions
from cluster import cli
from cluster.config.loading import load_config
from cluster.driver import train
from cluster.ops.ledger import read_ledger, summarize, valid_records
from tests.helpers.runs import assert_same_run, crashed_copy

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_online_q_learning_across_turns_raises_the_reward_and_resumes_with_its_buffer(
    ray_cluster, tiny_model_path, tmp_path
):
    """Multi-turn episodes (the generators run them, ``actors/agents/episodes.py``): the one reward comes
    after the second reply and depends on the first only, so credit has to cross the
    environment's observation; the n-step backups carry it (the backup at turn 1's last token
    bootstraps from the state before turn 2's first action)."""
    run = tmp_path / "online"
    cfg = load_config(
        ROOT / "configs" / "qlearn_tiny.yaml",
        [
            "run.steps=12",
            "run.save_every=5",
            "qlearn.warmup_sequences=33",
            "qlearn.n_step=24",
            "env.name=tests.helpers.environments:DigitsAcrossTurns",
            "env.max_turns=2",
            "train.sharding=fsdp",
            "cluster.num_learners=2",
        ],
    )
    train(cfg, run_dir=run)
    # Stopped after step 5 and resumed: the replay buffer is refilled from the exported steps 1-5
    # (the later steps' files are removed and written again), and the run ends as the
    # uninterrupted one did: the same prompts, rewards, TD losses and weights.
    stopped = crashed_copy(run, 5, tmp_path / "stopped")
    assert cli.main(["train", "--resume", str(stopped)]) == 0
    assert_same_run(stopped, run, ("reward/mean", "loss/td"), "data/prompt_ids", "step_00012")
    rows = _rows(stopped)
    assert [r["step"] for r in rows] == list(range(1, 13))
    rewards = [r["reward/mean"] for r in rows]
    # The digit-density reward of the first reply rises under the Q-policy.
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.3, rewards
    # 32 sequences a step, nothing evicted (capacity 512): step 6 sees the refilled 5 x 32 plus its own.
    assert [r["replay/size"] for r in rows] == [32.0 * s for s in range(1, 13)]
    # Step 1 only fills the buffer (32 < 33 sequences); then two minibatch updates a step.
    assert rows[0]["learner/warmup"] == 1.0 and "loss/td" not in rows[0]
    learned = rows[1:]
    assert all(r["learner/target_updates"] == 2 * (r["step"] - 1) for r in learned)
    assert all(math.isfinite(r["loss/td"]) and r["q/unseen_mean"] < r["q/taken"] for r in learned)
    exported, skipped = read_transitions(stopped / "data" / "transitions")
    assert len(exported) == 384 and not skipped
    # One row per episode, the observation between the turns kept in place as no action.
    assert all(t.action_mask is not None and t.action_mask[0] and not all(t.action_mask) for t in exported)
    assert all(r["episode/turns_mean"] == 2.0 for r in rows)
    ckpt = stopped / "checkpoints" / "step_00012"
    assert (ckpt / "target" / "target.safetensors").is_file() and (ckpt / "model.safetensors").is_file()


def _bad_rows(path: Path) -> None:
    """Rows an exporter or a user could get wrong: each must be counted and excluded."""
    table = pa.table(
        {
            "prompt_ids": [[5, 6], [5, 6], [5, 6]],
            "response_ids": [[7, 8], [7], []],
            "rewards": [[0.0], [float("nan")], []],
            "done": [True, True, True],
            "behaviour_version": [0, 0, 0],
            "group_id": [0, 1, 2],
        }
    )
    pq.write_table(table, path)


def test_offline_q_learning_on_transitions_a_ppo_run_exported(ray_cluster, tiny_model_path, tmp_path):
    ppo = load_config(
        ROOT / "configs" / "ppo_tiny.yaml", ["run.steps=3", "run.export_transitions=true", "run.save_final=false"]
    )
    train(ppo, run_dir=tmp_path / "ppo")
    folder = tmp_path / "ppo" / "data" / "transitions"
    ppo_rows = _rows(tmp_path / "ppo")
    assert [r["export/transitions"] for r in ppo_rows] == [32, 32, 32]
    _bad_rows(folder / "zz-bad.parquet")
    exported, _ = read_transitions(folder)
    cfg = load_config(
        ROOT / "configs" / "qlearn_tiny.yaml",
        [
            f"data.transition_file={folder}",
            "run.steps=6",
            "run.eval_every=3",
            "qlearn.batch_sequences=32",
            "qlearn.eval_transitions=16",
            "qlearn.kl_coef=0.01",
            "run.save_every=3",
            "run.eval_sampled=true",
        ],
    )
    train(cfg, run_dir=tmp_path / "offline")
    # Stopped after step 3 and resumed: the same replay batches, TD losses and weights.
    stopped = crashed_copy(tmp_path / "offline", 3, tmp_path / "stopped")
    assert cli.main(["train", "--resume", str(stopped)]) == 0
    # The sampled evaluation is seeded: the resumed run's equals the uninterrupted one's.
    assert_same_run(
        stopped, tmp_path / "offline", ("loss/td", "eval/loss/td", "eval/sampled_reward"), None, "step_00006"
    )
    # The ledger of its units, replay draws of transitions: every draw trained once, and the
    # resumed run drew the same transitions at each step as the uninterrupted one.
    drawn = {}
    for run in ("offline", "stopped"):
        records = valid_records(read_ledger(tmp_path / run))
        summary = summarize(records)
        assert summary["unit"] == "transition" and summary["prompts"]["issued"] == 6 * 32, summary
        assert summary["prompts"]["trained"] == 6 * 32 and summary["prompts"]["lost"] == 0, summary
        drawn[run] = [(r["step"], r["prompt"]) for r in records if r["event"] == "issued"]
    assert drawn["stopped"] == drawn["offline"] and len({t for _, t in drawn["offline"]}) > 32
    rows = _rows(tmp_path / "offline")
    assert [r["step"] for r in rows] == list(range(0, 7))
    evals = [r for r in rows if "eval/mean_score" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    # The behaviour policy's own reward (the PPO samples) is reported beside the greedy Q-policy's.
    train_rows = len(exported) - 16
    assert rows[0]["data/transitions"] == train_rows == 96 - 16
    assert 0.0 <= rows[0]["data/behaviour_mean_reward"] <= 1.0
    assert all(0.0 <= r["eval/mean_score"] <= 1.0 and r["eval/n"] == 16 for r in evals)
    assert all(r["eval/sampled_n"] == 16 * cfg.rollout.samples_per_prompt for r in evals)
    assert all(0.0 <= r["eval/sampled_accuracy"] <= 1.0 and 0.0 <= r["eval/sampled_reward"] <= 1.0 for r in evals)
    assert all("eval/loss/td" in r for r in evals)
    trained = rows[1:]
    assert all(r["skipped_at_load"] == {"length_mismatch": 1, "nan_reward": 1, "empty_response": 1} for r in trained)
    assert trained[-1]["loss/td"] < trained[0]["loss/td"]
    assert all(r["learner/sequences"] == 32 for r in trained)
    # The KL anchor ran: a Reference actor scored every sampled batch, the policy left the reference.
    assert all(r["kl/ref_k3"] >= 0 for r in trained) and trained[-1]["kl/ref_k3"] > 1e-4
