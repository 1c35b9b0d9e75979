"""Peak memory per learner worker and step time: replicated vs sharded (``train.sharding: fsdp``)
learners of SmolLM2-135M, 1 and 2 workers, on the same cores.

Each contender is a fresh set of processes (peak memory is per process) joined in a gloo group as
Ray Train's workers are, one CPU thread per worker (two workers use the machine's two cores), on
the GRPO preset's batch (``benchmarks/learner_memory.py --shape grpo``: 8 prompts x 4 samples,
group advantages, no critic, no KL), every step on-policy. Contenders:

* ``replicated x1``: one worker, two threads (the whole machine);
* ``replicated x2``: two data-parallel workers, each the whole model;
* ``fsdp x2``: two sharded workers.

Two allocators: ``product`` is the CPU learner workers' own (``cluster.keep_freed_memory``: freed
memory stays with the process for reuse, so the resident set is the heap's high-water mark,
fragmentation included) and decides the step times; ``returning`` gives every allocation of
64 KiB or more back to the system when freed (``MALLOC_MMAP_THRESHOLD_=65536``), so the resident
set follows the memory the tensors actually hold: what a GPU's allocator would report.

Memory: each worker's peak resident set while it trains (sampled every 5 ms over the timed steps),
its resident set after the last step, and the bytes of its parameters, gradients and AdamW state
(its shards, sharded). Step time: the median of the steps after the first. With ``--rounds R``
the contenders alternate R times.

    .venv/bin/python benchmarks/sharded_learners.py [--steps 4] [--rounds 2] [--out ...]
        [--micro-batch 8] [--checkpointing] [--contenders "replicated x2 returning,fsdp x2 returning"]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = [
    ("replicated", 1, "product"),
    ("replicated", 2, "product"),
    ("fsdp", 2, "product"),
    ("replicated", 2, "returning"),
    ("fsdp", 2, "returning"),
]
RETURNING_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}


def _rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


class _PeakSampler:
    """The largest resident set seen between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_gb())
            time.sleep(0.005)

    def __enter__(self) -> "_PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def worker(
    rank: int,
    world: int,
    mode: str,
    model: str,
    steps: int,
    threads: int,
    micro: int = 8,
    checkpointing: bool = False,
    fused: bool = False,
    chunk: int = 1024,
) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.learner_memory import _batch
    from cluster.assets import resolve_model
    from cluster.config import PPOConfig, TrainConfig
    from learners.base import LearnerContext
    from learners.training.distributed import default_collective
    from learners.ppo import PPOLearner

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    train = TrainConfig(
        num_minibatches=1,
        micro_batch_size=micro,
        bf16="auto",
        sharding=mode,
        gradient_checkpointing=checkpointing,
        fused_logprobs=fused,
        logprob_chunk=chunk,
    )
    base = _rss_gb()  # the process before the model: torch, transformers, the gloo group
    hp = PPOConfig(advantage_estimator="grpo", kl_coef=0.0, loss_agg="token_mean")
    learner = PPOLearner.build(LearnerContext(model_path=resolve_model(model), comm=default_collective()), train, hp)
    exp = _batch("grpo", learner.model.lm.config.vocab_size, False)
    times = []
    with _PeakSampler() as sampler:
        for _ in range(steps):
            t = time.perf_counter()
            learner.train_step(exp.replace(policy_version=learner.version))
            times.append(time.perf_counter() - t)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    state = [p for p in learner.model.parameters()] + [p.grad for p in learner.model.parameters() if p.grad is not None]
    state += [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return {
        "mode": mode,
        "world": world,
        "rank": rank,
        "step_s": times,
        "train_peak_gb": sampler.peak,
        "base_gb": base,
        "train_peak_above_base_gb": sampler.peak - base,
        "after_gb": _rss_gb(),
        "state_gb": sum(local(t).numel() * t.element_size() for t in state) / 2**30,
        "life_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def run(
    mode: str,
    world: int,
    malloc: str,
    model: str,
    steps: int,
    micro: int = 8,
    checkpointing: bool = False,
    fused: bool = False,
    chunk: int = 1024,
) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from cluster.config.role_settings import KEEP_FREED_MEMORY_ENV
    from tests.helpers.ranks import run_processes

    saved = dict(os.environ)
    # glibc reads these when a process starts: the ranks are spawned with them.
    os.environ.update(KEEP_FREED_MEMORY_ENV if malloc == "product" else RETURNING_ENV)
    try:
        ranks = run_processes(
            world, worker, mode, model, steps, 2 // world, micro, checkpointing, fused, chunk, timeout_s=1800
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return [{**r, "malloc": malloc} for r in ranks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8, help="train.micro_batch_size of every contender")
    ap.add_argument("--checkpointing", action="store_true", help="train.gradient_checkpointing in every contender")
    ap.add_argument("--fused-logprobs", action="store_true", help="train.fused_logprobs in every contender")
    ap.add_argument("--logprob-chunk", type=int, default=1024, help="train.logprob_chunk of every contender")
    ap.add_argument("--contenders", default="", help="comma-separated 'mode xN malloc' names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "sharded_learners.json"))
    a = ap.parse_args()
    contenders = [c for c in CONTENDERS if not a.contenders or f"{c[0]} x{c[1]} {c[2]}" in a.contenders.split(",")]
    runs = []
    for _ in range(a.rounds):
        for mode, world, malloc in contenders:
            ranks = run(
                mode, world, malloc, a.model, a.steps, a.micro_batch, a.checkpointing, a.fused_logprobs, a.logprob_chunk
            )
            runs.extend(ranks)
            print(json.dumps(ranks[0]), flush=True)
    summary = {}
    for mode, world, malloc in contenders:
        mine = [r for r in runs if (r["mode"], r["world"], r["malloc"]) == (mode, world, malloc)]
        summary[f"{mode} x{world} {malloc}"] = {
            "median_step_s": statistics.median(t for r in mine for t in r["step_s"][1:]),
            **{
                f"{k}_per_worker": max(r[k] for r in mine)
                for k in (
                    "train_peak_gb",
                    "after_gb",
                    "state_gb",
                    "life_peak_gb",
                    "base_gb",
                    "train_peak_above_base_gb",
                )
            },
        }
    ratios = {}
    for malloc in ("product", "returning"):
        if f"replicated x2 {malloc}" not in summary or f"fsdp x2 {malloc}" not in summary:
            continue
        base, fsdp = summary[f"replicated x2 {malloc}"], summary[f"fsdp x2 {malloc}"]
        for k in (
            "train_peak_gb_per_worker",
            "train_peak_above_base_gb_per_worker",
            "after_gb_per_worker",
            "state_gb_per_worker",
            "median_step_s",
        ):
            ratios[f"fsdp_vs_replicated_x2_{malloc}_{k}"] = fsdp[k] / base[k]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {
                "model": a.model,
                "steps": a.steps,
                "micro_batch_size": a.micro_batch,
                "gradient_checkpointing": a.checkpointing,
                "fused_logprobs": a.fused_logprobs,
                "logprob_chunk": a.logprob_chunk,
                "runs": runs,
                "summary": summary,
                "ratios": ratios,
            },
            indent=1,
        )
    )
    for name, v in summary.items():
        print(
            f"{name:28s} step {v['median_step_s']:.2f} s  per worker: peak {v['train_peak_gb_per_worker']:.2f} GB, "
            f"after {v['after_gb_per_worker']:.2f} GB, state {v['state_gb_per_worker']:.2f} GB"
        )
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
