"""Synchronous vs asynchronous GRPO step time on the same config, side by side in one run.

Both contenders run `rayrlhf train configs/grpo_smollm2.yaml` (SmolLM2-135M, 8 prompts x 4
samples, up to 48 new tokens, same seed, same prompts, same stopping rule), one after the other in
fresh processes on a local cluster: `rollout.max_staleness=0` (generate, then learn, then sync)
and `rollout.max_staleness=1` (the next batch is generated while the learner trains), the latter
also with `rollout.inflight_updates=true` (the weight sync lands in the running generation instead
of waiting for its end). The step
time is the wall time between two logged steps (median over the steps after the first). Next to
it: the ideal of perfect overlap, max(generate, learn) + the rest, from the synchronous run's own
phase medians.

    .venv/bin/python benchmarks/async_overlap.py [--steps 10] [--modes sync async async_inflight] [--out docs/results/async_overlap.json]
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


# Contender: (rollout.max_staleness, rollout.inflight_updates).
MODES = {"sync": (0, False), "async": (1, False), "async_inflight": (1, True)}


def run(mode: str, steps: int, out_dir: Path) -> list[dict]:
    rayrlhf = str(Path(sys.executable).parent / "rayrlhf")
    staleness, inflight = MODES[mode]
    name = mode
    cmd = [
        rayrlhf,
        "train",
        "configs/grpo_smollm2.yaml",
        "--run-dir",
        str(out_dir / name),
        "--set",
        f"rollout.max_staleness={staleness}",
        "--set",
        f"rollout.inflight_updates={str(inflight).lower()}",
        "--set",
        f"run.steps={steps}",
        "--set",
        "run.eval_every=0",
        "--set",
        "run.plot=false",
        "--set",
        "run.save_final=false",
    ]
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
        # Response tokens sampled by weights newer than their batch's oldest (a sync landed
        # mid-generation): in-flight updates only.
        "tokens_newer_frac": _newer_frac(rows),
    }


def _newer_frac(rows: list[dict]) -> float:
    newer = total = 0
    for r in rows:
        counts = {int(k): v for k, v in r.get("generate/tokens_by_version", {}).items()}
        if counts:
            total += sum(counts.values())
            newer += sum(v for k, v in counts.items() if k > min(counts))
    return newer / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "async_overlap.json"))
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    a = ap.parse_args()
    if a.modes[:2] != ["sync", "async"]:
        ap.error("--modes must start with sync async (the ratios are against them)")
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        results = {m: summarize(run(m, a.steps, Path(tmp))) for m in a.modes}
    sync, async_ = results["sync"], results["async"]
    rest = sync["step_s_median"] - sync["generate_s_median"] - sync["learn_s_median"]
    ideal = max(sync["generate_s_median"], sync["learn_s_median"]) + rest
    out = {
        "config": "configs/grpo_smollm2.yaml",
        "steps": a.steps,
        "cpus": os.cpu_count(),
        "sync": sync,
        "async_staleness_1": async_,
        "speedup": sync["step_s_median"] / async_["step_s_median"],
        **(
            {
                "async_staleness_1_inflight": results["async_inflight"],
                "speedup_inflight": sync["step_s_median"] / results["async_inflight"]["step_s_median"],
            }
            if "async_inflight" in results
            else {}
        ),
        "ideal_step_s": ideal,
        "ideal_speedup": sync["step_s_median"] / ideal,
        "ideal_ratio_max_over_sum": max(sync["generate_s_median"], sync["learn_s_median"])
        / (sync["generate_s_median"] + sync["learn_s_median"]),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=1))
    print(
        f"sync {sync['step_s_median']:.2f}s/step, async {async_['step_s_median']:.2f}s/step, "
        f"ideal {ideal:.2f}s; wrote {a.out}"
    )


if __name__ == "__main__":
    main()
