"""Synchronous vs asynchronous GRPO step time on the same config, side by side in one run.

Both contenders run `rayrlhf train configs/grpo_smollm2.yaml` (SmolLM2-135M, 8 prompts x 4
samples, up to 48 new tokens, same seed, same prompts, same stopping rule), one after the other in
fresh processes on a local cluster: `rollout.max_staleness=0` (generate, then learn, then sync)
and `rollout.max_staleness=1` (the next batch is generated while the learner trains). The step
time is the wall time between two logged steps (median over the steps after the first). Next to
it: the ideal of perfect overlap, max(generate, learn) + the rest, from the synchronous run's own
phase medians.

    .venv/bin/python benchmarks/async_overlap.py [--steps 10] [--out docs/results/async_overlap.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(staleness: int, steps: int, out_dir: Path) -> list[dict]:
    rayrlhf = str(Path(sys.executable).parent / "rayrlhf")
    name = f"stale{staleness}"
    cmd = [rayrlhf, "train", "configs/grpo_smollm2.yaml", "--run-dir", str(out_dir / name),
           "--set", f"rollout.max_staleness={staleness}", "--set", f"run.steps={steps}", "--set", "run.eval_every=0",
           "--set", "run.plot=false", "--set", "run.save_final=false"]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(rows: list[dict]) -> dict:
    rows = [r for r in rows if r["step"] > 0]
    elapsed = [r["time/elapsed_s"] for r in rows]
    step_s = [b - a for a, b in zip(elapsed, elapsed[1:])]  # the first step includes warm-up
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows[1:])  # noqa: E731
    return {
        "step_s_median": statistics.median(step_s),
        "step_s": step_s,
        "generate_s_median": med("time/generate_s"),
        "learn_s_median": med("time/learn_s"),
        "score_s_median": med("time/score_s"),
        "sync_s_median": med("time/sync_s"),
        "staleness": sorted({r["policy/staleness"] for r in rows}),
        "reward_mean_last3": statistics.mean(r["reward/mean"] for r in rows[-3:]),
        "tokens_per_step": statistics.median(r["generate/tokens"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "async_overlap.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        results = {s: summarize(run(s, a.steps, Path(tmp))) for s in (0, 1)}
    sync, async_ = results[0], results[1]
    rest = sync["step_s_median"] - sync["generate_s_median"] - sync["learn_s_median"]
    ideal = max(sync["generate_s_median"], sync["learn_s_median"]) + rest
    out = {
        "config": "configs/grpo_smollm2.yaml", "steps": a.steps, "cpus": os.cpu_count(),
        "sync": sync, "async_staleness_1": async_,
        "speedup": sync["step_s_median"] / async_["step_s_median"],
        "ideal_step_s": ideal, "ideal_speedup": sync["step_s_median"] / ideal,
        "ideal_ratio_max_over_sum": max(sync["generate_s_median"], sync["learn_s_median"])
        / (sync["generate_s_median"] + sync["learn_s_median"]),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("sync", "async_staleness_1")}, indent=1))
    print(f"sync {sync['step_s_median']:.2f}s/step, async {async_['step_s_median']:.2f}s/step, "
          f"ideal {ideal:.2f}s; wrote {a.out}")


if __name__ == "__main__":
    main()
