"""Resume on the real stack (vLLM generator, scorer, reference, Ray Train learner, the train
prompts streamed by Ray Data from a folder of Parquet shards), and the checkpoint a run leaves
behind loads in vLLM and transformers as it is."""

import json
from pathlib import Path

import pytest
import ray
import torch

from cluster import cli
from cluster.config.loading import load_config
from cluster.driver import train
from learners.base import load_model_weights

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
# 12 prompts, 8 per step: the sampler crosses an epoch boundary at step 2, where the run stops.
# A constant learning rate, so that stopping at 2 and extending to 4 is the 4-step schedule.
SETTINGS = [
    "run.save_every=2",
    "run.eval_every=0",
    "run.plot=false",
    "rollout.prompts_per_step=8",
    "data.train_size=12",
    "data.eval_size=4",
    "train.lr_schedule=constant",
    "run.keep_last=0",
]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _streamed_prompts(folder: Path) -> list[str]:
    """The task's 12 train prompts as three Parquet shards (streamed: data.streaming) and its 4
    held-out ones in a file of their own."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actors.data.tasks import load_prompts

    train_set, held = load_prompts("basic_arithmetic", 12, 4, 0, {"min_terms": 2, "max_terms": 2}, "")
    (folder / "train").mkdir()
    for k in range(3):
        pq.write_table(
            pa.Table.from_pylist(
                [{"prompt": r["prompt"], "answer": r["answer"]} for r in train_set.rows[4 * k : 4 * k + 4]]
            ),
            folder / "train" / f"{k}.parquet",
        )
    pq.write_table(
        pa.Table.from_pylist([{"prompt": r["prompt"], "answer": r["answer"]} for r in held.rows]),
        folder / "held.parquet",
    )
    return [
        f"data.task={folder / 'train'}",
        "data.streaming=true",
        "data.shuffle_buffer=3",
        f"data.eval_task={folder / 'held.parquet'}",
        "data.instruction=",
    ]


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_model_path, tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    settings = SETTINGS + _streamed_prompts(base)
    straight = train(load_config(ROOT / "configs" / "ppo_tiny.yaml", settings + ["run.steps=4"]), run_dir=base / "a")
    train(load_config(ROOT / "configs" / "ppo_tiny.yaml", settings + ["run.steps=2"]), run_dir=base / "b")
    # The user's command: continue run b, asking for 4 steps in all.
    assert cli.main(["train", "--resume", str(base / "b"), "--set", "run.steps=4"]) == 0
    return straight, base / "a", base / "b"


def test_resumed_run_equals_the_uninterrupted_one(runs):
    _, a, b = runs
    rows_a, rows_b = _rows(a), _rows(b)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    # The same prompts in the same order, none repeated or skipped across the stop.
    assert [r["data/prompt_ids"] for r in rows_b] == [r["data/prompt_ids"] for r in rows_a]
    ids = [i for r in rows_b for i in r["data/prompt_ids"]]
    assert sorted(ids[:12]) == list(range(12))
    # The same samples and rewards after the resume (the sampler is seeded per step) ...
    assert [r["reward/mean"] for r in rows_b] == pytest.approx([r["reward/mean"] for r in rows_a], abs=1e-6)
    assert rows_b[2]["generate/policy_version"] == 2
    # ... and the same final weights (fp32 throughout; tolerance for float summation order).
    wa = load_model_weights(a / "checkpoints" / "step_00004")
    wb = load_model_weights(b / "checkpoints" / "step_00004")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4, msg=k)
    base = load_model_weights(Path(runs[0].final_checkpoint).parent / "step_00002")
    assert any(not torch.allclose(base[k], wb[k]) for k in wb)  # steps 3-4 really trained
    state = json.loads((b / "checkpoints" / "step_00004" / "trainer_state" / "run_state.json").read_text())
    assert state["step"] == 4 and state["version"] == 4 and state["sampler"] == {"consumed": 32}


def test_checkpoint_serves_in_vllm_and_transformers(runs):
    """vllm.LLM(model=<checkpoint>) (a real engine in a Ray actor) and AutoModelForCausalLM load
    the run's checkpoint folder as it is, and their greedy outputs agree."""
    from transformers import AutoModelForCausalLM

    from actors.rollout.generator import GeneratorConfig
    from cluster.roles.workers import GeneratorWorker

    ckpt = str(runs[0].final_checkpoint)
    gen = (
        ray.remote(GeneratorWorker)
        .options(num_cpus=1)
        .remote(GeneratorConfig(model_path=ckpt, dtype="float32", max_prompt_tokens=64, max_new_tokens=12))
    )
    rows = [{"prompt": f"What is {i} + {2 * i}?", "meta": {}} for i in range(4)]
    try:
        exp, _ = ray.get(gen.generate.options(num_returns=2).remote(rows, list(range(4)), True))
    finally:
        ray.kill(gen)
    lm = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    eos = lm.generation_config.eos_token_id
    for i in range(exp.batch_size):
        prompt = exp.input_ids[i][exp.attention_mask[i] & ~exp.response_mask[i]]
        vllm_tokens = exp.input_ids[i][exp.response_mask[i]].tolist()
        out = lm.generate(
            prompt[None],
            attention_mask=torch.ones_like(prompt)[None],
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        hf_tokens = out[0, len(prompt) :].tolist()[: len(vllm_tokens)]
        assert hf_tokens == vllm_tokens, i
