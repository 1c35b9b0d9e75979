"""Agent rollout throughput by client, side by side in one run on one engine (rayrlhf's
Generator and its agent endpoint), and an OpenEnv environment over WebSocket sessions against
the same environment in-process.

Agent programs (every contender plays the same episodes: ``--episodes`` episodes of ``--turns``
chat turns of up to ``--new-tokens`` tokens, the same prompts, the same seeded sampling, so
the same tokens; only the client differs):

- ``threads_chat`` / ``threads_chat_stream``: a plain function per episode on a thread
  (``env.workers`` of them), the sync ``openai`` client, chat completions, not streamed / streamed;
- ``async_chat`` / ``async_chat_stream``: an ``async def`` program, all episodes on one event loop,
  ``AsyncOpenAI``;
- ``async_responses`` / ``async_responses_stream``: the same through the Responses API.

OpenEnv (``--openenv``): ``openenv_ws``, the three-turn environment of the tests served by
``openenv-core``'s ``create_app`` in a process of its own, one WebSocket session per episode;
``openenv_local``, the same class run in the generator's process.

Result: episodes per second per contender (median of ``--repeats`` rounds, the order reversed
every other round), the tokens each sampled (equal when the work is), and the ratios.

    .venv/bin/python benchmarks/agent_clients.py [--model smollm2-135m|tiny] [--episodes 32]
        [--turns 3] [--new-tokens 32] [--repeats 3] [--openenv] [--out docs/results/agent_clients.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TURNS, NEW_TOKENS = 3, 32


def _messages(row: dict, replies: list[str]) -> list[dict]:
    out = [{"role": "user", "content": row["prompt"]}]
    for k, r in enumerate(replies):
        out += [{"role": "assistant", "content": r}, {"role": "user", "content": f"Turn {k + 2}: go on."}]
    return out


def threads_chat(row: dict, base_url: str, stream: bool = False) -> float:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    replies: list[str] = []
    for _ in range(TURNS):
        kw = dict(model="policy", messages=_messages(row, replies), max_tokens=NEW_TOKENS)
        if stream:
            replies.append(
                "".join(
                    c.choices[0].delta.content or ""
                    for c in client.chat.completions.create(**kw, stream=True)
                    if c.choices
                )
            )
        else:
            replies.append(client.chat.completions.create(**kw).choices[0].message.content)
    return 1.0


def threads_chat_stream(row: dict, base_url: str) -> float:
    return threads_chat(row, base_url, stream=True)


async def async_chat(row: dict, base_url: str, stream: bool = False) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    replies: list[str] = []
    for _ in range(TURNS):
        kw = dict(model="policy", messages=_messages(row, replies), max_tokens=NEW_TOKENS)
        if stream:
            chunks = await client.chat.completions.create(**kw, stream=True)
            replies.append("".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]))
        else:
            replies.append((await client.chat.completions.create(**kw)).choices[0].message.content)
    await client.close()
    return 1.0


async def async_chat_stream(row: dict, base_url: str) -> float:
    return await async_chat(row, base_url, stream=True)


async def async_responses(row: dict, base_url: str, stream: bool = False) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    replies: list[str] = []
    for _ in range(TURNS):
        kw = dict(model="policy", input=_messages(row, replies), max_output_tokens=NEW_TOKENS)
        if stream:
            text = ""
            async for event in await client.responses.create(**kw, stream=True):
                if event.type == "response.completed":
                    text = event.response.output_text
            replies.append(text)
        else:
            replies.append((await client.responses.create(**kw)).output_text)
    await client.close()
    return 1.0


async def async_responses_stream(row: dict, base_url: str) -> float:
    return await async_responses(row, base_url, stream=True)


PROGRAMS = [threads_chat, threads_chat_stream, async_chat, async_chat_stream, async_responses, async_responses_stream]


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"Tell me about the number {i}.", "answer": str(i), "meta": {}} for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--openenv", action="store_true", help="also OpenEnv over WebSocket against in-process")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    globals().update(TURNS=args.turns, NEW_TOKENS=args.new_tokens)
    os.environ.setdefault("RAYRLHF_CACHE", str(ROOT / ".cache" / "rayrlhf"))

    from actors.agents.agent_server import AgentEndpoint
    from actors.agents.environments import EnvSpec, EpisodeLimits, environment_factory
    from actors.rollout.generator import Generator, GeneratorConfig
    from cluster.assets import resolve_model

    model = resolve_model(args.model)
    gen = Generator(GeneratorConfig(str(model), max_model_len=2048, seed=0))
    endpoint = AgentEndpoint()
    pool = concurrent.futures.ThreadPoolExecutor(args.episodes)
    limits = EpisodeLimits(max_turns=args.turns, max_tokens=2000, max_new_tokens=args.new_tokens)
    rows = _rows(args.episodes)

    def agent_round(program) -> tuple[float, int]:
        t0 = time.perf_counter()
        exp, counts = gen.generate_agent_episodes(
            rows, list(range(len(rows))), program, endpoint, limits, pool=pool, seed=7
        )
        assert counts.get("status_done") == len(rows), counts
        return time.perf_counter() - t0, int(exp.response_mask.sum())

    contenders = {p.__name__: (lambda p=p: agent_round(p)) for p in PROGRAMS}
    server = None
    if args.openenv:
        server, openenv = _openenv_contenders(gen, rows, limits, pool, environment_factory, EnvSpec)
        contenders.update(openenv)
    agent_round(threads_chat)  # warm-up: the engine's first batches, the clients' imports
    times: dict[str, list[float]] = {k: [] for k in contenders}
    tokens: dict[str, list[int]] = {k: [] for k in contenders}
    try:
        for r in range(args.repeats):
            for name in list(contenders) if r % 2 == 0 else list(reversed(contenders)):
                dt, n_tok = contenders[name]()
                times[name].append(dt)
                tokens[name].append(n_tok)
                print(f"round {r} {name}: {dt:.2f}s, {len(rows) / dt:.2f} episodes/s, {n_tok} tokens", flush=True)
    finally:
        if server is not None:
            server.kill()
        endpoint.close()
        gen.close()
    _report(args, model, rows, times, tokens)


def _openenv_contenders(gen, rows, limits, pool, environment_factory, EnvSpec):
    from serving.common import free_port
    from tests.helpers.openenv_envs import start_server

    port = free_port()
    server = start_server(port, max_sessions=len(rows))
    opts = {"reset_fields": ["prompt", "answer"]}

    def episodes(name: str):
        make = environment_factory(EnvSpec(name, openenv=opts))

        def run() -> tuple[float, int]:
            t0 = time.perf_counter()
            exp, counts = gen.generate_episodes(rows, list(range(len(rows))), make, limits, pool=pool, seed=7)
            assert counts.get("status_done") == len(rows), counts
            return time.perf_counter() - t0, int(exp.response_mask.sum())

        return run

    return server, {
        "openenv_ws": episodes(f"http://127.0.0.1:{port}"),
        "openenv_local": episodes("tests.helpers.openenv_envs:ThreeTurns"),
    }


def _report(args, model, rows, times, tokens) -> None:
    eps = {k: len(rows) / statistics.median(v) for k, v in times.items()}
    ratios = {
        "stream_vs_plain_threads": eps["threads_chat_stream"] / eps["threads_chat"],
        "stream_vs_plain_async": eps["async_chat_stream"] / eps["async_chat"],
        "responses_vs_chat_async": eps["async_responses"] / eps["async_chat"],
        "responses_stream_vs_chat_stream_async": eps["async_responses_stream"] / eps["async_chat_stream"],
        "async_vs_threads_chat": eps["async_chat"] / eps["threads_chat"],
    }
    if "openenv_ws" in eps:
        ratios["openenv_ws_vs_local"] = eps["openenv_ws"] / eps["openenv_local"]
    result = {
        "model": str(model),
        "episodes": len(rows),
        "turns": args.turns,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "episodes_per_s": eps,
        "seconds": times,
        "tokens": tokens,
        "ratios": ratios,
        "cpu": _cpu(),
    }
    print(json.dumps({"episodes_per_s": eps, "ratios": ratios}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
