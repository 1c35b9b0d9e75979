"""Time to the first step, and the driver's peak memory, with a large Parquet prompt file: read
whole (``data.streaming=false``, the default) vs streamed with Ray Data (``data.streaming=true``).

Each contender is ``rayrlhf train configs/ppo_tiny.yaml`` on the same file (``--rows`` rows,
1 million by default, written once under ``--workdir``; never committed), one step, in its own
process as a user runs it, the two alternated A B A B. "First step" is the moment the run's first
step row reaches ``metrics.jsonl``, from the process's start: cluster start, data loading, roles,
the first generation and update. Peak memory: the largest resident set of the ``rayrlhf``
process (the driver, which holds the prompts), polled every 0.2 s.

    .venv/bin/python benchmarks/streaming_prompts.py [--rows 1000000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
MODES = {"whole": "false", "streamed": "true"}


def write_prompts(path: Path, rows: int) -> None:
    """``rows`` addition prompts with their answers, in row groups of 64k."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.is_file() and pq.ParquetFile(path).metadata.num_rows == rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    chunk = 1 << 16
    with pq.ParquetWriter(path, pa.schema([("prompt", pa.string()), ("answer", pa.string())])) as w:
        for start in range(0, rows, chunk):
            ids = range(start, min(rows, start + chunk))
            w.write_table(
                pa.table(
                    {
                        "prompt": [f"What is {i % 997} + {i // 997}?" for i in ids],
                        "answer": [str(i % 997 + i // 997) for i in ids],
                    }
                )
            )


def first_step_logged(metrics: Path) -> bool:
    """Whether a run's ``metrics.jsonl`` holds its first step's row yet."""
    if not metrics.is_file():
        return False
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return any(r.get("step", 0) >= 1 for r in rows)


def first_step(data: Path, mode: str, run_dir: Path) -> dict:
    args = [
        str(ROOT / ".venv" / "bin" / "rayrlhf"),
        "train",
        str(ROOT / "configs" / "ppo_tiny.yaml"),
        "--run-dir",
        str(run_dir),
    ]
    for o in (
        f"data.task={data}",
        f"data.streaming={MODES[mode]}",
        "data.instruction=",
        "run.steps=1",
        "run.plot=false",
        "cluster.metrics_export=false",
    ):
        args += ["--set", o]
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ps, peak, first = psutil.Process(proc.pid), 0, None
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.Error:
            pass
        if first is None and first_step_logged(metrics):
            first = time.perf_counter() - t0
        time.sleep(0.2)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: rayrlhf train exited {proc.returncode} ({run_dir / 'train.log'})")
    return {
        "mode": mode,
        "first_step_s": first,
        "process_s": time.perf_counter() - t0,
        "driver_peak_rss_mib": peak / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/rayrlhf_streaming_bench")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "streaming_prompts.json"))
    args = ap.parse_args()
    work = Path(args.workdir)
    data = work / f"prompts_{args.rows}.parquet"
    write_prompts(data, args.rows)
    runs = []
    for k in range(args.repeats):
        for mode in MODES:
            runs.append(first_step(data, mode, work / f"{mode}-{k}"))
            print(json.dumps(runs[-1]), flush=True)
    median = {
        m: {
            key: statistics.median(r[key] for r in runs if r["mode"] == m)
            for key in ("first_step_s", "process_s", "driver_peak_rss_mib")
        }
        for m in MODES
    }
    result = {
        "rows": args.rows,
        "file_mib": data.stat().st_size / 2**20,
        "runs": runs,
        "median": median,
        "ratio_streamed_over_whole": {key: median["streamed"][key] / median["whole"][key] for key in median["whole"]},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"median": median, "ratio": result["ratio_streamed_over_whole"]}, indent=1))


if __name__ == "__main__":
    main()
