"""Offline DPO throughput against TRL: rayrlhf and TRL's DPOTrainer on the same workload, one run.

Same model (SmolLM2-135M-Instruct, fp32 master weights, bf16 autocast where the CPU computes bf16 natively, fp32 elsewhere), the same preference
pairs in the same order (reasoning-gym basic_arithmetic prompts; chosen: a worked reply with the
right answer, rejected: the same with a wrong one), pairs per optimiser step, sequence budget,
loss (sigmoid DPO, beta 0.1), optimiser (AdamW, constant lr, clip 1.0), one pass, and reference
log-probs computed once before training by both. Each tool runs in its own process, one after the
other, on an otherwise idle machine; the contenders alternate over ``--repeats`` rounds.

Reported: training throughput (pairs / s over the optimiser steps), end-to-end throughput
(pairs / s over the whole process: start-up, reference pass, training), and both loss curves.

    make trl-env                                  # once: .venv-trl with TRL
    .venv/bin/python benchmarks/vs_trl_dpo.py [--steps 20] [--out docs/results/vs_trl_dpo.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learners.training.precision import resolve_bf16  # noqa: E402

# bf16: both tools in what `auto` gives this machine (bf16 autocast only where the CPU computes bf16 natively).
SETTINGS = {
    "model": "smollm2-135m",
    "seed": 0,
    "pairs_per_step": 8,
    "lr": 5e-6,
    "beta": 0.1,
    "max_grad_norm": 1.0,
    "max_prompt_tokens": 128,
    "max_new_tokens": 48,
    "bf16": resolve_bf16("auto", "cpu"),
}


def preference_rows(n: int, seed: int) -> list[dict]:
    """Worked replies to basic_arithmetic prompts, right (chosen) and wrong (rejected)."""
    from actors.data.tasks import load_prompts

    train, _ = load_prompts(
        "basic_arithmetic",
        n,
        0,
        seed,
        {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
        "Answer with just the final answer.",
    )
    rng = random.Random(seed)
    rows = []
    for r in train.rows:
        q = r["meta"]["question"].strip().removeprefix("Calculate").strip().rstrip(".?")
        right = r["answer"]
        wrong = str(int(right) + rng.choice([-3, -2, -1, 1, 2, 3, 10])) if right.lstrip("-").isdigit() else right + "1"
        reply = "Let me work it out step by step. Computing {q} gives {a}. So the final answer is {a}."
        rows.append(
            {"prompt": r["prompt"], "chosen": reply.format(q=q, a=right), "rejected": reply.format(q=q, a=wrong)}
        )
    return rows


def rayrlhf_order(pairs_file: Path, steps: int) -> list[dict]:
    """The pairs in the order rayrlhf's recipe trains on them (same loader, split and sampler)."""
    from cluster.config.loading import load_config
    from cluster.recipes.dpo import load_data
    from cluster.data.prompts import PromptSampler

    cfg = load_config(overrides=_overrides(pairs_file, steps))
    train_set, _, _ = load_data(cfg)
    sampler = PromptSampler(len(train_set.rows), cfg.dpo.pairs_per_step, cfg.run.seed)
    return [train_set.rows[i] for _ in range(steps) for i in sampler.next()]


def _overrides(pairs_file: Path, steps: int) -> list[str]:
    s = SETTINGS
    return [
        "run.algorithm=dpo",
        f"model.path={s['model']}",
        f"data.preference_file={pairs_file}",
        "data.eval_size=0",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.plot=false",
        "run.save_final=false",
        f"run.seed={s['seed']}",
        f"dpo.pairs_per_step={s['pairs_per_step']}",
        f"dpo.beta={s['beta']}",
        "dpo.loss=sigmoid",
        f"train.lr={s['lr']}",
        "train.lr_schedule=constant",
        "train.epochs=1",
        "train.num_minibatches=1",
        f"train.micro_batch_size={2 * s['pairs_per_step']}",
        f"train.bf16={str(s['bf16']).lower()}",
        f"train.max_grad_norm={s['max_grad_norm']}",
        f"model.max_prompt_tokens={s['max_prompt_tokens']}",
        f"model.max_new_tokens={s['max_new_tokens']}",
    ]


def run_rayrlhf(pairs_file: Path, steps: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "cluster.cli", "train", "--run-dir", str(run_dir)]
    for o in _overrides(pairs_file, steps):
        cmd += ["--set", o]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "tool": "rayrlhf",
        "process_wall_s": wall,
        "steps": [
            {
                "step": r["step"],
                "step_s": r["time/learn_s"],
                "loss": r["loss/total"],
                "accuracy": r["rewards/accuracy"],
                "margin": r["rewards/margin"],
            }
            for r in rows
        ],
    }


def run_trl(python: str, spec_file: Path, model_path: str, out: Path) -> dict:
    t0 = time.perf_counter()
    subprocess.run(
        [
            python,
            str(ROOT / "benchmarks" / "trl_dpo.py"),
            "--pairs",
            str(spec_file),
            "--model",
            model_path,
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
    )
    res = json.loads(out.read_text())
    res["process_wall_s"] = time.perf_counter() - t0
    res["steps"] = [
        {
            "step": r["step"],
            "step_s": r["step_s"],
            "loss": float(r["loss"]),
            "accuracy": float(r.get("rewards/accuracies", "nan")),
            "margin": float(r.get("rewards/margins", "nan")),
        }
        for r in res["steps"]
    ]
    return res


def summarise(res: dict, pairs_per_step: int) -> dict:
    times = [s["step_s"] for s in res["steps"]]
    n = len(times)
    return {
        "steps": n,
        "train_s": sum(times),
        "pairs_per_s": pairs_per_step * n / sum(times),
        # Without the first step (one-off warm-ups of allocators and kernels).
        "pairs_per_s_steady": pairs_per_step * (n - 1) / sum(times[1:]) if n > 1 else None,
        "process_wall_s": res["process_wall_s"],
        "pairs_per_s_end_to_end": pairs_per_step * n / res["process_wall_s"],
        "loss_first": res["steps"][0]["loss"],
        "loss_last": res["steps"][-1]["loss"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1, help="rounds; the contenders alternate within each")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "vs_trl_dpo.json"))
    args = ap.parse_args()
    if not Path(args.trl_python).exists():
        print(f"no TRL environment at {args.trl_python}: run `make trl-env` first", file=sys.stderr)
        return 2
    from cluster.assets import resolve_model

    bf16 = SETTINGS["bf16"]
    s = dict(
        SETTINGS,
        steps=args.steps,
        max_length=SETTINGS["max_prompt_tokens"] + SETTINGS["max_new_tokens"],
        cpus=os.cpu_count(),
        precision="fp32 weights, bf16 autocast" if bf16 else "fp32",
        loss="sigmoid DPO",
        reference="computed once before training (both)",
    )
    model_path = resolve_model(s["model"])
    rounds = []
    with tempfile.TemporaryDirectory(prefix="vs_trl_dpo_") as tmp:
        tmp_path = Path(tmp)
        pairs_file = tmp_path / "pairs.jsonl"
        pairs_file.write_text(
            "".join(json.dumps(r) + "\n" for r in preference_rows(args.steps * s["pairs_per_step"] + 8, s["seed"]))
        )
        ordered = rayrlhf_order(pairs_file, args.steps)
        spec_file = tmp_path / "spec.json"
        spec_file.write_text(json.dumps({"settings": s, "pairs": ordered}))
        for i in range(args.repeats):
            order = ["rayrlhf", "trl"] if i % 2 == 0 else ["trl", "rayrlhf"]
            res = {}
            for name in order:
                print(
                    f"[vs_trl_dpo] round {i + 1}: {name}, {args.steps} steps x {s['pairs_per_step']} pairs", flush=True
                )
                res[name] = (
                    run_rayrlhf(pairs_file, args.steps, tmp_path / f"run{i}")
                    if name == "rayrlhf"
                    else run_trl(args.trl_python, spec_file, model_path, tmp_path / f"trl{i}.json")
                )
                res[name]["summary"] = summarise(res[name], s["pairs_per_step"])
            rounds.append(res)
    pick = lambda name, key: [r[name]["summary"][key] for r in rounds]  # noqa: E731
    ratios = {
        k: statistics.median(a / b for a, b in zip(pick("rayrlhf", k), pick("trl", k)))
        for k in ("pairs_per_s", "pairs_per_s_steady", "pairs_per_s_end_to_end")
    }
    losses = [(a["loss"], b["loss"]) for a, b in zip(rounds[0]["rayrlhf"]["steps"], rounds[0]["trl"]["steps"])]
    results = {
        "settings": s,
        "date": time.strftime("%Y-%m-%d"),
        "rounds": rounds,
        "ratios_median": ratios,
        "max_abs_loss_difference": max(abs(a - b) for a, b in losses),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(
        json.dumps(
            {
                "ratios_median": ratios,
                "max_abs_loss_difference": results["max_abs_loss_difference"],
                **{n: [r[n]["summary"] for r in rounds] for n in ("rayrlhf", "trl")},
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
