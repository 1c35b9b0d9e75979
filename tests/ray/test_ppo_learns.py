"""End to end on the shared local cluster: real vLLM generator, scorer, reference and a real
Ray Train learner; the tiny model learns a dense reward within about a minute."""

import json

import pytest
import torch

from cluster.config.loading import load_config
from cluster.driver import train

pytestmark = pytest.mark.ray


def test_ppo_tiny_reward_rises(ray_cluster, tiny_model_path, tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # A separate critic (ppo.critic=separate): PPO with a value network of its own learns too.
    cfg = load_config(root / "configs" / "ppo_tiny.yaml", ["run.steps=25", "run.eval_every=12", "ppo.critic=separate"])
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
    for key in (
        "time/generate_s",
        "time/score_s",
        "time/reference_s",
        "time/learn_s",
        "time/sync_s",
        "kl/ref_k1",
        "policy/clip_frac",
        "reward/std",
        "response/length_mean",
    ):
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
    assert (result.final_checkpoint / "critic" / "critic.safetensors").is_file()  # beside, not in, the model folder
    lm = AutoModelForCausalLM.from_pretrained(result.final_checkpoint)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert not torch.equal(lm.model.embed_tokens.weight, base.model.embed_tokens.weight)


def _own_data(tmp_path):
    """Three sources in the layouts users bring, each with malformed rows: a verl Parquet file
    (chat-message prompts, data_source, reward_model.ground_truth; two rows of a source no reward
    is mapped to), an OpenRLHF-style JSONL file (input / label keys; over-long prompts, broken
    lines) and a datasets folder (save_to_disk)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    verl = [
        {
            "data_source": "gsm_like" if i < 10 else "mystery",
            "prompt": [{"role": "user", "content": f"Add {i} and {i + 2}."}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 2)},
            "extra_info": {"index": i},
        }
        for i in range(12)
    ]
    verl += [
        {
            "data_source": "gsm_like",
            "prompt": [],
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"index": 12},
        },
        {
            "data_source": "gsm_like",
            "prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"index": 13},
        },
    ]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "verl.parquet")
    lines = [json.dumps({"input": f"What is {i} + {i + 2}?", "label": str(2 * i + 2)}) for i in range(10)]
    lines += [json.dumps({"input": "word " * 120, "label": "0"}) for _ in range(5)]
    lines += ["{not json", json.dumps({"input": ""}), json.dumps([1, 2]), json.dumps({"input": None})]
    (tmp_path / "openrlhf.jsonl").write_text("\n".join(lines) + "\n")
    own = [{"prompt": f"Write the number {i} in digits."} for i in range(8)] + [{"prompt": ""}]
    datasets.Dataset.from_list(own).save_to_disk(str(tmp_path / "own"))
    return [
        {"task": str(tmp_path / "verl.parquet"), "weight": 12},
        {
            "task": str(tmp_path / "openrlhf.jsonl"),
            "weight": 15,
            "name": "openrlhf",
            "prompt_key": "input",
            "answer_key": "label",
        },
        {"task": str(tmp_path / "own"), "weight": 8, "name": "own"},
    ]


def test_own_data_with_bad_rows_routed_rewards_and_trackers(
    ray_cluster, tiny_model_path, tmp_path, monkeypatch, capsys
):
    """A run on three users' data layouts mixed by weight: malformed rows, over-long prompts, a
    source without a reward and a reward function that raises or returns NaN/inf are each counted
    and none reaches the loss; rewards are routed by source; the prompts the generators received
    are the ones ``rayrlhf data inspect`` shows; W&B (offline) and MLflow (file store) receive
    every step's metrics. Its learners are two sharded Ray Train workers (train.sharding=fsdp):
    each sync gathers their shards, and the generators serve what the learner holds (the probe); the
    KL term's reference is a frozen copy sharded in the same workers (train.reference=learners)."""
    from pathlib import Path

    import pyarrow.parquet as pq
    import yaml

    from cluster.cli import main as cli
    from tests.helpers.trackers import mlflow_run, wandb_offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "configs" / "ppo_tiny.yaml").read_text())
    data["run"].update(
        steps=2, save_final=True, plot=False, export_transitions=True, trackers=["tensorboard", "wandb", "mlflow"]
    )
    data["train"]["sharding"] = "fsdp"
    data["train"]["reference"] = "learners"  # the KL term's reference: a frozen copy sharded in the learners
    data["cluster"] = {"num_learners": 2}
    # Every usable row once per step: the train set is the 35 usable rows, each source's share its size.
    data["data"] = {"mix": _own_data(tmp_path), "train_size": 35, "eval_size": 0}
    data["reward"] = {
        "by_source": {"gsm_like": "exact_match", "openrlhf": "tests.helpers.rewards:flaky", "own": "digit_density"}
    }
    data["rollout"]["prompts_per_step"] = 35
    data["model"]["max_prompt_tokens"] = 64
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(data))
    result = train(load_config(tmp_path / "own.yaml"), run_dir=tmp_path / "run")
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    # Sharded learners: both ranks trained, every sync reached the generators as the learner's
    # weights, and the final checkpoint is a whole model folder that moved from the start.
    from transformers import AutoModelForCausalLM

    assert all(r["sync/probe_gap"] < 1e-3 for r in rows)
    assert all(r["reference/in_learner"] and r["learner/ref_s"] > 0 for r in rows)  # no Reference actor
    assert all(0 < r["learner/local_sequences"] < r["learner/sequences"] for r in rows)  # rank 0's share
    trained = AutoModelForCausalLM.from_pretrained(result.final_checkpoint)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert not torch.equal(trained.model.layers[0].mlp.up_proj.weight, start.model.layers[0].mlp.up_proj.weight)
    for r in rows:
        assert r["skipped_at_load"] == {"malformed_row": 2, "empty_or_malformed_prompt": 5}
        sk = r["skipped"]
        assert sk["prompt_too_long"] == 5 and sk["reward_unmapped_source"] == 2
        assert sk["reward_error"] + sk["reward_nonfinite"] > 0
        assert r["reward/n"] + sk["reward_error"] + sk["reward_nonfinite"] + sk["prompt_too_long"] + 2 == 35
        # Each source's rows reached its own function, and only those.
        assert r["reward/component/exact_match/n"] == 10 and r["reward/component/digit_density/n"] == 8
        assert r["reward/component/flaky/n"] + sk["reward_error"] + sk["reward_nonfinite"] == 10
        assert r["loss/total"] is not None and r["reward/mean"] == r["reward/mean"]  # finite, not NaN
    # The prompts the generators sampled after, id for id, are the ones data inspect shows.
    capsys.readouterr()
    assert cli(["data", "inspect", "--config", str(tmp_path / "own.yaml"), "--json"]) == 0
    shown = {r["prompt"]: r for r in json.loads(capsys.readouterr().out)["splits"]["train"]["rows"]}
    sampled = [
        t
        for f in sorted((tmp_path / "run" / "data" / "transitions").glob("*.parquet"))
        for t in pq.read_table(f).to_pylist()
    ]
    prompts = {json.loads(t["meta"])["prompt"]: t["prompt_ids"] for t in sampled}
    # Exported are the scored samples: every row of the two sources whose functions never fail.
    assert set(prompts) <= {p for p, r in shown.items() if r["skipped"] is None}
    assert {p for p, r in shown.items() if r["data_source"] in ("gsm_like", "own")} <= set(prompts)
    assert all(ids == shown[p]["ids"] for p, ids in prompts.items())
    assert any(json.loads(t["meta"]).get("messages") for t in sampled)  # the verl rows went as chat messages
    # The trackers got every step's numbers.
    wb, ml = wandb_offline_run(tmp_path / "run"), mlflow_run(tmp_path / "run")
    for r in rows:
        assert wb["history"][r["step"]]["reward/mean"] == pytest.approx(r["reward/mean"])
        assert ml["metrics"]["reward/mean"][r["step"]] == pytest.approx(r["reward/mean"])
        assert ml["metrics"]["skipped/reward_unmapped_source"][r["step"]] == 2
