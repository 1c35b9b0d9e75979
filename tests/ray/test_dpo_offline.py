"""Offline DPO through the real entry point: preference rows on disk, a Reference actor scoring
every pair once, Ray Train learners, held-out evaluation, a servable checkpoint, and a resume
that ends as the uninterrupted run did (DPO and a reward model on the same pairs)."""

import json
from pathlib import Path

import pytest

from cluster import cli
from cluster.config.loading import load_config
from cluster.driver import train
from tests.helpers.runs import assert_same_run, crashed_copy

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def _preferences(path: Path, n: int = 56) -> Path:
    """Chosen: the sum written out; rejected: a refusal. Plus rows that must be counted, not used."""
    lines = []
    for i in range(n):
        a, b = i % 10, (3 * i) % 10
        lines.append(
            json.dumps(
                {
                    "prompt": f"What is {a} + {b}?",
                    "chosen": f"{a} + {b} = {a + b}.",
                    "rejected": "I cannot help with that.",
                }
            )
        )
    lines += ["{broken", json.dumps({"prompt": "q", "chosen": "same", "rejected": "same"})]
    path.write_text("\n".join(lines) + "\n")
    return path


def _settings(data: Path) -> list[str]:
    return [
        "run.algorithm=dpo",
        f"data.preference_file={data}",
        "data.eval_size=8",
        "dpo.pairs_per_step=8",
        "dpo.beta=0.5",
        "train.lr=1e-3",
        "train.epochs=1",
        "train.num_minibatches=1",
        "train.micro_batch_size=8",
        "train.lr_schedule=constant",
        "run.eval_every=3",
        "run.save_every=3",
        "run.keep_last=0",
        "run.plot=true",
    ]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_offline_dpo_learns_held_out_preferences_and_resumes(ray_cluster, tiny_model_path, tmp_path):
    data = _preferences(tmp_path / "prefs.jsonl")
    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml", _settings(data) + ["run.steps=6"])
    result = train(cfg, run_dir=tmp_path / "run")
    # Stopped after step 3: the user's command continues it (reference log-probs from the cache),
    # and it ends as the uninterrupted run: the same pairs in the same order, losses, weights.
    stopped = crashed_copy(tmp_path / "run", 3, tmp_path / "stopped")
    assert cli.main(["train", "--resume", str(stopped), "--set", "run.steps=6"]) == 0
    assert_same_run(stopped, tmp_path / "run", ("loss/total", "eval/loss/total"), "data/pair_ids", "step_00006")
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(0, 7))
    base, trained = rows[0], rows[1:]
    # Before training the policy is the reference: every implicit reward is 0, the loss log 2.
    assert base["eval/loss/total"] == pytest.approx(0.6931, abs=1e-3) and base["eval/pairs"] == 8
    last = rows[-1]
    assert last["eval/rewards/accuracy"] == 1.0
    assert last["eval/rewards/margin"] > base["eval/rewards/margin"] + 0.5
    assert last["eval/loss/total"] < 0.5 * base["eval/loss/total"]
    assert trained[0]["loss/total"] == pytest.approx(0.6931, abs=1e-3)  # one epoch: before the first update
    assert trained[-1]["loss/total"] < 0.5 * trained[0]["loss/total"]
    # Every step drew 8 new pairs: 6 x 8 = 48 = the whole train split, none repeated.
    drawn = [i for r in trained for i in r["data/pair_ids"]]
    assert sorted(drawn) == list(range(48))
    assert all(r["skipped_at_load"] == {"malformed_row": 1, "identical_pair": 1} for r in trained)
    assert (tmp_path / "run" / "data" / "reference_logprobs.parquet").is_file()
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    # The checkpoints are model folders that transformers loads as they are.
    from transformers import AutoModelForCausalLM

    assert result.final_checkpoint.name == "step_00006"
    final = tmp_path / "run" / "checkpoints" / "step_00006"
    AutoModelForCausalLM.from_pretrained(final)
    assert json.loads((final / "trainer_state" / "learner.json").read_text())["algorithm"] == "dpo"


def test_a_resumed_reward_model_run_equals_the_uninterrupted_one(ray_cluster, tiny_model_path, tmp_path):
    data = _preferences(tmp_path / "prefs.jsonl")
    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        _settings(data)
        + ["run.algorithm=reward_model", "run.steps=4", "run.save_every=2", "run.eval_every=2", "run.plot=false"],
    )
    train(cfg, run_dir=tmp_path / "rm")
    stopped = crashed_copy(tmp_path / "rm", 2, tmp_path / "stopped")
    assert cli.main(["train", "--resume", str(stopped)]) == 0
    assert_same_run(stopped, tmp_path / "rm", ("loss/total", "eval/accuracy"), "data/pair_ids", "step_00004")


def test_dpo_config_errors_are_one_line(tmp_path):
    with pytest.raises(Exception, match="dpo.candidates"):
        load_config(ROOT / "configs" / "ppo_tiny.yaml", ["run.algorithm=dpo", "dpo.candidates=1"])
    from cluster.run_context import preflight

    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml", ["run.algorithm=dpo", f"data.preference_file={tmp_path}/no.jsonl"]
    )
    with pytest.raises(Exception, match="preference file not found"):
        preflight(cfg)


def test_dpo_on_scored_pairs_from_the_generators(ray_cluster, tiny_model_path, tmp_path):
    """No preference file: vLLM samples 4 candidates per prompt, the reward function ranks them,
    best vs worst become pairs; DPO trains on them and the greedy evaluation runs on the
    generator after a weight sync."""
    import pyarrow.parquet as pq

    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            "run.algorithm=dpo",
            "reward.function=tests.helpers.rewards:reply_length",
            "dpo.pairs=scorer",
            "dpo.candidates=4",
            "dpo.candidate_temperature=1.0",
            "dpo.pair_prompts=64",
            "dpo.eval_pairs=6",
            "dpo.pairs_per_step=6",
            "dpo.beta=0.5",
            "train.lr=1e-3",
            "train.epochs=1",
            "train.num_minibatches=1",
            "run.steps=3",
            "run.eval_every=3",
            "data.eval_size=8",
            "run.plot=false",
        ],
    )
    train(cfg, run_dir=tmp_path / "run")
    rows = _rows(tmp_path / "run")
    table = pq.read_table(tmp_path / "run" / "data" / "pairs.parquet").to_pylist()
    assert all(t["score_chosen"] > t["score_rejected"] and t["source"] == "scorer" for t in table)
    # Every prompt gave a pair or is counted by why it did not; pairs split into 6 held out and the rest.
    r1 = rows[1]
    assert len(table) == r1["pairs/pairs"]
    assert len(table) + sum(v for k, v in r1.items() if k.startswith("pairs/no_pair_")) == r1["pairs/prompts"] == 64
    assert r1["data/held_out_pairs"] == 6 and r1["data/train_pairs"] == len(table) - 6 >= 12
    base, last = rows[0], rows[-1]
    held = base["eval/pairs"]
    assert held == 6 and last["eval/pairs"] == 6
    assert all(r["learner/pairs"] == 6 for r in rows[1:])
    # The greedy task evaluation ran on the generators (8 held-out prompts), before and after.
    assert base["eval/n"] == 8 and last["eval/n"] == 8 and "eval/mean_score" in last
    # Before training the policy is the reference (loss log 2); afterwards the held-out pairs
    # are ranked better than at the start.
    assert base["eval/loss/total"] == pytest.approx(0.6931, abs=1e-3)
    assert rows[1]["loss/total"] == pytest.approx(0.6931, abs=1e-3)  # one epoch: the loss before the update
    assert last["eval/rewards/margin"] > base["eval/rewards/margin"]
    assert last["eval/loss/total"] < base["eval/loss/total"]
