"""bf16 against fp32 on this machine's CPU, side by side: what ``auto`` precision decides from.

Three contenders per precision, each in a fresh process, the precisions alternating in every
round so the shared machine's drift hits both alike:

- ``matmul``: the GFLOP/s of SmolLM2-135M's largest matrix multiply (a 576 -> 1536 MLP
  projection over 2048 tokens), fp32 tensors, bf16 tensors, fp32 tensors under bf16 autocast.
- ``generate``: rayrlhf's ``Generator`` (vLLM) with float32 or bfloat16 weights on the GRPO
  preset's rollout (32 prompts, 48 new tokens each, EOS ignored: the same tokens for both).
- ``learn``: the GRPO preset's update (``benchmarks/learner_memory.py --shape grpo``: 8 prompts x
  4 samples), fp32 against bf16 autocast over fp32 master weights.

    .venv/bin/python benchmarks/precision.py [--rounds 2] [--out docs/results/precision.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def matmul_gflops(repeats: int = 10) -> dict[str, float]:
    import torch

    torch.manual_seed(0)
    n, k, m = 2048, 576, 1536
    out = {}
    for name, dtype, autocast in (
        ("fp32", torch.float32, False),
        ("bf16", torch.bfloat16, False),
        ("fp32_autocast_bf16", torch.float32, True),
    ):
        a, w = torch.randn(n, k, dtype=dtype), torch.randn(m, k, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for _ in range(3):
                a @ w.T
            t0 = time.perf_counter()
            for _ in range(repeats):
                a @ w.T
            dt = (time.perf_counter() - t0) / repeats
        out[name] = 2 * n * k * m / dt / 1e9
    return out


def generate_tokens_per_s(dtype: str, batch: int, new_tokens: int, repeats: int) -> dict:
    from actors.rollout.generator import Generator, GeneratorConfig
    from benchmarks.rollout import bench_generator, prompts
    from cluster.assets import resolve_model

    gen = Generator(
        GeneratorConfig(
            resolve_model("smollm2-135m"), dtype=dtype, max_model_len=256 + new_tokens, seed=0, kv_cache_gib=2
        )
    )
    texts = prompts(batch)
    bench_generator(gen, texts[:8], new_tokens, 1)  # warm-up
    return {"tokens_per_s": bench_generator(gen, texts, new_tokens, repeats), "startup_s": gen.startup_s}


def _child(args: list[str], env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--learn-steps", type=int, default=4)
    ap.add_argument("--parts", nargs="+", default=["matmul", "generate", "learn"])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "precision.json"))
    ap.add_argument("--child", choices=["matmul", "generate"], default=None, help="internal")
    ap.add_argument("--dtype", default="float32", help="internal")
    a = ap.parse_args()
    if a.child == "matmul":
        print(json.dumps(matmul_gflops()))
        return
    if a.child == "generate":
        print(json.dumps(generate_tokens_per_s(a.dtype, a.batch, a.new_tokens, a.repeats)))
        return

    from cluster.config.role_settings import KEEP_FREED_MEMORY_ENV

    me = str(Path(__file__).resolve())
    runs: list[dict] = []
    for r in range(a.rounds):
        for part in a.parts:
            contenders = {
                "matmul": [None],
                "generate": ["float32", "bfloat16"],
                "learn": ["full_fp32", "full_autocast"],
            }[part]
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                if part == "matmul":
                    res = _child([me, "--child", "matmul"])
                elif part == "generate":
                    res = _child(
                        [
                            me,
                            "--child",
                            "generate",
                            "--dtype",
                            c,
                            "--batch",
                            str(a.batch),
                            "--new-tokens",
                            str(a.new_tokens),
                            "--repeats",
                            str(a.repeats),
                        ]
                    )
                else:
                    res = _child(
                        [
                            str(ROOT / "benchmarks" / "learner_memory.py"),
                            "--child",
                            c,
                            "--shape",
                            "grpo",
                            "--steps",
                            str(a.learn_steps),
                        ],
                        env={**os.environ, **KEEP_FREED_MEMORY_ENV},
                    )
                runs.append({"round": r, "part": part, "contender": c, **res})
                print(runs[-1], flush=True)
                _write(a, runs)  # after every contender: a run cut short keeps what it measured
    print(json.dumps({k: v for k, v in _write(a, runs).items() if k != "runs"}, indent=1))


def summarise(runs: list[dict]) -> dict:
    """Medians per contender: GFLOP/s, generated tokens/s, learner step seconds after the first."""
    summary: dict = {}
    mm = [x for x in runs if x["part"] == "matmul"]
    if mm:
        summary["matmul_gflops"] = {
            k: statistics.median(x[k] for x in mm) for k in ("fp32", "bf16", "fp32_autocast_bf16")
        }
    for dtype in ("float32", "bfloat16"):
        tps = [t for x in runs if x["part"] == "generate" and x["contender"] == dtype for t in x["tokens_per_s"]]
        if tps:
            summary[f"generate_{dtype}_tokens_per_s"] = statistics.median(tps)
    for mode in ("full_fp32", "full_autocast"):
        steps = [t for x in runs if x["part"] == "learn" and x["contender"] == mode for t in x["step_s"][1:]]
        if steps:
            summary[f"learn_{mode}_median_step_s"] = statistics.median(steps)
    return summary


def _write(a, runs: list[dict]) -> dict:
    from learners.training.precision import cpu_has_native_bf16, resolve_bf16, resolve_engine_dtype

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "cpu_has_native_bf16": cpu_has_native_bf16(),
        "auto_resolves_to": {
            "train.bf16": resolve_bf16("auto", "cpu"),
            "model.generator_dtype": resolve_engine_dtype("auto", uses_gpu=False),
        },
        "settings": {
            "batch": a.batch,
            "new_tokens": a.new_tokens,
            "repeats": a.repeats,
            "learn_steps": a.learn_steps,
            "rounds": a.rounds,
        },
        "summary": summarise(runs),
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
