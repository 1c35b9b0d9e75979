"""End to end against TRL: rayrlhf GRPO and TRL's GRPOTrainer on the same workload, one run.

Same model (SmolLM2-135M-Instruct, fp32 master weights, bf16 autocast where the CPU computes bf16 natively, fp32 elsewhere), task (reasoning-gym
basic_arithmetic, easy setting), prompts in the same order, prompts per step, samples per prompt,
completion length, sampling (temperature 1, no top-k/top-p), reward function, loss (token mean
over the batch, group-std advantages, clip 0.2, beta 0), optimiser (AdamW, constant lr, clip 1.0)
and one on-policy update per batch. Each tool runs in its own process, one after the other, on
an otherwise idle machine. Afterwards both trained policies (and the base model) get the same
held-out greedy evaluation.

    make trl-env                      # once: .venv-trl with TRL (kept apart from the project's venv)
    .venv/bin/python benchmarks/vs_trl.py [--steps 10] [--out docs/results/vs_trl.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "grpo_smollm2.yaml"


def load_cfg(steps: int, seed: int, sets: tuple[str, ...] = (), config: Path = CONFIG):
    from cluster.config.loading import load_config

    return load_config(
        str(config), [f"run.steps={steps}", f"run.seed={seed}", "run.eval_every=0", "run.plot=false", *sets]
    )


def schedule(cfg) -> tuple[list[list[dict]], list[dict]]:
    """The prompts (or an environment's own rows) rayrlhf's driver will draw, step by step (same
    loader, sampler and seed), and the held-out rows."""
    from cluster.data.sources import load_task_prompts
    from cluster.data.prompts import PromptSampler

    train_set, eval_set, _ = load_task_prompts(cfg)
    sampler = PromptSampler(len(train_set.rows), cfg.rollout.prompts_per_step, cfg.run.seed)
    return [[train_set.rows[i] for i in sampler.next()] for _ in range(cfg.run.steps)], eval_set.rows


def run_rayrlhf(cfg, run_dir: Path, extra: tuple[str, ...] = (), config: Path = CONFIG) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "train",
        str(config),
        "--run-dir",
        str(run_dir),
        "--set",
        f"run.steps={cfg.run.steps}",
        "--set",
        f"run.seed={cfg.run.seed}",
        "--set",
        "run.eval_every=0",
        "--set",
        "run.plot=false",
    ]
    for override in extra:
        cmd += ["--set", override]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]  # training steps (not evaluation rows)
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    return {
        "tool": "rayrlhf",
        "process_wall_s": wall,
        "steps": [
            {
                "step": r["step"],
                "step_s": r["time/step_s"],
                "reward": r["reward/mean"],
                "length": r.get("response/length_mean"),
                "truncated_frac": r.get("response/truncated_frac"),
                "turns_mean": r.get("episode/turns_mean"),
                "learner_compute_s": r.get("learner/prep_s", 0.0) + r.get("learner/update_s", 0.0),
                "prefix_shared_frac": r.get("learner/prefix_shared_frac"),
                "zero_advantage_rows": r.get("learner/zero_advantage_rows"),
                "phases": {
                    k.split("/")[1][:-2]: r[k]
                    for k in r
                    if k.startswith("time/") and k.endswith("_s") and k not in ("time/step_s", "time/elapsed_s")
                },
            }
            for r in rows
        ],
        "checkpoint": str(ckpts[-1]),
    }


def run_trl(
    python: str,
    prompts_file: Path,
    model_path: str,
    out: Path,
    save: Path,
    generation: str,
    env: dict | None = None,
    prefix: tuple[str, ...] = (),
) -> dict:
    cmd = [
        *prefix,
        python,
        str(ROOT / "benchmarks" / "trl_grpo.py"),
        "--prompts",
        str(prompts_file),
        "--model",
        model_path,
        "--out",
        str(out),
        "--save",
        str(save),
        "--generation",
        generation,
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)
    wall = time.perf_counter() - t0
    res = json.loads(out.read_text())
    res["process_wall_s"] = wall
    res["steps"] = [
        {
            "step": r["step"],
            "step_s": r["step_s"],
            "reward": float(r["reward"]),
            "length": float(r["completions/mean_length"]),
            "truncated_frac": float(r["completions/clipped_ratio"]),
        }
        for r in res["steps"]
    ]
    res["checkpoint"] = str(save)
    return res


def greedy_accuracy(model_dir: str, rows: list[dict], max_new_tokens: int, bf16: bool = True) -> float:
    """The same evaluator for every policy: transformers greedy decoding (bf16 weights, or fp32 where
    the machine has no native bf16), chat template, the task's checker on the extracted answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.rewards.functions import reasoning_gym

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32).eval()
    chats = [
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    batch = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
    texts = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    meta = {k: [r["meta"][k] for r in rows] for k in ("task", "task_kwargs", "entry")}
    scores = reasoning_gym([r["prompt"] for r in rows], texts, **meta)
    return sum(s >= 1 for s in scores) / len(scores)


def summarise(res: dict, completions_per_step: int) -> dict:
    steps = res["steps"]
    times = [s["step_s"] for s in steps]
    rewards = [s["reward"] for s in steps]
    half = len(steps) // 2
    return {
        "median_step_s": statistics.median(times),
        "median_step_s_after_first": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "completions_per_s": completions_per_step * len(steps) / sum(times),
        # Steady state: without the first two steps (one-off warm-ups of engines and kernels).
        "completions_per_s_steady": completions_per_step * len(times[2:]) / sum(times[2:]) if len(times) > 2 else None,
        "train_loop_s": sum(times),
        "process_wall_s": res["process_wall_s"],
        "reward_mean_all": statistics.fmean(rewards),
        "reward_mean_first_half": statistics.fmean(rewards[:half]) if half else rewards[0],
        "reward_mean_second_half": statistics.fmean(rewards[half:]),
        "response_length_mean": statistics.fmean(s["length"] for s in steps),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    per = results["settings"]["prompts_per_step"] * results["settings"]["samples_per_prompt"]
    for name in [n for n in results if isinstance(results[n], dict) and "summary" in results[n]]:
        steps = results[name]["steps"]
        seen = [s["step"] * per for s in steps]
        a.plot(seen, [s["reward"] for s in steps], marker="o", label=name)
        b.bar(name, results[name]["summary"]["completions_per_s"])
    a.set_xlabel("completions sampled")
    a.set_ylabel("mean train reward of the step")
    a.set_title("reward per sample (same prompts)")
    a.legend()
    b.tick_params(axis="x", labelrotation=25)
    b.set_ylabel("completions / s")
    b.set_title(f"throughput, {per} completions per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    ap.add_argument(
        "--trl-generation",
        default="generate",
        choices=["generate", "continuous_batching", "vllm_colocate"],
        help="TRL's generation: transformers generate (default), its continuous batching, or its vLLM "
        "colocate mode (then --trl-python .venv-trl-vllm/bin/python, built by make trl-vllm-env)",
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "vs_trl.json"))
    ap.add_argument("--skip-eval", action="store_true", help="no held-out greedy evaluation of the policies")
    ap.add_argument(
        "--trl-keep-freed-memory",
        action="store_true",
        help="also run TRL a second time with the glibc settings rayrlhf's CPU learners start with "
        "(cluster.keep_freed_memory): the ratio against TRL given the same allocator",
    )
    ap.add_argument(
        "--rayrlhf-compiled",
        action="store_true",
        help="also run rayrlhf a second time with rollout.compile=true (vLLM compiled: faster steps, "
        "a one-off compile at start-up, counted in its process wall clock)",
    )
    ap.add_argument(
        "--compile-learner",
        action="store_true",
        help="with --rayrlhf-compiled: that run also sets train.compile=true (the learners' decoder "
        "layers compiled; the compile is in its first step)",
    )
    ap.add_argument(
        "--realtime",
        action="store_true",
        help="also run rayrlhf with cluster.realtime_learners=true (its learner's updates under "
        "SCHED_FIFO) and TRL's whole process under the same policy (chrt -f 1): each tool "
        "given the same scheduling privilege. Needs root or CAP_SYS_NICE",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
        help="also run rayrlhf as `rayrlhf_NAME` with these config overrides (repeatable), e.g. "
        "--variant compiled_realtime:rollout.compile=true,train.compile=true,"
        "cluster.realtime_learners=true",
    )
    args = ap.parse_args()
    variants = []
    for spec in args.variant:
        name, _, sets = spec.partition(":")
        if not name.isidentifier() or "=" not in sets:
            ap.error(f"--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        variants.append((f"rayrlhf_{name}", tuple(sets.split(","))))
    if args.realtime:
        variants.insert(0, ("rayrlhf_realtime", ("cluster.realtime_learners=true",)))
    if not Path(args.trl_python).exists():
        print(f"no TRL environment at {args.trl_python}: run `make trl-env` first", file=sys.stderr)
        return 2

    from cluster.assets import resolve_model

    from learners.training.precision import resolve_bf16

    cfg = load_cfg(args.steps, args.seed)
    model_path = resolve_model(cfg.model.path, cfg.model.cache_dir or None)
    steps, eval_rows = schedule(cfg)
    # Both tools compute in what the preset's `auto` gives this machine: bf16 autocast where the
    # CPU multiplies bf16 natively, fp32 where bf16 would be emulated (learners/training/precision.py).
    bf16 = resolve_bf16(cfg.train.bf16, "cpu")
    settings = {
        "model": cfg.model.path,
        "task": cfg.data.task,
        "task_kwargs": cfg.data.task_kwargs,
        "seed": cfg.run.seed,
        "steps": cfg.run.steps,
        "prompts_per_step": cfg.rollout.prompts_per_step,
        "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_new_tokens": cfg.model.max_new_tokens,
        "max_prompt_tokens": cfg.model.max_prompt_tokens,
        "temperature": cfg.rollout.temperature,
        "lr": cfg.train.lr,
        "max_grad_norm": cfg.train.max_grad_norm,
        "clip_eps": cfg.ppo.clip_eps,
        "beta": cfg.ppo.kl_coef,
        "loss": "token mean over the batch (TRL: dapo)",
        "advantages": "group mean / std (TRL: scale_rewards=group)",
        "precision": "fp32 weights, bf16 autocast" if bf16 else "fp32",
        "bf16": bf16,
        "generator_dtype": cfg.model.generator_dtype,
        "cpus": os.cpu_count(),
        "zero_advantage_rows": "rayrlhf runs no pass for rows whose advantage is 0 (ppo.skip_zero_advantage, "
        "default on: the same loss and gradient); TRL runs them",
    }
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    results: dict = {"settings": settings, "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        tmp_path = Path(tmp)
        prompts_file = tmp_path / "prompts.json"
        prompts_file.write_text(json.dumps({"settings": settings, "steps": steps}))
        print(f"[vs_trl] rayrlhf GRPO: {cfg.run.steps} steps x {per_step} completions", flush=True)
        results["rayrlhf"] = run_rayrlhf(cfg, tmp_path / "rayrlhf_run", (f"train.bf16={str(bf16).lower()}",))
        print(f"[vs_trl] TRL GRPOTrainer ({args.trl_generation}): same workload", flush=True)
        results["trl"] = run_trl(
            args.trl_python,
            prompts_file,
            model_path,
            tmp_path / "trl.json",
            tmp_path / "trl_model",
            args.trl_generation,
        )
        tools = ["rayrlhf", "trl"]
        if args.trl_keep_freed_memory:
            from cluster.config.role_settings import KEEP_FREED_MEMORY_ENV

            print("[vs_trl] TRL GRPOTrainer again, with rayrlhf's malloc settings", flush=True)
            results["trl_keep_freed_memory"] = run_trl(
                args.trl_python,
                prompts_file,
                model_path,
                tmp_path / "trl_keep.json",
                tmp_path / "trl_keep_model",
                args.trl_generation,
                env={**os.environ, **KEEP_FREED_MEMORY_ENV},
            )
            tools.append("trl_keep_freed_memory")
        if args.rayrlhf_compiled:
            sets = ("rollout.compile=true",) + (("train.compile=true",) if args.compile_learner else ())
            print(f"[vs_trl] rayrlhf GRPO again, with {' '.join(sets)}", flush=True)
            results["rayrlhf_compiled"] = run_rayrlhf(
                cfg, tmp_path / "rayrlhf_compiled_run", sets + (f"train.bf16={str(bf16).lower()}",)
            )
            results["rayrlhf_compiled"]["sets"] = list(sets)
            tools.append("rayrlhf_compiled")
        if args.realtime:
            print("[vs_trl] TRL GRPOTrainer again, under chrt -f 1 (SCHED_FIFO, priority 1)", flush=True)
            results["trl_realtime"] = run_trl(
                args.trl_python,
                prompts_file,
                model_path,
                tmp_path / "trl_rt.json",
                tmp_path / "trl_rt_model",
                args.trl_generation,
                prefix=("chrt", "-f", "1"),
            )
            tools.append("trl_realtime")
        for name, sets in variants:
            print(f"[vs_trl] rayrlhf GRPO again ({name}), with {' '.join(sets)}", flush=True)
            results[name] = run_rayrlhf(cfg, tmp_path / f"{name}_run", sets + (f"train.bf16={str(bf16).lower()}",))
            results[name]["sets"] = list(sets)
            tools.append(name)
        for name in tools:
            results[name]["summary"] = summarise(results[name], per_step)
        if not args.skip_eval:
            policies = [("base", model_path)] + [(n, results[n]["checkpoint"]) for n in tools]
            results["heldout_greedy_accuracy"] = {
                name: greedy_accuracy(path, eval_rows, cfg.model.max_new_tokens, bf16) for name, path in policies
            }
        for name in tools:
            results[name].pop("checkpoint")
    r, t = results["rayrlhf"]["summary"], results["trl"]["summary"]
    results["ratios"] = {
        "completions_per_s": r["completions_per_s"] / t["completions_per_s"],
        "completions_per_s_steady": (
            r["completions_per_s_steady"] / t["completions_per_s_steady"] if r["completions_per_s_steady"] else None
        ),
        "median_step_s": t["median_step_s"] / r["median_step_s"],
    }
    if "trl_keep_freed_memory" in results:
        k = results["trl_keep_freed_memory"]["summary"]
        results["ratios"]["median_step_s_vs_trl_keep_freed_memory"] = k["median_step_s"] / r["median_step_s"]
    if "rayrlhf_compiled" in results:
        c = results["rayrlhf_compiled"]["summary"]
        results["ratios"]["compiled_median_step_s"] = t["median_step_s"] / c["median_step_s"]
        results["ratios"]["compiled_completions_per_s"] = c["completions_per_s"] / t["completions_per_s"]
        results["ratios"]["compiled_process_wall_s"] = t["process_wall_s"] / c["process_wall_s"]
    for name, _ in variants:
        v = results[name]["summary"]
        results["ratios"][f"{name}_median_step_s"] = t["median_step_s"] / v["median_step_s"]
        results["ratios"][f"{name}_completions_per_s"] = v["completions_per_s"] / t["completions_per_s"]
        if "trl_realtime" in results:  # against TRL given the same scheduling privilege
            trt = results["trl_realtime"]["summary"]
            results["ratios"][f"{name}_median_step_s_vs_trl_realtime"] = trt["median_step_s"] / v["median_step_s"]
            results["ratios"][f"{name}_completions_per_s_vs_trl_realtime"] = (
                v["completions_per_s"] / trt["completions_per_s"]
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(
        json.dumps(
            {k: results[k] for k in ("ratios",)}
            | {n: results[n]["summary"] for n in tools}
            | {"heldout_greedy_accuracy": results.get("heldout_greedy_accuracy")},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
