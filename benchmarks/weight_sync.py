"""Seconds per weight sync of SmolLM2-135M, per transport, next to a raw in-memory copy.

- raw_copy: copy every policy tensor into preallocated bf16 tensors in the same process (the floor).
- pack: the learner-side framing (fp32 weights -> one flat bf16 buffer), into a fresh buffer;
  pack_reused: into the buffer of the previous pack, as the learner does.
- object_store_flat: ray.put of the packed buffer + an actor that reads every byte of it.
- object_store_dict: ray.put of a dict of bf16 tensors + the same actor (the naive transport).
- vllm_load: the generator actor's in-place reload into the vLLM engine from the flat buffer
  (what a training step actually pays, measured inside the actor).
- sync_end_to_end (object store transport): pack, ray.put, the actor fetches it and reloads vLLM.
- collective_end_to_end (collective transport): pack, a gloo broadcast in ``--bucket-mb`` buckets
  from this process (standing in for learner rank 0) into the actor's receive buffer, reload.

The goal of issue 13: each transport's sync within 2x (raw copy + vLLM reload).

    .venv/bin/python benchmarks/weight_sync.py [--repeats 5] [--out docs/results/weight_sync.json]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "weight_sync.json"))
    a = ap.parse_args()

    import numpy as np
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.config.role_settings import generator_config
    from cluster.roles.workers import GeneratorWorker
    from cluster.assets import resolve_model
    from cluster.config.loading import load_config
    from cluster.roles.weight_sync import pack

    torch.set_num_threads(2)
    path = resolve_model(a.model)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sd = {k: v for k, v in lm.state_dict().items() if k != "lm_head.weight"}
    nbytes = sum(v.numel() for v in sd.values()) * 2
    res: dict = {"model": a.model, "bytes_bf16": nbytes, "tensors": len(sd)}

    dst = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in sd.items()}
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for k, v in sd.items():
            dst[k].copy_(v)
        times.append(time.perf_counter() - t0)
    res["raw_copy_s"] = times

    times = []
    for i in range(a.repeats):
        t0 = time.perf_counter()
        packed = pack(sd, "bfloat16", version=i)
        times.append(time.perf_counter() - t0)
    res["pack_s"] = times

    times = []
    for i in range(a.repeats):
        t0 = time.perf_counter()
        pack(sd, "bfloat16", version=i, out=packed.buffer)
        times.append(time.perf_counter() - t0)
    res["pack_reused_s"] = times
    buffer = packed.buffer

    ray.init(num_cpus=4, include_dashboard=False)
    try:

        @ray.remote(num_cpus=1)
        class Reader:
            def touch(self, obj) -> int:
                x = obj[0] if isinstance(obj, list) else obj
                x = ray.get(x) if isinstance(x, ray.ObjectRef) else x
                if hasattr(x, "buffer"):
                    return int(np.asarray(x.buffer).view(np.uint8).sum(dtype=np.uint64) & 1)
                return int(sum(int(t.view(torch.uint8).sum()) for t in x.values()) & 1)

        reader = Reader.remote()
        ray.get(reader.__ray_ready__.remote())
        for name, obj in (("object_store_flat", packed), ("object_store_dict", dst)):
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                ref = ray.put(obj)
                ray.get(reader.touch.remote([ref]))
                times.append(time.perf_counter() - t0)
                del ref
            res[name + "_s"] = times

        cfg = load_config(overrides=["model.max_prompt_tokens=64", "model.max_new_tokens=16"])
        gen = ray.remote(GeneratorWorker).options(num_cpus=1).remote(generator_config(cfg, path))
        ray.get(gen.ready.remote())
        end_to_end, inside = [], []
        for i in range(a.repeats):
            t0 = time.perf_counter()
            ref = ray.put(pack(sd, "bfloat16", version=i + 1, out=buffer))
            inside.append(ray.get(gen.load_weights.remote([ref])))
            end_to_end.append(time.perf_counter() - t0)
        res["vllm_load_inside_actor_s"] = inside
        res["sync_end_to_end_s"] = end_to_end

        # The collective transport: this process is rank 0 of a gloo group of its own with the actor.
        from cluster.roles import collective

        store, host, port = collective.open_store(2)
        joined = gen.join_weight_group.remote(host, port, 1, 2)
        group = collective.join(host, port, 0, 2, store=store)
        ray.get(joined)
        bucket = a.bucket_mb * 2**20
        end_to_end, inside = [], []
        for i in range(a.repeats):
            t0 = time.perf_counter()
            p = pack(sd, "bfloat16", version=100 + i, out=buffer)
            received = gen.receive_weights.remote(p.layout, p.dtype, p.buffer.size, p.version, bucket)
            collective.broadcast_buffer(group, torch.from_numpy(p.buffer), bucket)
            inside.append(ray.get(received))
            end_to_end.append(time.perf_counter() - t0)
        assert ray.get(gen.version.remote()) == 100 + a.repeats - 1
        res["collective_receive_and_load_inside_actor_s"] = inside
        res["collective_end_to_end_s"] = end_to_end
    finally:
        ray.shutdown()
    med = {k: statistics.median(v) for k, v in res.items() if isinstance(v, list)}
    res["median_s"] = med
    res["ratios_vs_raw_copy"] = {k: v / med["raw_copy_s"] for k, v in med.items()}
    floor = med["raw_copy_s"] + med["vllm_load_inside_actor_s"]
    res["goal_ratio_vs_raw_copy_plus_vllm_load"] = {
        "object_store": med["sync_end_to_end_s"] / floor,
        "collective": med["collective_end_to_end_s"] / floor,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for k, v in med.items():
        print(f"{k:44s} {v * 1000:9.1f} ms  ({res['ratios_vs_raw_copy'][k]:.1f}x raw copy)")
    for k, v in res["goal_ratio_vs_raw_copy_plus_vllm_load"].items():
        print(f"{k} sync / (raw copy + vLLM reload) = {v:.2f} (goal <= 2)")


if __name__ == "__main__":
    main()
