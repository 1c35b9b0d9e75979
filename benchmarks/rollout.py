"""Rollout throughput, side by side in one run: transformers `generate`, a bare vLLM engine,
rayrlhf's Generator class, and the Generator inside a Ray actor (what training uses).

Same model (SmolLM2-135M-Instruct), prompts (reasoning-gym basic_arithmetic, chat template),
dtype (bf16), sampling (temperature 1, logprobs of the sampled tokens), and a fixed number of
new tokens per sequence (EOS ignored) so every contender produces the same token count: the
actor contender runs the training code path (``GeneratorWorker``: the Generator, the record,
its stats) with the same stopping rule as the others, and every contender's tokens are counted
from what it returned.

Scale-out (issue 13): a pool of 2 generator actors with 1 thread each, fed by the training
code's ``GeneratorPool`` (one work unit of half the batch per actor), against two bare 1-thread
engines running at the same time on the two halves, each bound to its own core (``vllm1pair``:
each pool actor at equal work and equal conditions; ``vllm1``: one such engine alone), and
against the single 2-thread actor on the whole batch (scaling 1 -> 2 replicas on the same cores).
``actor2``: the actor as ``rollout.inflight_updates`` runs it, with a second slot for weight loads
(its calls then run on Ray's thread pool, not the actor's main thread). ``vllm_compiled``: the
Generator with ``rollout.compile`` (vLLM's torch.compile) next to the eager one of ``vllm``, and
its start-up (the compile) in seconds.

    .venv/bin/python benchmarks/rollout.py [--batch-sizes 16 64 256] [--new-tokens 64] [--out docs/results/rollout.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts(n: int) -> list[str]:
    from actors.data.tasks import load_prompts

    train, _ = load_prompts(
        "basic_arithmetic",
        max(n, 16),
        1,
        0,
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "Answer with just the final answer.",
    )
    return [r["prompt"] for r in train.rows][:n]


def bench_hf(model_path: str, texts: list[str], new_tokens: int, repeats: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    batch = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
            )
            # The same per-token log-probs a trainer needs (vLLM returns them with logprobs=1).
            steps = torch.stack(gen.scores, 1).float().log_softmax(-1)
            _ = steps.gather(-1, gen.sequences[:, -new_tokens:, None])
        dt = time.perf_counter() - t0
        out.append(len(texts) * new_tokens / dt)
    del model
    gc.collect()
    return out


def bench_bare_vllm(model_path: str, texts: list[str], new_tokens: int, repeats: int, llm=None) -> list[float]:
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    ids = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        for t in texts
    ]
    ids = [x["input_ids"] if isinstance(x, dict) or hasattr(x, "input_ids") else x for x in ids]
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    out = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": list(i)} for i in ids], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        out.append(sum(len(r.outputs[0].token_ids) for r in res) / dt)
    return out


def bench_generator(gen, texts: list[str], new_tokens: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        gen.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        exp = gen.generate(texts, max_new_tokens=new_tokens, max_prompt_tokens=256, ignore_eos=True)
        dt = time.perf_counter() - t0
        out.append(int(exp.response_mask.sum()) / dt)
    return out


def _fixed_length_worker():
    """``GeneratorWorker`` (what training runs in its actor) with one more method: its
    ``generate`` with EOS ignored, the stopping rule of the other contenders."""
    from cluster.roles.workers import GeneratorWorker

    class FixedLengthWorker(GeneratorWorker):
        def generate_fixed(self, rows: list[dict], group_ids: list[int]) -> tuple:
            g = self.gcfg
            t0 = time.perf_counter()
            exp = self._on_engine(
                self.gen.generate,
                [r["prompt"] for r in rows],
                [r["meta"] for r in rows],
                group_ids,
                max_new_tokens=g.max_new_tokens,
                max_prompt_tokens=g.max_prompt_tokens,
                temperature=g.temperature,
                top_p=g.top_p,
                n=1,
                ignore_eos=True,
            )
            return exp, {"seconds": time.perf_counter() - t0, "tokens": int(exp.response_mask.sum())}

    return FixedLengthWorker


def bench_actor(
    model_path: str, texts: list[str], new_tokens: int, repeats: int, batch_sizes: list[int], slots: int = 1
) -> dict:
    """``slots`` 2: the actor as ``rollout.inflight_updates`` runs it (a second slot for weight loads
    and probes, so its calls run on Ray's thread pool rather than the actor's main thread)."""
    import ray

    from cluster.config.role_settings import generator_config, role_env
    from cluster.config.loading import load_config

    cfg = load_config(
        overrides=[
            f"model.max_new_tokens={new_tokens}",
            "model.max_prompt_tokens=256",
            "rollout.temperature=1.0",
            "rollout.kv_cache_gib=2",
        ]
    )
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        actor = (
            ray.remote(_fixed_length_worker())
            .options(num_cpus=1, runtime_env=role_env(0), max_concurrency=slots)
            .remote(generator_config(cfg, model_path))
        )
        ray.get(actor.ready.remote())
        rows = [{"prompt": t, "meta": {}} for t in texts]
        results = {}
        for bs in batch_sizes:
            warm = min(bs, 16)
            ray.get(actor.generate_fixed.options(num_returns=2).remote(rows[:warm], list(range(warm)))[1])  # warm-up
            vals = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                exp_ref, stats_ref = actor.generate_fixed.options(num_returns=2).remote(rows[:bs], list(range(bs)))
                stats = ray.get(stats_ref)
                ray.wait([exp_ref], fetch_local=False)
                assert stats["tokens"] == bs * new_tokens, stats  # the same work as the other contenders
                vals.append(stats["tokens"] / (time.perf_counter() - t0))
            results[bs] = vals
        return results
    finally:
        ray.shutdown()


def bench_pool(
    model_path: str, texts: list[str], new_tokens: int, repeats: int, batch_sizes: list[int], replicas: int = 2
) -> dict:
    """``replicas`` generator actors of 1 thread each (bound to different cores), one work unit
    of ``bs / replicas`` prompts each per batch, through the training code's GeneratorPool."""
    import ray

    from cluster.config.role_settings import generator_config, role_env
    from cluster.config.loading import load_config
    from cluster.roles.rollout_pool import GeneratorPool, Unit, unit_sizes

    cfg = load_config(
        overrides=[
            f"model.max_new_tokens={new_tokens}",
            "model.max_prompt_tokens=256",
            "rollout.temperature=1.0",
            "rollout.kv_cache_gib=2",
            "rollout.threads=1",
            f"rollout.num_generators={replicas}",
        ]
    )
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        cls = ray.remote(_fixed_length_worker())
        actors = [
            cls.options(num_cpus=1, runtime_env=role_env(1)).remote(generator_config(cfg, model_path, i))
            for i in range(replicas)
        ]
        ray.get([g.ready.remote() for g in actors])
        pool = GeneratorPool(
            replicas, lambda g, u: actors[g].generate_fixed.options(num_returns=2).remote(u.rows, u.group_ids)
        )
        rows = [{"prompt": t, "meta": {}} for t in texts]

        def run(bs: int) -> tuple[float, list[float]]:
            units, start = [], 0
            for k, n in enumerate(unit_sizes(bs, replicas, -(-bs // replicas))):
                units.append(Unit(k, rows[start : start + n], list(range(start, start + n)), False, None))
                start += n
            t0 = time.perf_counter()
            batch = pool.submit(units)
            assert pool.wait(batch) == []
            wall = time.perf_counter() - t0
            assert sum(u.result["tokens"] for u in units) == bs * new_tokens  # the same work as the others
            assert sorted(u.result["generator"] for u in units) == list(range(replicas))
            return bs * new_tokens / wall, [u.result["tokens"] / u.result["seconds"] for u in units]

        results = {}
        for bs in batch_sizes:
            run(min(bs, 16))  # warm-up
            totals, per_actor = [], []
            for _ in range(repeats):
                total, each = run(bs)
                totals.append(total)
                per_actor.append(each)
            results[bs] = {"pool_total": totals, "pool_per_actor": per_actor}
        pool.close()
        return results
    finally:
        ray.shutdown()


def _barrier(a, name: str, timeout_s: float = 600) -> None:
    """Waits until every engine of a ``vllm1pair`` run reached ``name`` (files in a shared folder)."""
    if not a.barrier:
        return
    Path(a.barrier, f"{name}.{a.first_core}").touch()
    t0 = time.time()
    while len(list(Path(a.barrier).glob(f"{name}.*"))) < 2:
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"the partner engine never reached {name}")
        time.sleep(0.01)


def run_pair(a) -> dict:
    """Two bare 1-thread engines at once (cores 0 and 1), each on half of every batch."""
    import tempfile

    with tempfile.TemporaryDirectory() as barrier:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--part",
                    "vllm1",
                    "--model",
                    a.model,
                    "--new-tokens",
                    str(a.new_tokens),
                    "--repeats",
                    str(a.repeats),
                    "--first-core",
                    str(core),
                    "--barrier",
                    barrier,
                    "--batch-sizes",
                    *map(str, a.batch_sizes),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for core in (0, 1)
        ]
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a vllm1pair engine failed")
    res = [json.loads(next(x for x in o.splitlines() if x.startswith("RESULT "))[len("RESULT ") :]) for o in outs]
    return {
        str(bs): {"bare_vllm_1thread_pair": [r[str(bs)]["bare_vllm_1thread_half_batch"] for r in res]}
        for bs in a.batch_sizes
    }


def run_part(part: str, a) -> dict:
    """One contender family in this process: 'vllm' (bare engine + Generator class, one engine),
    'actor' (the Generator in a Ray actor) or 'hf' (transformers generate)."""
    from cluster.assets import resolve_model

    model_path = resolve_model(a.model)
    texts = prompts(max(a.batch_sizes))
    if part in ("actor", "actor2"):
        slots = 2 if part == "actor2" else 1
        return {
            str(k): v for k, v in bench_actor(model_path, texts, a.new_tokens, a.repeats, a.batch_sizes, slots).items()
        }
    if part == "pool":
        return {str(k): v for k, v in bench_pool(model_path, texts, a.new_tokens, a.repeats, a.batch_sizes).items()}
    if part == "hf":
        return {
            str(bs): bench_hf(model_path, texts[:bs], a.new_tokens, 1) for bs in a.batch_sizes if bs <= a.skip_hf_above
        }
    from actors.rollout.generator import Generator, GeneratorConfig

    threads = 1 if part == "vllm1" else 0
    compiled = part == "vllm_compiled"
    # The Generator sets vLLM's environment itself (KV cache, threads, cores, compile cache).
    gen = Generator(
        GeneratorConfig(
            model_path,
            dtype="bfloat16",
            max_model_len=256 + a.new_tokens,
            seed=0,
            kv_cache_gib=2,
            threads=threads,
            first_core=a.first_core,
            compile=compiled,
        )
    )
    out = {}
    if part == "vllm1":  # the bare engine on one core, on each pool actor's share of the batch
        for bs in a.batch_sizes:
            half = -(-bs // 2)
            _barrier(a, f"{bs}-warm")
            bench_bare_vllm(model_path, texts[: min(half, 16)], a.new_tokens, 1, llm=gen.llm)  # warm-up
            runs = []
            for r in range(a.repeats):
                _barrier(a, f"{bs}-{r}")  # with a partner engine: both start each run together
                runs += bench_bare_vllm(model_path, texts[:half], a.new_tokens, 1, llm=gen.llm)
            out[str(bs)] = {"bare_vllm_1thread_half_batch": runs}
            print(bs, out[str(bs)], flush=True)
        return out
    for bs in a.batch_sizes:
        bench_generator(gen, texts[: min(bs, 16)], a.new_tokens, 1)  # warm-up
        if compiled:  # next to the eager Generator of part 'vllm', run in its own process
            out[str(bs)] = {
                "generator_compiled": bench_generator(gen, texts[:bs], a.new_tokens, a.repeats),
                "generator_compiled_startup_s": gen.startup_s,
            }
        else:
            out[str(bs)] = {
                "bare_vllm": bench_bare_vllm(model_path, texts[:bs], a.new_tokens, a.repeats, llm=gen.llm),
                "generator": bench_generator(gen, texts[:bs], a.new_tokens, a.repeats),
            }
        print(bs, out[str(bs)], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-hf-above", type=int, default=256, help="transformers generate is slow: skip larger batches")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "rollout.json"))
    ap.add_argument(
        "--part",
        choices=["vllm", "vllm_compiled", "vllm1", "actor", "actor2", "pool", "hf"],
        help="internal: run one contender family, print JSON",
    )
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["vllm", "vllm1", "vllm1pair", "actor", "pool", "hf"],
        help="contender families to run (each in fresh processes)",
    )
    ap.add_argument("--first-core", type=int, default=0, help="internal: the core a 1-thread engine binds to")
    ap.add_argument("--barrier", default="", help="internal: folder the vllm1pair engines meet in")
    a = ap.parse_args()
    if a.part:
        print("RESULT " + json.dumps(run_part(a.part, a)), flush=True)
        return
    # Each family in a fresh process, one after the other: an engine (or its OpenMP threads)
    # left alive in the benchmark process would take cores from the next contender.
    parts: dict = {}
    for part in a.parts:
        if part == "vllm1pair":
            parts[part] = run_pair(a)
            print(part, parts[part], flush=True)
            continue
        cmd = [
            sys.executable,
            __file__,
            "--part",
            part,
            "--model",
            a.model,
            "--new-tokens",
            str(a.new_tokens),
            "--repeats",
            str(a.repeats),
            "--skip-hf-above",
            str(a.skip_hf_above),
            "--batch-sizes",
            *map(str, a.batch_sizes),
        ]
        proc = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        parts[part] = json.loads(line[len("RESULT ") :])
        print(part, parts[part], flush=True)
    results: dict = {
        "model": a.model,
        "dtype": "bfloat16",
        "new_tokens": a.new_tokens,
        "cpus": os.cpu_count(),
        "note": "each contender family ran in its own fresh process",
        "rows": [],
    }
    for bs in a.batch_sizes:
        row: dict = {"batch": bs}
        for part in ("vllm", "vllm_compiled", "vllm1"):
            row.update(parts.get(part, {}).get(str(bs), {}))
        pair = parts.get("vllm1pair", {}).get(str(bs))
        if pair:
            row["bare_vllm_1thread_pair"] = pair["bare_vllm_1thread_pair"]
            row["pair_engine_best"] = [max(runs) for runs in pair["bare_vllm_1thread_pair"]]
        if "actor" in parts:
            row["generator_actor"] = parts["actor"][str(bs)]
        if "actor2" in parts:
            row["generator_actor_2slots"] = parts["actor2"][str(bs)]
        if str(bs) in parts.get("hf", {}):
            row["hf_generate"] = parts["hf"][str(bs)]
        pool = parts.get("pool", {}).get(str(bs))
        if pool:
            row["pool_total"] = pool["pool_total"]
            # Best repeat of each actor of the pool, on its own.
            row["pool_actor_best"] = [
                max(rep[i] for rep in pool["pool_per_actor"]) for i in range(len(pool["pool_per_actor"][0]))
            ]
        best = {
            k: max(v)
            for k, v in row.items()
            if isinstance(v, list) and k not in ("pool_actor_best", "pair_engine_best", "bare_vllm_1thread_pair")
        }
        row["best_tokens_per_s"] = best
        if "hf_generate" in best and "generator_actor" in best:
            row["actor_vs_hf"] = best["generator_actor"] / best["hf_generate"]
        if "generator_actor" in best and "bare_vllm" in best:
            row["actor_vs_bare_vllm"] = best["generator_actor"] / best["bare_vllm"]
        if "generator_compiled" in best and "generator" in best:
            row["compiled_vs_eager_generator"] = best["generator_compiled"] / best["generator"]
        if "generator_actor_2slots" in best and "bare_vllm" in best:
            row["actor_2slots_vs_bare_vllm"] = best["generator_actor_2slots"] / best["bare_vllm"]
        if pool and "bare_vllm_1thread_half_batch" in best:
            row["pool_actor_vs_bare_1thread"] = [
                x / best["bare_vllm_1thread_half_batch"] for x in row["pool_actor_best"]
            ]
        if pool and pair:  # each pool actor against the engine on its core, both pairs running at once
            row["pool_actor_vs_bare_pair"] = [x / y for x, y in zip(row["pool_actor_best"], row["pair_engine_best"])]
        if pool and "generator_actor" in best:
            row["scaling_1_to_2"] = best["pool_total"] / best["generator_actor"]
        results["rows"].append(row)
        print(row, flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
