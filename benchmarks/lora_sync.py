"""Bytes and seconds of one weight sync with LoRA, adapter-only (``lora.sync: adapter``) vs merged
(``lora.sync: merged``), SmolLM2-135M, LoRA r = 8 and 64 on every linear layer (the default
``lora.target_modules``), in one process on the same cores.

Each contender does the whole sync but the transport: the learner's pack (``sync_weights`` into
the one flat buffer the object store or the broadcast carries) and the generator's load into its
vLLM engine (for the adapter: merging the factors into the base weights read from the model
folder, then the in-place reload). The transport's own time scales with the bytes
(``docs/results/weight_sync.json``). The adapter is a trained one (random B), and after each load
the engine's log-probs of a probe are compared with the learner's (the verified-sync check).

    .venv/bin/python benchmarks/lora_sync.py [--ranks 8,64] [--repeats 3] [--out docs/results/lora_sync.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _learner(model_path: str, r: int):
    import torch

    from cluster.config import LoRAConfig, PPOConfig, TrainConfig
    from learners.base import LearnerContext
    from learners.ppo import PPOLearner

    lora = LoRAConfig(enabled=True, r=r, alpha=2.0 * r)
    learner = PPOLearner.build(
        LearnerContext(model_path=model_path, lora=lora),
        TrainConfig(bf16=False),
        PPOConfig(advantage_estimator="grpo", kl_coef=0.0),
    )
    gen = torch.Generator().manual_seed(r)
    with torch.no_grad():  # a trained adapter (peft starts B at 0)
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return learner


def _sync(learner, generator, adapter: bool, version: int, probe: list[int]) -> dict:
    from cluster.roles.weight_sync import pack, unpack

    t0 = time.perf_counter()
    with learner.sync_weights(adapter) as weights:
        packed = pack(weights, "float32", version=version)
    t_pack = time.perf_counter() - t0
    t_load = generator.load_weights(unpack(packed), version)
    served = generator.probe_logprobs(probe)
    expected = learner.probe_logprobs(probe)
    gap = sum(abs(a - b) for a, b in zip(served, expected)) / len(expected)
    return {"bytes": packed.nbytes, "pack_s": t_pack, "load_s": t_load, "total_s": t_pack + t_load, "probe_gap": gap}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "lora_sync.json"))
    a = ap.parse_args()

    from actors.rollout.generator import Generator, GeneratorConfig
    from cluster.assets import resolve_model

    model_path = resolve_model(a.model)
    generator = Generator(GeneratorConfig(model_path, dtype="float32", max_model_len=256, lora_base=model_path))
    probe = generator.encode_prompt("Verified sync probe: 12 + 30 = 42. The quick brown fox jumps over the lazy dog.")
    results, version = {}, 0
    for r in (int(x) for x in a.ranks.split(",")):
        learner = _learner(model_path, r)
        for _ in range(a.repeats):  # the contenders alternate
            for mode in ("adapter", "merged"):
                version += 1
                results.setdefault(f"r{r}/{mode}", []).append(
                    _sync(learner, generator, mode == "adapter", version, probe)
                )
        del learner
    summary = {}
    for key, runs in results.items():
        summary[key] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        summary[key]["probe_gap"] = max(run["probe_gap"] for run in runs)
    for r in a.ranks.split(","):
        ad, me = summary[f"r{r}/adapter"], summary[f"r{r}/merged"]
        summary[f"r{r}/ratio"] = {"bytes": ad["bytes"] / me["bytes"], "total_s": ad["total_s"] / me["total_s"]}
    out = {"model": a.model, "generator_dtype": "float32", "repeats": a.repeats, "summary": summary, "runs": results}
    Path(a.out).write_text(json.dumps(out, indent=1))
    for key, row in summary.items():
        print(key, {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})


if __name__ == "__main__":
    main()
