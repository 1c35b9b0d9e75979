"""Peak memory (RSS) and step time of one learner update: full fine-tuning, full fine-tuning with
the fused LM-head log-probs (``train.fused_logprobs``), and LoRA. ``full_prompt_cache`` shares
prompts through the prompt's key/value cache instead of packed tree rows, ``full_unshared`` runs
every row in full, ``full_mb16`` (``full_mb32``, ...) takes micro-batches of 16 (32, ...) rows, ``full_sdpa`` runs PyTorch's sdpa
kernel also on the short rows the product runs as matrix multiplies (``learners/training/attention.py``).
Like the product's CPU learner workers, every mode runs with glibc's keep-freed-memory settings
(``cluster.keep_freed_memory``) except ``full_default_malloc``; ``full_loop_adamw`` steps AdamW
tensor by tensor (PyTorch's CPU default) instead of the fused kernel; ``full_cast_per_micro`` casts
the weights to bf16 in every micro-batch (no ``learners.training.modeling.shared_weight_casts``);
``full_before`` does all three (the learner as it was before them). Two more contenders measure
options off by default: ``full_compiled`` (``train.compile``: every decoder layer under
``torch.compile(dynamic=True)``) and, not in the product, ``full_bf16_weights`` (the policy's weights cast to bf16,
no fp32 master copy: an upper bound on what bf16 parameters with fp32 master weights could save).
Precision: every mode takes ``train.bf16: auto`` (bf16 autocast where the CPU computes bf16
natively, fp32 elsewhere) except ``full_autocast`` (bf16 autocast always) and ``full_fp32``.

Each mode runs in a fresh subprocess (peak RSS is per process), on the same synthetic batch
(``--shape memory``: 16 full rows of 60 prompt + 48 response tokens, PPO's defaults: a critic
and a KL term; ``--shape grpo``: ``configs/grpo_smollm2.yaml``'s 8 prompts x 4 samples of 10-48
tokens with its settings: group advantages, no critic, no KL), each step on-policy. With
``--rounds R`` the modes alternate R times (noise on a shared machine hits each alike).

    .venv/bin/python benchmarks/learner_memory.py [--modes full full_fused lora full_compiled full_bf16_weights]
        [--rounds 1] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _batch(shape: str, vocab: int, lora: bool):
    """The synthetic batch: ``memory`` (16 x (60 + 48) tokens, every row full) or ``grpo`` (the
    main job's shape: 8 prompts of 45 tokens x 4 samples of 10-48 tokens, prompts shared)."""
    import torch

    from learners.experience import Experience

    if shape == "memory":
        b, p, r = 16, 60, 48
        ids = torch.randint(10, vocab - 1, (b, p + r))
        att = torch.ones_like(ids, dtype=torch.bool)
        groups = torch.arange(b)
    else:
        b, p, r = 32, 45, 48
        groups = torch.arange(b) // 4
        ids = torch.cat([torch.randint(10, vocab - 1, (8, p))[groups], torch.randint(10, vocab - 1, (b, r))], 1)
        lengths = torch.randint(10, r + 1, (b,))
        att = torch.arange(p + r)[None, :] < (p + lengths)[:, None]
    rm = att.clone()
    rm[:, :p] = False
    zeros = torch.zeros(b, p + r)
    return Experience(
        ids,
        att,
        rm,
        zeros,
        groups,
        torch.zeros(b, dtype=torch.bool),
        0,
        [""] * b,
        [{}] * b,
        scores=torch.rand(b),
        ref_logprobs=None if lora or shape == "grpo" else zeros,
    )


def one(model: str, mode: str, steps: int, shape: str = "memory") -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from cluster.assets import resolve_model
    from cluster.config import LoRAConfig, PPOConfig, TrainConfig
    from learners.base import LearnerContext
    from learners.ppo import PPOLearner

    torch.manual_seed(0)
    path = resolve_model(model)
    if mode in ("full_loop_adamw", "full_before"):
        import learners.policy

        learners.policy._FUSED_ADAMW_DEVICES = ()
    if mode in ("full_cast_per_micro", "full_before"):
        import learners.training.modeling
        import learners.ppo

        learners.ppo.shared_weight_casts = lambda bf16, device: learners.training.modeling.shared_weight_casts(
            False, device
        )
    if mode == "full_prompt_cache":  # shared prompts through the prompt's cache, never packed
        import learners.training.modeling

        learners.training.modeling.PACKED_ROW_MAX = 0
    micro = int(mode[len("full_mb") :]) if mode.startswith("full_mb") else 16 if shape == "memory" else 8
    # The product's `auto` precision, unless a mode names one (learners/training/precision.py).
    bf16 = {"full_fp32": False, "full_autocast": True}.get(mode, "auto")
    train = TrainConfig(
        num_minibatches=1,
        micro_batch_size=micro,
        bf16=bf16,
        fused_logprobs=mode.endswith("_fused"),
        shared_prefix=mode != "full_unshared",
        compile=mode == "full_compiled",
    )
    lora = LoRAConfig(enabled=True) if mode.startswith("lora") else None
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The grpo shape trains as configs/grpo_smollm2.yaml does: group advantages, no critic, no KL
    # (so each micro-batch's training pass is also its old pass); the memory shape as PPO's
    # defaults (critic, KL to the reference; a separate old pass unless one micro-batch holds all).
    hp = PPOConfig(advantage_estimator="grpo", kl_coef=0.0, loss_agg="token_mean") if shape == "grpo" else PPOConfig()
    learner = PPOLearner.build(LearnerContext(model_path=path, lora=lora), train, hp)
    if mode == "full_sdpa":  # PyTorch's sdpa kernel at every length (the product: short rows as matmuls)
        learner.model.lm.set_attn_implementation("sdpa")
    if mode == "full_bf16_weights":
        learner.model.lm.to(torch.bfloat16)
    exp = _batch(shape, learner.model.lm.config.vocab_size, lora is not None)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        # Each step trains on a batch of the weights it holds (on-policy, like the main job).
        learner.train_step(exp.replace(policy_version=learner.version))
        times.append(time.perf_counter() - t)
    return {
        "mode": mode,
        "model": model,
        "shape": shape,
        "trainable_fraction": learner.trainable_fraction,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "rss_before_model_gb": rss0 / 1e6,
        "step_s": times,
        "note": "lora step includes the reference pass (adapter disabled); full step does not; the first step "
        "of full_compiled includes compiling",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["full", "full_fused", "lora"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--shape",
        choices=["memory", "grpo"],
        default="memory",
        help="memory: 16 full rows of 60 + 48 tokens (PPO with a critic); grpo: the GRPO preset's batch "
        "(8 prompts x 4 samples) and settings",
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "learner_memory.json"))
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.model, a.child, a.steps, a.shape)))
        return
    import statistics

    sys.path.insert(0, str(ROOT))
    from cluster.config.role_settings import KEEP_FREED_MEMORY_ENV

    results = []
    for _ in range(a.rounds):
        for mode in a.modes:
            # glibc reads these at start-up: only a child started with them has them.
            env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY_ENV}
            if mode not in ("full_default_malloc", "full_before"):
                env.update(KEEP_FREED_MEMORY_ENV)
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    mode,
                    "--model",
                    a.model,
                    "--steps",
                    str(a.steps),
                    "--shape",
                    a.shape,
                ],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    # Per mode: the median step after each process's first (warm-up) step, and the peak RSS.
    summary = {
        m: {
            "median_step_s": statistics.median(
                t for r in results if r["mode"] == m for t in (r["step_s"][1:] or r["step_s"])
            ),
            "peak_rss_gb": max(r["peak_rss_gb"] for r in results if r["mode"] == m),
        }
        for m in a.modes
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    for m, v in summary.items():
        print(f"{m:12s} step {v['median_step_s']:.2f} s  peak RSS {v['peak_rss_gb']:.2f} GB")
    if "full" in summary and "full_fused" in summary:
        f, u = summary["full"], summary["full_fused"]
        print(
            f"fused / plain: step {u['median_step_s'] / f['median_step_s']:.2f}x, "
            f"peak RSS {u['peak_rss_gb'] / f['peak_rss_gb']:.2f}x"
        )


if __name__ == "__main__":
    main()
