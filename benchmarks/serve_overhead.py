"""Where the policy server's CPU goes, setting by setting: the bare vLLM server and the policy
server under Ray settings that change what Ray's own processes do while the engine serves.

Each contender is started alone (as in ``serve_throughput.py``'s ``alone`` layout), warmed up with
32 requests, then serves one round of 128 chat requests at concurrency 32 (64 tokens each, EOS
ignored: the same work for every contender). Around that round every process's CPU time is read
from ``/proc/<pid>/stat``, so a contender's cost shows by process (the engine's worker, its
EngineCore, the replica, Serve's proxy and controller, the GCS, ...), not only as throughput,
which drifts by ~10% between starts of the same server on a shared machine. On a CPU-bound
2-core machine throughput is tokens over half the CPU seconds of all processes, so the accounting
says which process a setting saves and what it costs the engine's OpenMP threads (every wake-up
of another process preempts one of them while the other waits at the next barrier).

Contenders (``--order``, comma-separated, repeated as given): ``bare``; ``policy`` (the server as
``rayrlhf serve policy`` starts it: ``serving.common.SERVER_CLUSTER_ENV``); ``default_loop``
(Serve's control loop at its default 0.1 s); ``export_1s`` (Serve's metrics export every 1 s
instead of 0.1 s); ``direct`` (Ray Serve's experimental direct ingress, the replica answering
HTTP on its own port without the proxy hop); ``passive`` and ``bare_passive`` (OpenMP threads that
sleep at a barrier, ``OMP_WAIT_POLICY=PASSIVE``, instead of spinning for the core another process
wants); ``spin_short`` (libgomp spins 10,000 rounds before sleeping, ``GOMP_SPINCOUNT``).

    .venv/bin/python benchmarks/serve_overhead.py [--order bare,policy,default_loop,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_throughput as st  # noqa: E402

#: Each contender: (the bare vLLM server?, environment added before it starts: for the policy
#: server on top of ``SERVER_CLUSTER_ENV``, inherited by its cluster's processes and the engine).
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}  # OpenMP threads sleep at a barrier instead of spinning
CONTENDERS: dict[str, tuple[bool, dict[str, str]]] = {
    "bare": (True, {}),
    "policy": (False, {}),
    "default_loop": (False, {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}),
    "export_1s": (False, {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}),
    "direct": (False, {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}),
    "passive": (False, PASSIVE),
    "bare_passive": (True, PASSIVE),
    "spin_short": (False, {"GOMP_SPINCOUNT": "10000"}),
}
#: Where a direct-ingress replica listens (Ray's default range starts at 30000).
DIRECT_PORTS = range(30000, 30010)


def cpu_seconds() -> dict[str, tuple[str, float]]:
    """pid -> (process name, user + system CPU seconds) of every process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            end = stat.rfind(")")
            fields = stat[end + 2 :].split()
            out[p.name] = (stat[stat.find("(") + 1 : end], (int(fields[11]) + int(fields[12])) / tick)
    return out


def by_process(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per process name between two ``cpu_seconds`` readings (names summed)."""
    spent: dict[str, float] = {}
    for pid, (name, t) in after.items():
        d = t - (before[pid][1] if pid in before else 0.0)
        if d > 0.01:
            spent[name] = round(spent.get(name, 0.0) + d, 2)
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def policy_url() -> str:
    """The direct-ingress replica's port when one answers, else the proxy's."""
    import httpx

    for port in DIRECT_PORTS:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {st.KEY}"}, timeout=3)
            return f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            continue
    return "http://127.0.0.1:18002"


def one_round(name: str, model: str, texts: list[str], args: argparse.Namespace) -> dict:
    (bare, env), saved = CONTENDERS[name], dict(os.environ)
    os.environ.update(env)
    try:
        with st.server(bare, model, args, 18001 if bare else 18002):
            st.wait_up("http://127.0.0.1:18001" if bare else "http://127.0.0.1:18002")
            url = "http://127.0.0.1:18001" if bare else policy_url()
            asyncio.run(st.load(url, "policy", texts[:32], 32, args.max_tokens))
            time.sleep(3)  # start-up's stragglers (the engine's first metrics, Serve's telemetry actor)
            before = cpu_seconds()
            run = asyncio.run(st.load(url, "policy", texts, 32, args.max_tokens))
            spent = by_process(before, cpu_seconds())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {
        "contender": name,
        "url": url,
        **{k: run[k] for k in ("tokens_per_s", "wall_s", "errors")},
        "cpu_s_all": round(sum(spent.values()), 2),
        "cpu_s": spent,
    }


def main() -> None:
    import logging

    from cluster.assets import resolve_model
    from learners.training.precision import resolve_engine_dtype

    logging.getLogger("httpx").setLevel(logging.WARNING)
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", default="bare,policy,default_loop,direct,direct,default_loop,policy,bare")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "serve_overhead.json"))
    args = ap.parse_args()
    args.max_model_len, args.dtype = 512, resolve_engine_dtype("auto", uses_gpu=False)
    model, texts = resolve_model("smollm2-135m"), st.prompts(128)
    rows = []
    for name in args.order.split(","):
        rows.append(one_round(name, model, texts, args))
        top = list(rows[-1]["cpu_s"].items())[:8]
        print(json.dumps({k: rows[-1][k] for k in ("contender", "tokens_per_s", "cpu_s_all")}), top, flush=True)
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
