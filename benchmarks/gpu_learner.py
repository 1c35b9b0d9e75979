"""The sharded learner on one GPU (issue 34's device check): how fast, how much memory, and the
largest model that trains with its state offloaded to host memory.

Runs where the ``device`` tool lends a GPU machine (an H100 or H200; no Ray, no vLLM there: the
learner alone). Each case is a fresh process holding a one-rank process group
(``cpu:gloo,cuda:nccl`` as Ray Train's workers get with ``train.cpu_offload``, plain ``nccl``
without) and rayrlhf's own ``PPOLearner`` (GRPO advantages, no KL, bf16 with fp32 master weights,
``train.sharding: fsdp``) on a random-weight model of a published shape, written once as a
safetensors folder (no hub on that machine). Every case takes ``--steps`` GRPO steps on a
synthetic batch (all rows full length, every step on-policy) and records:

* the GPU's peak memory (``torch.cuda.max_memory_allocated`` and ``..._reserved``) and the
  process's peak resident set (pinned host shards count there);
* the seconds of each step (synchronised) and the tokens it trained on;
* whether it trained: every step's loss and gradient norm finite, and a weight it sampled moved.

Cases, in the order run (``--cases`` picks; ``NAME[+offload][+ckpt]``, or a ``@LAYERS`` suffix that
keeps a shape's width with fewer layers):

* ``speed`` batch (64 rows x 512 tokens, micro-batch 16) on 1.5B and 0.5B without offload: step
  time against ``benchmarks/scaling_model.py``'s learn phase for the same tokens;
* ``fit`` batch (16 x 256, micro-batch 8, activation checkpointing) on 3B on the GPU, and on 0.5B, 5.8B
  (the 7B shape with 20 of its 28 layers) and 7B with ``train.cpu_offload``: the largest that trains.

The parent stops a case whose host memory runs out (less than ``--host-reserve-gb`` available) and
starts no case after ``--budget-s``; results are written after every case.

    python3 benchmarks/gpu_learner.py --out $OUT/gpu_learner.json [--budget-s 420] [--steps 3]
    .venv/bin/python benchmarks/gpu_learner.py --device cpu --cases tiny --out /tmp/g.json  # dry run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Published shapes (Qwen2.5 / Qwen3, random weights): config keyword arguments.
SHAPES = {
    "tiny": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "3b": dict(
        model_type="qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
BATCHES = {
    "speed": dict(rows=64, prompt=128, response=384, micro=16, ckpt=False),
    "fit": dict(rows=16, prompt=64, response=192, micro=8, ckpt=True),
}
DEFAULT_CASES = ["0.5b+offload+ckpt", "1.5b", "7b@20+offload+ckpt", "7b+offload+ckpt", "3b+ckpt", "0.5b"]


def parse_case(case: str) -> dict:
    """``NAME[@LAYERS][+offload][+ckpt]`` as the shape, its layers and the batch it runs."""
    name, *flags = case.split("+")
    shape, _, layers = name.partition("@")
    batch = dict(BATCHES["fit" if "ckpt" in flags else "speed"])
    return {
        "case": case,
        "shape": shape,
        "layers": int(layers) if layers else None,
        "offload": "offload" in flags,
        "unpinned": "unpinned" in flags,
        "batch": batch,
    }


def model_folder(spec: dict, device: str, root: Path) -> tuple[Path, int, float]:
    """A random-weight safetensors folder of the case's shape (bf16, built on ``device``), with
    its parameter count and the seconds it took."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SHAPES[spec["shape"]])
    if spec["layers"]:
        kw["num_hidden_layers"] = spec["layers"]
    folder = root / f"{spec['shape']}-{kw['num_hidden_layers']}"
    t = time.perf_counter()
    config = AutoConfig.for_model(**kw)
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    n = sum(p.numel() for p in lm.parameters())
    if not (folder / "config.json").exists():
        lm.save_pretrained(folder, safe_serialization=True)
    del lm
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder, n, time.perf_counter() - t


def synthetic_batch(vocab: int, rows: int, prompt: int, response: int):
    """GRPO-shaped rows (groups of 4 sharing a prompt), every token real, rewards in [0, 1)."""
    import torch

    from learners.experience import Experience

    torch.manual_seed(0)
    groups = torch.arange(rows) // 4
    prompts = torch.randint(10, vocab - 1, (rows // 4 + 1, prompt))[groups]
    ids = torch.cat([prompts, torch.randint(10, vocab - 1, (rows, response))], 1)
    att = torch.ones_like(ids, dtype=torch.bool)
    rm = att.clone()
    rm[:, :prompt] = False
    zeros = torch.zeros(rows, prompt + response)
    return Experience(
        ids,
        att,
        rm,
        zeros,
        groups,
        torch.zeros(rows, dtype=torch.bool),
        0,
        [""] * rows,
        [{}] * rows,
        scores=torch.rand(rows),
    )


def build_learner(folder: Path, spec: dict, device: str):
    """rayrlhf's PPO learner (GRPO) over ``folder``, sharded on a one-rank group."""
    import torch

    from cluster.config import PPOConfig, TrainConfig
    from learners.base import LearnerContext
    from learners.training.distributed import default_collective
    from learners.ppo import PPOLearner

    gpu = device.startswith("cuda")
    if spec["unpinned"]:
        _unpinned_offload()
    backend = ("cpu:gloo,cuda:nccl" if spec["offload"] else "nccl") if gpu else "gloo"
    torch.distributed.init_process_group(backend, init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    b = spec["batch"]
    train = TrainConfig(
        num_minibatches=1,
        micro_batch_size=b["micro"],
        bf16=gpu,
        sharding="fsdp",
        cpu_offload=spec["offload"],
        gradient_checkpointing=b["ckpt"],
    )
    hp = PPOConfig(advantage_estimator="grpo", kl_coef=0.0, loss_agg="token_mean")
    ctx = LearnerContext(model_path=str(folder), comm=default_collective(), device=device, max_new_tokens=b["response"])
    return PPOLearner.build(ctx, train, hp)


def _unpinned_offload() -> None:
    """FSDP2's offload policy with ordinary (pageable) host memory: the CUDA host allocator rounds
    each pinned block up to a power of two, up to twice the shards' bytes."""
    import torch.distributed.fsdp as fsdp

    pinned = fsdp.CPUOffloadPolicy
    fsdp.CPUOffloadPolicy = lambda pin_memory=True: pinned(pin_memory=False)


def probe_weight(learner):
    """A slice of one decoder layer's MLP weight, full (gathered), on the CPU."""
    from learners.training.sharding import full_tensor

    for name, p in learner.model.named_parameters():
        if "mlp.down_proj" in name:
            return full_tensor(p.detach())[:64, :64].float().cpu().clone()
    raise RuntimeError("no mlp.down_proj parameter")


def run_case(spec: dict, device: str, steps: int, root: Path) -> dict:
    """One case in this process: the folder, the learner, ``steps`` steps; what it measured."""
    import torch

    folder, n_params, t_folder = model_folder(spec, device, root)
    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    learner = build_learner(folder, spec, device)
    t_build = time.perf_counter() - t
    shutil.rmtree(folder)  # loaded: its memory (a RAM disk by default) goes to the learner's state
    b = spec["batch"]
    batch = synthetic_batch(learner.model.lm.config.vocab_size, b["rows"], b["prompt"], b["response"])
    before, times, metrics = probe_weight(learner), [], []
    for _ in range(steps):
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        m = learner.train_step(batch.replace(policy_version=learner.version))
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        metrics.append({k: float(v) for k, v in m.items() if isinstance(v, (int, float))})
    moved = float((probe_weight(learner) - before).abs().max())
    finite = all(math.isfinite(v) for m in metrics for k, v in m.items() if "loss" in k or "grad_norm" in k)
    return {
        **spec,
        "params": n_params,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "folder_s": t_folder,
        "build_s": t_build,
        "step_s": times,
        "tokens_per_step": b["rows"] * (b["prompt"] + b["response"]),
        "gpu_peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if gpu else None,
        "gpu_peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if gpu else None,
        "host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "weight_moved": moved,
        "finite": finite,
        "trained": finite and moved > 0,
        "metrics_last": metrics[-1] if metrics else {},
    }


def _meminfo_gb(field: str = "MemAvailable") -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("inf")


def supervise(case: str, args: argparse.Namespace) -> dict:
    """``case`` in a child process, stopped if host memory runs out or it outlives its time; a
    failed case's last lines of output go to the log beside ``--out``."""
    cmd = [
        sys.executable,
        __file__,
        "--one",
        case,
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--models",
        args.models,
    ]
    t0, low, stopped = time.perf_counter(), float("inf"), None
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)  # files: no pipe to fill
        while proc.poll() is None:
            low = min(low, _meminfo_gb())
            if low < args.host_reserve_gb:
                stopped = f"host memory ran out ({low:.1f} GB available)"
            elif time.perf_counter() - t0 > args.case_timeout_s:
                stopped = f"over {args.case_timeout_s:.0f} s"
            if stopped:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        lines, errors = [ln for ln in out.read().splitlines() if ln.startswith("{")], err.read().splitlines()
    ok = proc.returncode == 0 and not stopped and lines
    result = json.loads(lines[-1]) if ok else parse_case(case)
    if not ok:
        result.update(trained=False, error=stopped or errors[-3:])
        with open(args.out.with_suffix(".log"), "a") as log:
            log.write(f"== {case} (exit {proc.returncode}, {stopped})\n" + "\n".join(errors[-60:]) + "\n")
    result.update(wall_s=time.perf_counter() - t0, host_min_available_gb=low)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "gpu_learner.json")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--case-timeout-s", type=float, default=240.0)
    ap.add_argument("--host-reserve-gb", type=float, default=6.0)
    # A RAM disk where there is one: the folders are written and read once, disks can be slow.
    ap.add_argument(
        "--models",
        default="/dev/shm/gpu_learner_models" if os.access("/dev/shm", os.W_OK) else "/tmp/gpu_learner_models",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(run_case(parse_case(args.one), args.device, args.steps, Path(args.models))), flush=True)
        return 0
    t0, results = time.perf_counter(), []
    for case in args.cases.split(","):
        over = time.perf_counter() - t0 > args.budget_s
        r = {**parse_case(case), "skipped": "budget", "wall_s": 0.0} if over else supervise(case, args)
        results.append(r)
        print(
            f"{case}: trained={r.get('trained')} params={r.get('params')} step_s={r.get('step_s')} "
            f"gpu_peak={r.get('gpu_peak_allocated_gb')} host_peak={r.get('host_peak_rss_gb')} "
            f"wall={r['wall_s']:.0f}s error={r.get('error') or r.get('skipped')}",
            flush=True,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"host_total_gb": _meminfo_gb("MemTotal"), "results": results}, indent=1) + "\n")
        # Each case's folder is only needed by it: free the disk for the next.
        subprocess.run(["rm", "-rf", args.models], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
