"""A staged run through the real entry point: SFT -> self-rewarding DPO (candidates and
judgements from real vLLM generators, Ray Train DPO, a weight sync) -> SPIN, one checkpoint per
stage; interrupted inside the first stage, then inside the second, and resumed each time at the
right stage and step, it ends as the same preset run without interruption."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from cluster import cli
from cluster.config.loading import load_config
from cluster.driver import train
from tests.helpers.runs import assert_same_run

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "self_reward_tiny.yaml"


def _rows(stage_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def staged(ray_cluster, tiny_model_path, tmp_path_factory):
    base = tmp_path_factory.mktemp("stages")
    preset = yaml.safe_load(PRESET.read_text())
    # The first launch knows only the SFT stage and stops it after 4 of its 8 steps ...
    first = {**preset, "stages": [dict(preset["stages"][0], set={**preset["stages"][0]["set"], "run.steps": 4})]}
    (base / "first.yaml").write_text(yaml.safe_dump(first))
    train(load_config(base / "first.yaml"), run_dir=base / "run")
    # ... the second knows two stages: SFT continues at step 5, the second stage stops after one
    # of its two steps ...
    second = {**preset, "stages": preset["stages"][:2]}
    second["stages"][1] = dict(second["stages"][1], set={**second["stages"][1]["set"], "run.steps": 1})
    (base / "second.yaml").write_text(yaml.safe_dump(second))
    assert cli.main(["train", str(base / "second.yaml"), "--resume", str(base / "run")]) == 0
    sft_rows = _rows(base / "run" / "stages" / "00-sft")
    # ... the user resumes with the whole preset: SFT is done, the second stage continues at step 2, SPIN follows.
    assert cli.main(["train", str(PRESET), "--resume", str(base / "run")]) == 0
    return base / "run", sft_rows


@pytest.fixture(scope="module")
def uninterrupted(staged, tmp_path_factory):
    run = tmp_path_factory.mktemp("stages-straight") / "run"
    train(load_config(PRESET), run_dir=run)
    return run


def test_every_stage_leaves_a_loadable_checkpoint_and_resume_continues_the_right_stage(staged):
    run, sft_rows_before = staged
    from transformers import AutoModelForCausalLM

    stages = sorted((run / "stages").iterdir())
    assert [s.name for s in stages] == ["00-sft", "01-self-reward", "02-spin"]
    for stage, algo, last in zip(stages, ["sft", "dpo", "dpo"], [8, 2, 1]):
        ckpt = stage / "checkpoints" / f"step_{last:05d}"
        AutoModelForCausalLM.from_pretrained(ckpt)
        assert json.loads((ckpt / "trainer_state" / "learner.json").read_text())["algorithm"] == algo
    # SFT's 8 steps ran once each (4 before the first interruption, 4 after), and it learned its
    # demonstrations.
    sft_rows = _rows(stages[0])
    assert sft_rows == sft_rows_before and [r["step"] for r in sft_rows] == list(range(1, 9))
    assert sft_rows[-1]["loss/total"] < 0.7 * sft_rows[0]["loss/total"]
    # The self-rewarding stage: step 1 from the first launch, step 2 after the resume, on new pairs.
    rows = _rows(stages[1])
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert not set(rows[1]["data/pair_ids"]) & set(rows[2]["data/pair_ids"])
    # Each stage starts from the previous one's final checkpoint, which is also its reference.
    saved = yaml.safe_load((stages[1] / "config.yaml").read_text())
    assert saved["model"]["path"] == str(stages[0] / "checkpoints" / "step_00008")
    assert yaml.safe_load((stages[2] / "config.yaml").read_text())["model"]["path"] == str(
        stages[1] / "checkpoints" / "step_00002"
    )


def test_the_resumed_staged_run_equals_the_uninterrupted_one(staged, uninterrupted):
    """Same steps, same units, same losses (1e-5); weights within 1e-4 = 0.1 lr for the DPO stages.
    (A resumed learner process's forward pass can differ from the uninterrupted one's in the last
    bits (a loss 4 ulps apart was seen once), and AdamW's early steps turn such a difference into
    up to a few hundredths of lr on weights whose gradient is near zero: 3e-5 after the DPO stages
    was seen once. A lost or repeated step, lost optimiser state or another pair moves weights
    by about lr = 1e-3.)"""
    run, _ = staged
    for stage, ids, final, weight_atol in (
        ("00-sft", "data/example_ids", "step_00008", 1e-5),
        ("01-self-reward", "data/pair_ids", "step_00002", 1e-4),
        ("02-spin", "data/pair_ids", "step_00001", 1e-4),
    ):
        assert_same_run(
            run / "stages" / stage,
            uninterrupted / "stages" / stage,
            ("loss/total",),
            ids,
            final,
            weight_atol=weight_atol,
        )
    # The self-rewarding iteration made the same pairs (judged by the same model), and SPIN drew
    # prompts the self-rewarding iteration had not (a new iteration, new prompts).
    for stage in ("01-self-reward", "02-spin"):
        got = pq.read_table(run / "stages" / stage / "data" / "pairs.parquet").to_pylist()
        assert got == pq.read_table(uninterrupted / "stages" / stage / "data" / "pairs.parquet").to_pylist()
    judged = {
        r["prompt_id"] for r in pq.read_table(run / "stages" / "01-self-reward" / "data" / "pairs.parquet").to_pylist()
    }
    spin = {r["prompt_id"] for r in pq.read_table(run / "stages" / "02-spin" / "data" / "pairs.parquet").to_pylist()}
    assert judged and spin and not judged & spin


def test_self_rewarding_iteration_judges_with_the_generators_and_syncs(staged):
    run, _ = staged
    stage = run / "stages" / "01-self-reward"
    rows = _rows(stage)
    last = rows[-1]
    # Every judgement is counted once: parsed + unparsed + out of range = judgements made,
    # k = 3 per candidate the judge saw (32 prompts x 4 candidates).
    c = {k[len("pairs/") :]: v for k, v in last.items() if k.startswith("pairs/")}
    assert c["judge_items"] == 32 * 4
    assert c["judge_judgements"] == 3 * (c["judge_items"] - c["judge_items_too_long"])
    assert c["judge_parsed"] + c["judge_unparsed"] + c["judge_out_of_range"] == c["judge_judgements"]
    assert c["judge_parsed"] > 0 and c["judge_out_of_range"] > 0  # the tiny judge writes numbers off the scale too
    assert c["candidates"] == c["judge_items_scored"]  # unscored candidates were left out ...
    assert c["pairs"] + sum(v for k, v in c.items() if k.startswith("no_pair_")) == 32  # ... and counted
    # The preference set on disk: valid Parquet with the judge's scores, best over worst.
    table = pq.read_table(stage / "data" / "pairs.parquet").to_pylist()
    assert len(table) == c["pairs"] and all(r["source"] == "self_judge" for r in table)
    assert all(r["score_chosen"] > r["score_rejected"] and r["chosen"] != r["rejected"] for r in table)
    assert all(0 <= r["score_rejected"] and r["score_chosen"] <= 5 for r in table)
    # Real DPO: the first step starts at log 2 (policy = reference), and the trained weights reached
    # the generators (their version is the learner's after the last step).
    assert rows[1]["loss/total"] == pytest.approx(0.6931, abs=1e-3)
    assert last["sync/generator_version"] == 2 and "eval/accuracy" in last


def test_spin_iteration_pairs_demonstrations_with_own_replies(staged):
    run, _ = staged
    stage = run / "stages" / "02-spin"
    table = pq.read_table(stage / "data" / "pairs.parquet").to_pylist()
    assert table and all(r["source"] == "spin" and r["chosen"] != r["rejected"] for r in table)
    # Chosen is the task's reference answer (the SFT data), rejected the model's own reply.
    assert all(r["chosen"].strip().lstrip("-").isdigit() for r in table)
    row = _rows(stage)[-1]
    assert row["pairs/pairs"] == len(table) and row["pairs/pairs"] + row["pairs/identical_pair"] <= 16
    assert row["loss/total"] == pytest.approx(0.6931, abs=1e-3)  # its reference: the previous stage's model


def test_the_judge_rewards_ppo(staged, tmp_path):
    """reward.function=llm_judge: PPO samples are judged by the generators that sampled them
    (here the SFT stage's tiny model, which writes numbers); unjudged samples are dropped and counted."""
    run, _ = staged
    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            f"model.path={run / 'stages' / '00-sft' / 'checkpoints' / 'step_00008'}",
            "reward.function=llm_judge",
            "run.steps=2",
            "rollout.prompts_per_step=16",
            "run.plot=false",
            "run.save_final=false",
            "train.lr=1e-4",
            "ppo.critic_lr=1e-4",  # small steps: the judge is the policy and should stay one
            *[f"judge.{k}={v}" for k, v in yaml.safe_load(PRESET.read_text())["judge"].items() if k != "template"],
        ],
    )
    cfg.judge.template = yaml.safe_load(PRESET.read_text())["judge"]["template"]
    train(cfg, run_dir=tmp_path / "ppo")
    rows = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["judge/items_scored"] >= 8
    for r in rows:  # also after an update, when the judge (the policy itself) has moved
        assert r["judge/items"] == 16 and r["judge/judgements"] == 48
        assert r["judge/parsed"] + r["judge/unparsed"] + r["judge/out_of_range"] == 48
        assert r["skipped"]["unjudged"] == r["judge/items_unscored"] < 16
        assert 0 <= r["reward/mean"] <= 5 and r["loss/total"] == r["loss/total"]  # finite, no NaN
