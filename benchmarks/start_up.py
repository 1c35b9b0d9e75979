"""A run's time to its first step with ``cluster.lighter_gc`` on (the default) and off.

Each contender is ``rayrlhf train configs/ppo_tiny.yaml`` (2 steps), in its own process as a
user runs it, joining one Ray head this script starts (token authentication, as the README's
cluster), so each run is a job of its own with its own setup hook; the two alternated A B A B
after one warm-up run (the head's first job starts Ray's detached helpers). "First step": the
moment the run's first step row reaches ``metrics.jsonl``, from the process's start (driver
imports, roles: generator, scorer, reference, Ray Train's controller and worker; first
generation and update). The run's start-up is CPU-bound on 2 cores: the roles start at once.

    .venv/bin/python benchmarks/start_up.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.conftest
MODES = {"default_gc": "false", "lighter_gc": "true"}


def start_head(temp: Path) -> tuple[dict, str]:
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    port = 6390 + secrets.randbelow(50)
    subprocess.run(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=8",
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return env, f"127.0.0.1:{port}"


def first_step(env: dict, address: str, mode: str, run_dir: Path) -> dict:
    from benchmarks.streaming_prompts import first_step_logged

    args = [
        str(Path(sys.executable).parent / "rayrlhf"),
        "train",
        str(ROOT / "configs" / "ppo_tiny.yaml"),
        "--run-dir",
        str(run_dir),
    ]
    for o in (
        f"cluster.address={address}",
        f"cluster.lighter_gc={MODES[mode]}",
        "run.steps=2",
        "run.plot=false",
        "cluster.metrics_export=false",
    ):
        args += ["--set", o]
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first, metrics = None, run_dir / "metrics.jsonl"
    while proc.poll() is None:
        if first is None and first_step_logged(metrics):
            first = time.perf_counter() - t0
        time.sleep(0.1)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: rayrlhf train exited {proc.returncode} ({run_dir / 'train.log'})")
    return {"mode": mode, "first_step_s": first, "process_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "start_up.json"))
    args = ap.parse_args()
    temp = Path(tempfile.mkdtemp(prefix="rrs-", dir="/tmp"))
    env, address = start_head(temp)
    runs = []
    try:
        first_step(env, address, "lighter_gc", temp / "warm-up")
        for k in range(args.repeats):
            for mode in MODES:
                runs.append(first_step(env, address, mode, temp / f"{mode}-{k}"))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        from tests.conftest import _stop_cluster  # this head only (`ray stop` would stop every cluster here)

        _stop_cluster(str(temp), int(address.rsplit(":", 1)[1]))
        shutil.rmtree(temp, ignore_errors=True)
    median = {
        m: {key: statistics.median(r[key] for r in runs if r["mode"] == m) for key in ("first_step_s", "process_s")}
        for m in MODES
    }
    result = {
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "runs": runs,
        "median": median,
        "ratio_lighter_over_default": {
            key: median["lighter_gc"][key] / median["default_gc"][key] for key in median["default_gc"]
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"median": median, "ratio": result["ratio_lighter_over_default"]}, indent=1))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


if __name__ == "__main__":
    main()
