"""Step time on paper: larger models and GPU clusters, from the costs measured on this machine.

A roofline model of one synchronous RL step (generate -> score -> reference -> learn -> sync),
phase by phase. It is calibrated on the measured per-phase times of rayrlhf GRPO on SmolLM2-135M
(``docs/results/vs_trl.json``, written by ``benchmarks/vs_trl.py``): the calibration gives this
CPU's effective FLOP/s for training and its effective decode rate, and the model must reproduce
the measured step before it is trusted for anything else. GPU projections replace those effective
rates with hardware peaks times stated efficiencies.

    .venv/bin/python benchmarks/scaling_model.py [--measured docs/results/vs_trl.json] [--out docs/results/scaling.json]

Assumptions (each is a named constant below):
* Training costs 6 N FLOPs per token (forward + backward over every token of prompt + response),
  a reference or old-policy forward 2 N; N counts all parameters, as the LM head runs on every
  response token.
* Decoding is a sequence of ``max_new_tokens`` engine iterations (the longest response decides;
  continuous batching keeps the batch full until then). Each iteration reads the weights once
  plus the KV cache of every running sequence, or computes 2 N FLOPs per sequence, whichever
  takes longer (memory- vs compute-bound); prefill is compute-bound.
* Weight sync sends the bf16 weights once per step over the slowest link on the path
  (NCCL broadcast: every generator receives the whole model).
* Learners shard (ZeRO/FSDP) and split the batch evenly; generators split the prompts evenly;
  no overlap between phases (the synchronous loop of today). The last column shows the
  one-step-off-policy pipeline, where generation overlaps learning on separate GPUs.

Learner memory (``learner_memory_rows``): replicated learners hold ``STATE_BYTES_PER_PARAM``
bytes per parameter each (fp32 weights, fp32 gradients, AdamW's two fp32 moments), sharded ones
(``train.sharding: fsdp``) 1/W of it plus the units gathered while they compute (the root unit:
embeddings and LM head; two decoder layers, the one computing and the next, prefetched) in fp32.
Activations are left out (they depend on the micro-batch, and are the same either way). The
state bytes and the sharded ranks' extra transient memory are checked against
``docs/results/sharded_learners.json`` (``benchmarks/sharded_learners.py``). Sharding's traffic
per micro-batch pass (gather the weights for the forward and again for the backward, reduce-scatter
the gradients) is shown beside that pass's compute: FSDP prefetches the next unit while one
computes, so the traffic costs time only where it exceeds the compute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# --- hardware (vendor peaks) and the efficiencies assumed against them ---------------------------
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, SXM
H100_HBM_BPS = 3.35e12  # HBM3 bandwidth
NVLINK_BPS = 450e9  # NVLink 4, per GPU per direction
IB_BPS = 50e9  # 400 Gb/s NDR per GPU
MFU_TRAIN = 0.40  # typical for FSDP training of dense decoders
MFU_FORWARD = 0.50  # prefill and log-prob passes
DECODE_BW_EFF = 0.60  # share of HBM bandwidth a decode iteration reaches
LINK_EFF = 0.70  # NCCL broadcast vs link peak
DECODE_ITER_OVERHEAD_S = 0.002  # scheduling + kernel launches per engine iteration (CUDA graphs on)


@dataclass
class Arch:
    name: str
    params: float  # N
    layers: int
    kv_dim: int  # kv heads x head dim
    hidden: int
    vocab: int


# SmolLM2-135M as measured; the others follow Qwen2.5's published shapes (GQA).
ARCHS = {
    "smollm2-135m": Arch("SmolLM2-135M", 134.5e6, 30, 192, 576, 49152),
    "0.5b": Arch("0.5B (Qwen2.5-0.5B shape)", 0.49e9, 24, 128, 896, 151936),
    "1.5b": Arch("1.5B (Qwen2.5-1.5B shape)", 1.54e9, 28, 256, 1536, 151936),
    "7b": Arch("7B (Qwen2.5-7B shape)", 7.6e9, 28, 512, 3584, 152064),
    "72b": Arch("72B (Qwen2.5-72B shape)", 72.7e9, 80, 1024, 8192, 152064),
}


STATE_BYTES_PER_PARAM = 16  # fp32 weights + fp32 gradients + AdamW m and v (fp32)
H100_MEMORY_BYTES = 80e9
PASS_TOKENS = 16384  # tokens per micro-batch pass on a learner GPU (assumed)


@dataclass
class Workload:
    completions: int  # per step (prompts x samples)
    prompt_tokens: float  # mean
    response_tokens: float  # mean
    max_new_tokens: int
    reference: bool  # KL term on: a reference forward runs


@dataclass
class Cluster:
    name: str
    generators: int  # engines
    gpus_per_generator: int  # tensor parallel
    learner_gpus: int
    sync_bps: float  # slowest link weights cross


def kv_bytes_per_token(a: Arch) -> float:
    return 2 * a.layers * a.kv_dim * 2  # K and V, bf16


def gpu_phases(a: Arch, w: Workload, c: Cluster) -> dict[str, float]:
    n = a.params
    tokens = w.completions * (w.prompt_tokens + w.response_tokens)
    per_engine = w.completions / c.generators
    flops_g = H100_BF16_FLOPS * c.gpus_per_generator
    prefill = 2 * n * per_engine * w.prompt_tokens / (flops_g * MFU_FORWARD)
    mean_ctx = w.prompt_tokens + w.response_tokens / 2
    read = 2 * n + per_engine * mean_ctx * kv_bytes_per_token(a)
    iteration = max(
        read / (H100_HBM_BPS * c.gpus_per_generator * DECODE_BW_EFF), 2 * n * per_engine / (flops_g * MFU_FORWARD)
    )
    learn = 6 * n * tokens / (H100_BF16_FLOPS * c.learner_gpus * MFU_TRAIN)
    ref = 2 * n * tokens / (H100_BF16_FLOPS * c.learner_gpus * MFU_FORWARD) if w.reference else 0.0
    sync = 2 * n / (c.sync_bps * LINK_EFF)
    return {
        "generate": prefill + w.max_new_tokens * (iteration + DECODE_ITER_OVERHEAD_S),
        "reference": ref,
        "learn": learn,
        "sync": sync,
    }


def learner_memory_rows(measured_file: Path) -> list[dict]:
    """Per-GPU learner state, replicated vs sharded, and sharding's traffic beside a pass's compute."""
    rows = []
    for key, workers, link, link_name in (
        ("0.5b", 8, NVLINK_BPS, "NVLink"),
        ("7b", 8, NVLINK_BPS, "NVLink"),
        ("7b", 32, IB_BPS, "InfiniBand"),
        ("72b", 64, IB_BPS, "InfiniBand"),
    ):
        a = ARCHS[key]
        # The root unit: the embeddings and the LM head (tied in the small models, two matrices otherwise).
        embed = a.vocab * a.hidden * (1 if a.params < 2e9 else 2)
        gathered = 4 * (embed + 2 * (a.params - embed) / a.layers)
        replicated = STATE_BYTES_PER_PARAM * a.params
        sharded = replicated / workers + gathered
        # Per pass: bf16 weights gathered twice, fp32 gradients reduce-scattered; each GPU sends
        # and receives (W-1)/W of every tensor.
        traffic = (2 * 2 + 4) * a.params * (workers - 1) / workers
        rows.append(
            {
                "model": a.name,
                "learner_gpus": workers,
                "link": link_name,
                "replicated_gb": replicated / 1e9,
                "sharded_gb": sharded / 1e9,
                "replicated_fits_h100": replicated < H100_MEMORY_BYTES,
                "sharded_fits_h100": sharded < H100_MEMORY_BYTES,
                "pass_traffic_s": traffic / (link * LINK_EFF),
                "pass_compute_s": 6 * a.params * PASS_TOKENS / (H100_BF16_FLOPS * MFU_TRAIN),
            }
        )
    if measured_file.exists():  # the model's state bytes against the ones measured here
        res = json.loads(measured_file.read_text())["summary"]
        n = ARCHS["smollm2-135m"].params
        rows.append(
            {
                "model": "SmolLM2-135M (measured here, 2 CPU workers)",
                "learner_gpus": 2,
                "link": "gloo",
                "replicated_gb": res["replicated x2 returning"]["state_gb_per_worker"] * 2**30 / 1e9,
                "sharded_gb": res["fsdp x2 returning"]["state_gb_per_worker"] * 2**30 / 1e9,
                "predicted_replicated_gb": STATE_BYTES_PER_PARAM * n / 1e9,
                "predicted_sharded_state_gb": STATE_BYTES_PER_PARAM * n / 2 / 1e9,
            }
        )
    return rows


def gpu_learner_rows(measured_file: Path) -> list[dict]:
    """The model's GPU learner against ``benchmarks/gpu_learner.py``'s H100 measurements (one
    sharded rank): its learn phase (6 N FLOPs per token at ``MFU_TRAIN``) beside the measured step,
    the MFU the step reached counting the passes it ran (the learner's old-policy forward, 2 N;
    the recomputed forward under activation checkpointing, 2 N), and its state bytes
    (``STATE_BYTES_PER_PARAM`` on the GPU, or in host memory with ``train.cpu_offload``) beside the
    GPU's and the process's peaks. Activations are left out of the model, as above."""
    from benchmarks.gpu_learner import SHAPES

    rows = []
    for r in json.loads(measured_file.read_text())["results"] if measured_file.exists() else []:
        if not r.get("trained"):
            continue
        shape = {**SHAPES[r["shape"]], **({"num_hidden_layers": r["layers"]} if r.get("layers") else {})}
        n, tokens, step = r["params"], r["tokens_per_step"], statistics.median(r["step_s"][1:])
        embed = shape["vocab_size"] * shape["hidden_size"] * (1 if shape["tie_word_embeddings"] else 2)
        gathered = 4 * (embed + 2 * (n - embed) / shape["num_hidden_layers"])
        state = STATE_BYTES_PER_PARAM * n
        passes = 6 + 2 + (2 if r["batch"]["ckpt"] else 0)
        rows.append(
            {
                "case": r["case"],
                "params_b": n / 1e9,
                "tokens_per_step": tokens,
                "offload": r["offload"],
                "predicted_learn_s": 6 * n * tokens / (H100_BF16_FLOPS * MFU_TRAIN),
                "measured_step_s": step,
                "measured_mfu": passes * n * tokens / (step * H100_BF16_FLOPS),
                "predicted_gpu_state_gb": (gathered if r["offload"] else state + gathered) / 1e9,
                "measured_gpu_peak_gb": r["gpu_peak_allocated_gb"],
                "predicted_host_state_gb": state / 1e9 if r["offload"] else 0.0,
                "measured_host_peak_gb": r["host_peak_rss_gb"],
            }
        )
    return rows


def calibrate(measured: dict, a: Arch, w: Workload) -> dict[str, float]:
    """Effective rates of this CPU from the measured phases, and the model's step against them."""
    tokens = w.completions * (w.prompt_tokens + w.response_tokens)
    learn_flops = 6 * a.params * tokens
    eff_train = learn_flops / measured["learn"]
    # Decode: the same max_new_tokens iterations; one effective seconds-per-iteration.
    per_iter = measured["generate"] / w.max_new_tokens
    return {
        "train_flops_per_s": eff_train,
        "decode_s_per_iteration": per_iter,
        "measured_step_s": sum(measured.values()),
    }


def prompt_tokens_of_task() -> float:
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from actors.data.tasks import load_prompts
    from benchmarks.vs_trl import load_cfg
    from cluster.assets import resolve_model

    cfg = load_cfg(1, 0)
    tok = AutoTokenizer.from_pretrained(resolve_model(cfg.model.path, cfg.model.cache_dir or None))
    rows, _ = load_prompts(cfg.data.task, 64, 0, 0, cfg.data.task_kwargs, cfg.data.instruction_for(cfg.data.task))
    return statistics.fmean(
        len(
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in rows.rows
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", default=str(ROOT / "docs" / "results" / "vs_trl.json"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "scaling.json"))
    args = ap.parse_args()
    res = json.loads(Path(args.measured).read_text())
    s = res["settings"]
    steps = res["rayrlhf"]["steps"][1:]  # the first step includes one-off warm-up
    measured = {
        k: statistics.median(st["phases"][k] for st in steps)
        for k in ("generate", "score", "reference", "learn", "sync")
    }
    small = Workload(
        s["prompts_per_step"] * s["samples_per_prompt"],
        prompt_tokens_of_task(),
        res["rayrlhf"]["summary"]["response_length_mean"],
        s["max_new_tokens"],
        reference=s["beta"] != 0,
    )
    cpu = calibrate(measured, ARCHS["smollm2-135m"], small)
    # Validation on a workload the calibration did not see: the learner benchmark's update
    # (16 sequences x 108 tokens, separate process, benchmarks/learner_memory.py).
    lm_file = ROOT / "docs" / "results" / "learner_memory.json"
    if lm_file.exists():
        saved = json.loads(lm_file.read_text())
        full = next(r for r in (saved["runs"] if isinstance(saved, dict) else saved) if r["mode"] == "full")
        cpu["check_learner_benchmark"] = {
            "predicted_s": 6 * ARCHS["smollm2-135m"].params * 16 * 108 / cpu["train_flops_per_s"],
            "measured_s": statistics.median(full["step_s"][1:] or full["step_s"]),
        }

    # A typical reasoning-RL step: 256 prompts x 8 samples, 256-token prompts, 1,024-token
    # mean responses capped at 4,096, KL to a reference on.
    big = Workload(2048, 256, 1024, 4096, reference=True)
    plans = [
        ("smollm2-135m", small, Cluster("1x H100 (all roles time-share it)", 1, 1, 1, H100_HBM_BPS)),
        ("smollm2-135m", big, Cluster("1x H100 (all roles time-share it)", 1, 1, 1, H100_HBM_BPS)),
        ("1.5b", big, Cluster("8x H100, 1 node: 4 engines + 4 learners", 4, 1, 4, NVLINK_BPS)),
        ("7b", big, Cluster("8x H100, 1 node: 4 engines + 4 learners", 4, 1, 4, NVLINK_BPS)),
        ("7b", big, Cluster("32x H100, 4 nodes: 16 engines + 16 learners", 16, 1, 16, IB_BPS)),
        ("72b", big, Cluster("64x H100, 8 nodes: 4 engines (TP8) + 32 learners", 4, 8, 32, IB_BPS)),
    ]
    rows = []
    for arch_key, w, c in plans:
        a = ARCHS[arch_key]
        ph = gpu_phases(a, w, c)
        sync_step = sum(ph.values())
        rows.append(
            {
                "model": a.name,
                "cluster": c.name,
                "completions": w.completions,
                "tokens_per_step": w.completions * (w.prompt_tokens + w.response_tokens),
                **{f"{k}_s": v for k, v in ph.items()},
                "step_s": sync_step,
                "step_s_async": max(ph["generate"], ph["reference"] + ph["learn"]) + ph["sync"],
                "completions_per_s": w.completions / sync_step,
            }
        )
    out = {
        "measured_cpu_phases_s": measured,
        "cpu_calibration": cpu,
        "small_workload": asdict(small),
        "big_workload": asdict(big),
        "assumptions": {
            "H100_BF16_FLOPS": H100_BF16_FLOPS,
            "H100_HBM_BPS": H100_HBM_BPS,
            "NVLINK_BPS": NVLINK_BPS,
            "IB_BPS": IB_BPS,
            "MFU_TRAIN": MFU_TRAIN,
            "MFU_FORWARD": MFU_FORWARD,
            "DECODE_BW_EFF": DECODE_BW_EFF,
            "LINK_EFF": LINK_EFF,
            "DECODE_ITER_OVERHEAD_S": DECODE_ITER_OVERHEAD_S,
        },
        "projections": rows,
        "learner_memory": learner_memory_rows(ROOT / "docs" / "results" / "sharded_learners.json"),
        "gpu_learner_check": gpu_learner_rows(ROOT / "docs" / "results" / "gpu_learner.json"),
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"CPU calibration: training at {cpu['train_flops_per_s'] / 1e9:.0f} GFLOP/s effective, "
        f"{cpu['decode_s_per_iteration'] * 1e3:.0f} ms per decode iteration; measured step {cpu['measured_step_s']:.1f} s"
    )
    if "check_learner_benchmark" in cpu:
        chk = cpu["check_learner_benchmark"]
        print(
            f"check: learner benchmark update predicted {chk['predicted_s']:.1f} s, measured {chk['measured_s']:.1f} s"
        )
    print(
        "| model | cluster | completions | generate s | reference s | learn s | sync s | step s | step s, async | completions/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['cluster']} | {r['completions']} | {r['generate_s']:.3g} | {r['reference_s']:.3g} | "
            f"{r['learn_s']:.3g} | {r['sync_s']:.2g} | {r['step_s']:.3g} | {r['step_s_async']:.3g} | {r['completions_per_s']:.3g} |"
        )
    print(
        "\n| model | learner GPUs | state per GPU, replicated GB | sharded GB | fits an H100 (replicated / sharded) | "
        "sharding traffic per pass s | pass compute s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in out["learner_memory"]:
        if "pass_traffic_s" not in r:
            print(
                f"| {r['model']} | {r['learner_gpus']} | {r['replicated_gb']:.2f} (model {r['predicted_replicated_gb']:.2f}) "
                f"| {r['sharded_gb']:.2f} (model, state only: {r['predicted_sharded_state_gb']:.2f}) | | | |"
            )
            continue
        print(
            f"| {r['model']} | {r['learner_gpus']} ({r['link']}) | {r['replicated_gb']:.1f} | {r['sharded_gb']:.1f} | "
            f"{'yes' if r['replicated_fits_h100'] else 'no'} / {'yes' if r['sharded_fits_h100'] else 'no'} | "
            f"{r['pass_traffic_s']:.3g} | {r['pass_compute_s']:.3g} |"
        )
    print_gpu_check(out["gpu_learner_check"])
    return 0


def print_gpu_check(rows: list[dict]) -> None:
    print(
        "\n| H100 case | params | tokens | learn s, model | step s, measured | MFU reached | GPU GB, model (state) "
        "| GPU GB, peak | host GB, model (state) | host GB, peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['params_b']:.2f}B | {r['tokens_per_step']} | {r['predicted_learn_s']:.2f} | "
            f"{r['measured_step_s']:.2f} | {r['measured_mfu']:.0%} | {r['predicted_gpu_state_gb']:.1f} | "
            f"{r['measured_gpu_peak_gb']:.1f} | {r['predicted_host_state_gb']:.1f} | {r['measured_host_peak_gb']:.1f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
