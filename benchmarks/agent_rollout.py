"""Multi-turn rollout throughput, side by side in one run on one engine (rayrlhf's Generator):

``continuous``: ``Generator.generate_episodes`` — every episode's next turn joins vLLM's running
batch as soon as its environment answered, environment steps on a thread pool.
``lockstep``: the loop most multi-turn trainers started with — turn k of every live episode is
generated as one batch, then every environment step runs (concurrently, on the same pool), then
turn k + 1.

Both run the same episodes: the same prompts, environment, limits and sampling, on the same
engine; the environment's step takes a random delay (``--delay`` seconds times U(0, 2), as a
tool or remote environment would), and replies end at EOS, so turns differ in length. The
result is episodes per second; ``slow_tool`` is the continuous rollout's time with a 0.5 s tool
call every turn divided by its time with an instant one (how well a slow tool hides behind
generation).

    .venv/bin/python benchmarks/agent_rollout.py [--episodes 64] [--turns 3] [--out docs/results/agent_rollout.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class DelayedTurns:
    """``turns`` turns; each step sleeps ``delay`` x U(0, 2) (seeded per episode; exactly ``delay``
    without ``jitter``) then says 'Go on.'."""

    def __init__(self, turns: int, delay: float, seed: int, jitter: bool = True) -> None:
        self.turns, self.delay, self.rng, self.k, self.jitter = turns, delay, random.Random(seed), 0, jitter

    def reset(self, row: dict) -> str:
        self.k = 0
        return row["prompt"]

    def step(self, action: str):
        from actors.agents.environments import Step

        self.k += 1
        time.sleep(self.delay * 2 * self.rng.random() if self.jitter else self.delay)
        return Step(None, 1.0, True, {}) if self.k >= self.turns else Step("Go on.", 0.0, False, {})


def lockstep(gen, rows, make_env, limits, pool) -> int:
    """Turn by turn over all live episodes; returns the tokens sampled."""
    from vllm import SamplingParams

    from actors.agents.episodes import ChatTokens

    chat = ChatTokens(gen.tokenizer)
    envs = [make_env() for _ in rows]
    ids = [chat.prompt(e.reset(r)) for e, r in zip(envs, rows)]
    live, tokens = list(range(len(rows))), 0
    params = SamplingParams(
        temperature=1.0, max_tokens=limits.max_new_tokens, logprobs=1, stop_token_ids=[gen.eos_token_id]
    )
    for _ in range(limits.max_turns):
        outs = gen.loop.run([{"prompt_token_ids": ids[i]} for i in live], params)
        for i, out in zip(live, outs):
            ids[i] = ids[i] + list(out.outputs[0].token_ids)
            tokens += len(out.outputs[0].token_ids)
        steps = list(pool.map(lambda i: envs[i].step(""), live))
        nxt = []
        for i, step in zip(live, steps):
            if not step.done:
                ids[i] = ids[i] + chat.observation(step.observation, reply_ended=ids[i][-1] == gen.eos_token_id)
                nxt.append(i)
        live = nxt
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--delay", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    from actors.agents.environments import EpisodeLimits
    from actors.rollout.generator import Generator, GeneratorConfig
    from actors.data.tasks import load_prompts
    from cluster.assets import resolve_model

    gen = Generator(GeneratorConfig(resolve_model(a.model), dtype="auto", max_model_len=512, seed=0))
    rows = load_prompts("basic_arithmetic", a.episodes, 0, 0, {}, "Explain your answer.")[0].rows
    limits = EpisodeLimits(max_turns=a.turns, max_tokens=512, max_new_tokens=a.new_tokens)
    pool = concurrent.futures.ThreadPoolExecutor(64)
    seeds = iter(range(10**6))

    def env(delay: float):
        return lambda: DelayedTurns(a.turns, delay, next(seeds))

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    results: dict[str, list[float]] = {"continuous": [], "lockstep": [], "instant_tool": [], "slow_tool": []}
    gen.generate_episodes(rows[:4], list(range(4)), env(0.0), limits, pool=pool)  # warm-up
    for _ in range(a.repeats):  # interleaved, so both see the same machine
        results["continuous"].append(
            timed(lambda: gen.generate_episodes(rows, list(range(len(rows))), env(a.delay), limits, pool=pool))
        )
        results["lockstep"].append(timed(lambda: lockstep(gen, rows, env(a.delay), limits, pool)))
        results["instant_tool"].append(
            timed(lambda: gen.generate_episodes(rows, list(range(len(rows))), env(0.0), limits, pool=pool))
        )
        results["slow_tool"].append(
            timed(
                lambda: gen.generate_episodes(
                    rows, list(range(len(rows))), lambda: DelayedTurns(a.turns, 0.5, 0, jitter=False), limits, pool=pool
                )
            )
        )
    best = {k: min(v) for k, v in results.items()}
    summary = {
        "episodes": a.episodes,
        "turns": a.turns,
        "new_tokens": a.new_tokens,
        "delay_s": a.delay,
        "seconds": best,
        "episodes_per_s": {k: a.episodes / v for k, v in best.items() if k in ("continuous", "lockstep")},
        "continuous_over_lockstep": best["lockstep"] / best["continuous"],
        "slow_tool_over_instant": best["slow_tool"] / best["instant_tool"],
    }
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
