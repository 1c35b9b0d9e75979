"""End to end on the shared local cluster: real vLLM generator, scorer, reference and a real
Ray Train learner; the tiny model learns a dense reward within about a minute."""

import json

import pytest
import torch

from cluster.config_loading import load_config
from cluster.driver import train

pytestmark = pytest.mark.ray


def test_ppo_tiny_reward_rises(ray_cluster, tiny_model_path, tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "ppo_tiny.yaml", ["run.steps=25", "run.eval_every=12"])
    result = train(cfg, run_dir=tmp_path / "run")
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(0, 26))
    # Step 0: the starting policy's held-out evaluation, before any update.
    base, rows = rows[0], rows[1:]
    assert base["eval/n"] > 0 and "reward/mean" not in base
    start = sum(r["reward/mean"] for r in rows[:3]) / 3
    end = sum(r["reward/mean"] for r in rows[-3:]) / 3
    assert end > start + 0.15, (start, end)
    # fp32 generator and learner: the rollout log-probs are the learner's own.
    assert max(r["logprob_gap/max_abs"] for r in rows) < 1e-3
    for key in ("time/generate_s", "time/score_s", "time/reference_s", "time/learn_s", "time/sync_s",
                "kl/ref_k1", "policy/clip_frac", "reward/std", "response/length_mean"):
        assert all(key in r and r[key] is not None for r in rows), key
    assert rows[-1]["kl/ref_k1"] > 0  # the policy moved away from the reference
    # Peak memory of each role's process is recorded (the generator holds a vLLM engine).
    for role in ("generator", "scorer", "reference", "learner"):
        assert all(0.05 < r[f"memory/{role}_peak_gb"] < 24 for r in rows), role
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [12, 24, 25]
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    # The final checkpoint is a plain transformers folder with safetensors.
    from transformers import AutoModelForCausalLM

    assert result.final_checkpoint is not None
    assert (result.final_checkpoint / "model.safetensors").is_file()
    lm = AutoModelForCausalLM.from_pretrained(result.final_checkpoint)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert not torch.equal(lm.model.embed_tokens.weight, base.model.embed_tokens.weight)


def test_bad_input_is_counted_not_fatal(ray_cluster, tiny_model_path, tmp_path):
    """Malformed rows, over-long prompts, and a reward function that raises or returns NaN/inf:
    every one is counted in the metrics and none reaches the loss."""
    from pathlib import Path

    data = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"What is {i} + {i + 2}?", "answer": str(2 * i + 2)}) for i in range(30)]
    lines += [json.dumps({"prompt": "word " * 120, "answer": "0"}) for _ in range(5)]
    lines += ["{not json", json.dumps({"prompt": ""}), json.dumps([1, 2]), json.dumps({"prompt": None})]
    data.write_text("\n".join(lines) + "\n")
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "ppo_tiny.yaml", [
        "run.steps=2", "reward.function=tests.helpers.rewards:flaky", "run.save_final=false", "run.plot=false",
        f"data.task=jsonl:{data}", "data.train_size=35", "data.eval_size=0", "rollout.prompts_per_step=35",
        "model.max_prompt_tokens=64",
    ])
    train(cfg, run_dir=tmp_path / "run")
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["skipped_at_load"] == {"malformed_json": 2, "empty_or_malformed_prompt": 2}
        sk = r["skipped"]
        assert sk["prompt_too_long"] == 5
        assert sk["reward_error"] + sk["reward_nonfinite"] > 0
        assert r["reward/n"] + sk["reward_error"] + sk["reward_nonfinite"] + sk["prompt_too_long"] == 35
        assert r["loss/total"] is not None and r["reward/mean"] == r["reward/mean"]  # finite, not NaN
