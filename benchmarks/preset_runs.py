"""Running a preset as a user does (``rayrlhf train`` in its own process) and reading what a
benchmark compares from its ``metrics.jsonl``: held-out accuracy per evaluation, train reward
and response length per step, median step time. Shared by the benchmarks that compare presets
or settings side by side (``distill.py``, ``objectives.py``)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(config: str, run_dir: Path, overrides: list[str]) -> dict:
    """Runs ``configs/<config>`` with ``--set`` overrides into ``run_dir``; its figures."""
    args = [str(ROOT / ".venv" / "bin" / "rayrlhf"), "train", str(ROOT / "configs" / config), "--run-dir", str(run_dir)]
    for o in overrides:
        args += ["--set", o]
    t0 = time.perf_counter()
    subprocess.run(args, check=True, cwd=ROOT)
    return {"config": config, "overrides": overrides, "seconds": time.perf_counter() - t0, **summary(run_dir)}


def summary(run_dir: Path) -> dict:
    """A finished run's figures from its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = sorted(r["time/step_s"] for r in rows if r["step"] > 0 and "time/step_s" in r)
    return {
        "run_dir": str(run_dir),
        "eval_accuracy": {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r},
        "eval_sampled_reward": {r["step"]: r["eval/sampled_reward"] for r in rows if "eval/sampled_reward" in r},
        "train_reward": [r.get("reward/mean") for r in rows if r["step"] > 0],
        "response_length": [r.get("response/length_mean") for r in rows if r["step"] > 0],
        "median_step_s": steps[len(steps) // 2] if steps else None,
    }
