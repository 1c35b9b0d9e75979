"""The calculator preset's held-out accuracy: the base model without tools, the base model with
the calculator, after the SFT stage and after multi-turn GRPO (configs/calculator_smollm2.yaml).

Every model answers the same held-out prompts (the run's own held-out split), greedily, with the
same checker (reward.function on the final answer). "With tools" runs the tool_use environment
(the model may call the calculator before it answers: the run's env settings); "without" asks
the question once, single turn. Each evaluation runs in its own process (one vLLM engine each).

    .venv/bin/python benchmarks/calculator.py [--run-dir DIR] [--out docs/results/calculator.json]

Without --run-dir it trains the preset first (about 20-30 minutes on 2 cores); with it, a finished
run of the preset is evaluated as it is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "calculator_smollm2.yaml"


def load_cfg(config: str, overrides: list[str]):
    from cluster.config.loading import load_config

    return load_config(config, overrides)


def held_out_rows(cfg) -> list[dict]:
    from actors.data.tasks import load_prompts

    _, eval_set = load_prompts(
        cfg.data.task,
        cfg.data.train_size,
        cfg.data.eval_size,
        cfg.run.seed,
        cfg.data.task_kwargs,
        cfg.data.instruction_for(cfg.data.task),
    )
    return eval_set.rows


def evaluate(cfg, model_path: str, tools: bool) -> dict:
    """Greedy held-out accuracy of one model, with the run's tool_use environment or single turn.
    A dropped episode counts as wrong (the denominator is every held-out prompt)."""
    from dataclasses import replace

    from actors.agents.environments import environment_factory
    from actors.rollout.generator import Generator
    from actors.rewards.scorer import Scorer
    from cluster.config.role_settings import generator_config

    rows = held_out_rows(cfg)
    gcfg = generator_config(cfg, model_path)
    if not tools:
        gcfg = replace(gcfg, environment=None, episode_limits=None)
    gen = Generator.from_config(gcfg)
    t0 = time.perf_counter()
    if tools:
        exp, counts = gen.generate_episodes(
            rows,
            list(range(len(rows))),
            environment_factory(gcfg.environment),
            gcfg.episode_limits,
            temperature=0.0,
            n=1,
        )
        scores = [float(m["episode"]["reward"]) for m in exp.meta]
        used = [sum((m["episode"].get("tool_calls") or {}).values()) > 0 for m in exp.meta]
        extra = {"episodes": counts, "tool_use_rate": sum(used) / max(len(rows), 1)}
    else:
        exp = gen.generate(
            [r["prompt"] for r in rows],
            [r["meta"] for r in rows],
            list(range(len(rows))),
            max_new_tokens=gcfg.max_new_tokens,
            max_prompt_tokens=gcfg.max_prompt_tokens,
            temperature=0.0,
            n=1,
        )
        values, _ = Scorer(cfg.reward.function, cfg.reward.kwargs).score_texts(
            [m["prompt"] for m in exp.meta], exp.completions, exp.meta
        )
        scores, extra = [v or 0.0 for v in values], {}
    return {
        "accuracy": sum(1.0 for s in scores if s >= 1.0) / max(len(rows), 1),
        "n": len(rows),
        "seconds": time.perf_counter() - t0,
        "example": exp.completions[0] if exp.completions else "",
        **extra,
    }


def stage_checkpoint(run_dir: Path, stage: str) -> Path:
    """A stage's final checkpoint: the model folder in its last checkpoint directory."""
    folders = sorted((run_dir / "stages").glob(f"*-{stage}"))
    if not folders:
        raise SystemExit(f"{run_dir}: no stage {stage!r} (stages: {[p.name for p in (run_dir / 'stages').glob('*')]})")
    ckpts = sorted((folders[-1] / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[-1]))
    if not ckpts:
        raise SystemExit(f"{folders[-1]}: no checkpoint (did the stage finish?)")
    return ckpts[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--run-dir", help="a finished run of the preset (default: train one)")
    ap.add_argument("--set", action="append", default=[], help="config override for the run and the evaluations")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "calculator.json"))
    ap.add_argument("--eval", nargs=2, metavar=("MODEL", "TOOLS"), help=argparse.SUPPRESS)  # one evaluation (child)
    args = ap.parse_args()
    cfg = load_cfg(args.config, args.set)
    if args.eval:
        print("RESULT " + json.dumps(evaluate(cfg, args.eval[0], args.eval[1] == "tools")), flush=True)
        return
    run_dir = Path(args.run_dir) if args.run_dir else ROOT / "runs" / f"calculator-bench-{int(time.time())}"
    train_s = None
    if not args.run_dir:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "cluster.cli", "train", args.config, "--run-dir", str(run_dir)]
        subprocess.run(cmd + [x for s in args.set for x in ("--set", s)], cwd=ROOT, check=True)
        train_s = time.perf_counter() - t0
    from cluster.assets import resolve_model

    base = resolve_model(cfg.model.path)
    models = {
        "base": base,
        "sft": str(stage_checkpoint(run_dir, "sft")),
        "grpo": str(stage_checkpoint(run_dir, "grpo")),
    }
    plan = [("base", "no_tools"), ("base", "tools"), ("sft", "tools"), ("grpo", "tools"), ("grpo", "no_tools")]
    results = {}
    for name, tools in plan:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--config",
                args.config,
                *[x for s in args.set for x in ("--set", s)],
                "--eval",
                models[name],
                tools,
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
        results[f"{name}_{tools}"] = json.loads(line[len("RESULT ") :])
        print(f"{name:5s} {tools:8s} accuracy {results[f'{name}_{tools}']['accuracy']:.3f}", flush=True)
    base_acc = results["base_no_tools"]["accuracy"]
    summary = {
        "config": str(Path(args.config).relative_to(ROOT)) if Path(args.config).is_relative_to(ROOT) else args.config,
        "overrides": args.set,
        "run_dir": str(run_dir),
        "train_seconds": train_s,
        "task": cfg.data.task,
        "task_kwargs": cfg.data.task_kwargs,
        "held_out": len(held_out_rows(cfg)),
        "results": results,
        "rl_over_base_no_tools": results["grpo_tools"]["accuracy"] / base_acc if base_acc else None,
        "rl_minus_sft": results["grpo_tools"]["accuracy"] - results["sft_tools"]["accuracy"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
