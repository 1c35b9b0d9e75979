"""The python tool's cost per call, sandboxed (bubblewrap, ``actors/agents/sandbox.py``) against the
former unsandboxed subprocess (``env.python_sandbox: unsafe``), side by side in one run: the
latency of one call at a time (median and p99 of ``--calls``), and the throughput with
``--parallel`` calls at once (calls/s), for the same small program. Contenders alternate round
by round.

    .venv/bin/python benchmarks/tool_sandbox.py [--calls 100] [--parallel 8] [--out docs/results/tool_sandbox.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CODE = "total = sum(i * i for i in range(10000))\nprint(total)"


def main() -> None:
    from actors.agents.tools import run_python

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    expected = f"{sum(i * i for i in range(10000))}\n"
    modes = ["bwrap", "unsafe"]
    latency: dict[str, list[float]] = {m: [] for m in modes}
    throughput: dict[str, list[float]] = {m: [] for m in modes}

    def one(mode: str) -> float:
        t0 = time.perf_counter()
        assert run_python(CODE, mode=mode) == expected
        return time.perf_counter() - t0

    for m in modes:
        one(m)  # warm-up: the probe, the seccomp program, page cache
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            latency[mode] += [one(mode) for _ in range(args.calls // args.rounds)]
            with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda _: one(mode), range(args.calls)))
                throughput[mode].append(args.calls / (time.perf_counter() - t0))
            print(
                f"round {r} {mode}: p50 {statistics.median(latency[mode]) * 1e3:.1f} ms, "
                f"{throughput[mode][-1]:.1f} calls/s at {args.parallel}",
                flush=True,
            )
    result = {
        "calls": args.calls,
        "parallel": args.parallel,
        "rounds": args.rounds,
        "latency_ms": {
            m: {"p50": statistics.median(v) * 1e3, "p99": sorted(v)[int(0.99 * (len(v) - 1))] * 1e3}
            for m, v in latency.items()
        },
        "calls_per_s": {m: statistics.median(v) for m, v in throughput.items()},
    }
    result["ratios"] = {
        "latency_p50_bwrap_over_unsafe": result["latency_ms"]["bwrap"]["p50"] / result["latency_ms"]["unsafe"]["p50"],
        "throughput_bwrap_over_unsafe": result["calls_per_s"]["bwrap"] / result["calls_per_s"]["unsafe"],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
