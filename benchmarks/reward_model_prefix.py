"""Reward-model training with and without a pair's shared prompt run once (``train.shared_prefix``).

The workload of ``tests/ray/test_reward_model.py``: SmolLM2-135M-Instruct as a Bradley-Terry
reward model on reasoning-gym ``spell_backward`` pairs (the correct reversed word against another
row's), 16 pairs per step, micro-batches of 8 pairs, the product's precision (``train.bf16: auto``).
Both contenders start from the same weights and head and train on the same pairs in the same
order, one step each in turn in one process, so the machine's drift hits both alike. With the
prompt shared, a pair's two rows are one packed tree row (the prompt, then both replies); without,
both rows run in full. Reported: seconds per step (median of the steps after the first) and the
losses of both, which must agree (same maths).

    .venv/bin/python benchmarks/reward_model_prefix.py [--steps 8] [--out docs/results/reward_model_prefix.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=16, help="pairs per step")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "reward_model_prefix.json"))
    a = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from actors.data.offline_data import answer_pairs, encode_pairs, normalise_row
    from actors.data.tasks import load_prompts
    from cluster.assets import resolve_model
    from cluster.config import RewardModelConfig, TrainConfig
    from learners.base import LearnerContext
    from learners.training.precision import resolve_bf16
    from learners.reward_model import RewardModelLearner

    torch.set_num_threads(torch.get_num_threads())
    path = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    train_set, _ = load_prompts("spell_backward", 240, 0, 0, {}, "")
    # As the run reads them from its preference file: each row normalised (prompt as chat messages).
    rows = [normalise_row(r)[0] for r in answer_pairs(train_set.rows, seed=0)[: a.steps * a.pairs]]
    batch, skipped = encode_pairs(rows, tok, max_prompt_tokens=96, max_response_tokens=24)
    prompt_tokens = float((batch.attention_mask & ~batch.response_mask).sum(1).float().mean())
    reply_tokens = float(batch.response_mask.sum(1).float().mean())
    learners = {}
    for shared in (True, False):
        train = TrainConfig(lr=5e-5, micro_batch_size=16, lr_schedule="constant", shared_prefix=shared)
        ctx = LearnerContext(model_path=path, seed=0, total_steps=a.steps)
        learners[shared] = RewardModelLearner.build(ctx, train, RewardModelConfig(head_lr=1e-3, center_coef=0.01))
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {True: [], False: []}
    for step in range(a.steps):
        part = batch.select(torch.arange(2 * step * a.pairs, 2 * (step + 1) * a.pairs))
        for shared in (True, False) if step % 2 == 0 else (False, True):
            t0 = time.perf_counter()
            m = learners[shared].train_step(part)
            times[shared].append(time.perf_counter() - t0)
            losses[shared].append(m["loss/total"])
            print(
                f"step {step + 1} shared={shared}: {times[shared][-1]:.2f}s loss {m['loss/total']:.5f} "
                f"(prompt shared by {m['learner/prefix_shared_frac']:.0%} of rows)",
                flush=True,
            )
    med = {s: statistics.median(t[1:]) for s, t in times.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "model": "smollm2-135m",
        "task": "spell_backward",
        "pairs_per_step": a.pairs,
        "steps": a.steps,
        "bf16": resolve_bf16("auto", "cpu"),
        "mean_prompt_tokens": prompt_tokens,
        "mean_reply_tokens": reply_tokens,
        "skipped_pairs": skipped,
        "step_s": {"shared": times[True], "unshared": times[False]},
        "loss": {"shared": losses[True], "unshared": losses[False]},
        "median_step_s_after_first": {"shared": med[True], "unshared": med[False]},
        "speedup": med[False] / med[True],
        "max_loss_gap": max(abs(x - y) for x, y in zip(losses[True], losses[False])),
    }
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "median_step_s_after_first",
                    "speedup",
                    "max_loss_gap",
                    "mean_prompt_tokens",
                    "mean_reply_tokens",
                )
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
