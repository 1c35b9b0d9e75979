"""Rollout routing replay on mixture-of-experts models: the gap and KL over training with and
without replay, and the cost of carrying routes (``docs/moe.md``, issue 63's benchmarks).

Two models, each in one process with one vLLM engine (routes captured) and fp32 learners:

- ``tiny-moe`` (``cluster/assets.py``): Qwen3-MoE, 2 layers of 8 experts, top-2.
- ``qwen3-30b-a3b-shape``: Qwen3-30B-A3B's routing (128 experts, top-8, renormalised top-k,
  ``moe_intermediate_size`` 768) at reduced width and depth (``--qwen-hidden``, ``--qwen-layers``),
  random weights initialised as the tiny MoE's, built here into the asset cache, never committed.

The source of route mismatch is the real one: the engine computes in bf16 (``--engine-dtype``),
the learner in fp32, from the same weights (every sync sends them in the engine's dtype). With fp32
on both sides the routes match exactly; ``--perturb`` adds the unit tests' stand-in instead (a
small fixed perturbation of the learner's routers).

1. Gap and KL over training. A short GRPO loop: the engine samples ``--prompts`` x ``--samples``
   replies (seeded per step), ``actors.rewards.functions:digit_density`` scores them, the learner
   measures the batch with its old-policy pass (``evaluate_old``) and takes ``train_step``, and the
   new weights are loaded into the engine. Run twice from the same initial weights and seeds:
   ``train.routing_replay=record`` (the learner routes by its own router, routes only measured) and
   ``rollout`` (replay). Per step: |learner - engine| log-prob gap over response tokens (mean,
   max), the KL(engine || learner) estimates k1 = mean(lp_engine - lp_learner) and k3, the
   ``router/*`` metrics, the reward.
2. The cost of carrying routes: bytes per token of ``Experience.routes`` against the pickled
   record without them, and the learner's ``train_step`` time with ``routing_replay`` none,
   record and rollout on the same batch, interleaved rounds, median.

    .venv/bin/python benchmarks/moe_routing.py [--steps 8] [--models tiny-moe,qwen3-30b-a3b-shape]
        [--out docs/results/moe_routing.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pickle
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("record", "rollout")
COST_MODES = ("none", "record", "rollout")
QWEN_NAME = "qwen3-30b-a3b-shape"


# ---------------------------------------------------------------- models


def _qwen3_shape(cache: Path, hidden: int, layers: int, tiny: Path) -> Path:
    """Qwen3-30B-A3B's MoE routing at ``hidden`` x ``layers``, random weights initialised as the
    tiny MoE's (spread gates, experts a real share of the residual), the tiny MoE's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from cluster.assets import init_moe_weights

    folder = cache / f"bench-{QWEN_NAME}-h{hidden}-l{layers}"
    if (folder / "done.json").is_file():
        return folder
    ids = {k: json.loads((tiny / "config.json").read_text())[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    tok = AutoTokenizer.from_pretrained(str(tiny))
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        **ids,
        pad_token_id=tok.pad_token_id,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    )
    model = init_moe_weights(Qwen3MoeForCausalLM(cfg).to(torch.float32))  # the tiny MoE's recipe
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    params = sum(p.numel() for p in model.parameters())
    (folder / "done.json").write_text(json.dumps({"parameters": params}))
    return folder


def _model_info(path: str) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    info = {k: cfg[k] for k in keys} | {"norm_topk_prob": cfg.get("norm_topk_prob"), "vocab_size": cfg["vocab_size"]}
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        info["parameters"] = sum(_numel(f, k) for k in f.keys())
    return info


def _numel(f, key: str) -> int:
    n = 1
    for d in f.get_slice(key).get_shape():
        n *= int(d)
    return n


def _paths(a) -> dict[str, str]:
    from cluster.assets import build_tiny_moe

    cache = Path(os.environ.setdefault("RAYRLHF_CACHE", "/tmp/rayrlhf-cache"))
    tiny = build_tiny_moe(cache)
    out = {}
    for name in a.models.split(","):
        out[name] = str(tiny if name == "tiny-moe" else _qwen3_shape(cache, a.qwen_hidden, a.qwen_layers, tiny))
    return out


# ---------------------------------------------------------------- roles


def _generator(path: str, a):
    from actors.rollout.generator import Generator, GeneratorConfig

    cfg = GeneratorConfig(
        path,
        dtype=a.engine_dtype,
        max_model_len=256,
        max_prompt_tokens=128,
        max_new_tokens=128,
        seed=0,
        threads=1,
        capture_routes=True,
    )
    return Generator(cfg)


def _learner(path: str, mode: str, a):
    """The GRPO learner of ``configs/grpo_tiny_moe.yaml`` (fp32, two epochs of two minibatches, no
    KL), routing replay ``mode``; ``a.perturb``: the unit tests' stand-in for the kernel gap."""
    import torch

    from cluster.config import PPOConfig, TrainConfig
    from learners.base import LearnerContext
    from learners.ppo import PPOLearner
    from learners.training.routing import routers

    tr = TrainConfig(bf16=False, lr=a.lr, epochs=2, num_minibatches=2, micro_batch_size=16, routing_replay=mode)
    ctx = LearnerContext(model_path=path, seed=0, total_steps=a.steps, max_new_tokens=a.new_tokens)
    learner = PPOLearner.build(ctx, tr, PPOConfig(advantage_estimator="grpo", kl_coef=0.0))
    if a.perturb:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for r in routers(learner.model.lm):
                r.weight.add_(a.perturb * torch.randn(r.weight.shape, generator=g))
    return learner


def _sync(learner, gen, dtype: str, probe: list[int]) -> dict:
    """The learner's weights into the engine (the object-store transport's pack and unpack), and
    the sync probe's largest log-prob difference (bf16 engine vs fp32 learner: ~0.1)."""
    from cluster.roles.weight_sync import pack, unpack

    t0 = time.perf_counter()
    with learner.sync_weights() as weights:
        packed = pack(weights, dtype, version=learner.version)
    gen.load_weights(unpack(packed), learner.version)
    seconds = time.perf_counter() - t0
    served, expected = gen.probe_logprobs(probe), learner.probe_logprobs(probe)
    return {"sync_s": seconds, "probe_max_abs": max(abs(x - y) for x, y in zip(served, expected))}


def _prompts(step: int, n: int) -> list[str]:
    rng = random.Random(step)
    return [f"What is {rng.randint(0, 99)} {rng.choice('+-*')} {rng.randint(0, 99)}?" for _ in range(n)]


def _sample(gen, step: int, a):
    """One step's scored batch: the same prompts and sampler seed for every contender."""
    import torch

    from actors.rewards.functions import digit_density

    t0 = time.perf_counter()
    exp = gen.generate(
        _prompts(step, a.prompts), n=a.samples, max_new_tokens=a.new_tokens, temperature=1.0, seed=1000 + step
    )
    gen_s = time.perf_counter() - t0
    scores = digit_density([""] * exp.batch_size, exp.completions)
    return exp.replace(scores=torch.tensor(scores, dtype=torch.float32)), gen_s


# ---------------------------------------------------------------- 1. gap and KL over training


def _pass_stats(learner, exp, routing: str):
    """One old-policy pass (``evaluate_old``) over the batch with the model's routing set to
    ``routing`` ("record": its own router, "rollout": the engine's experts replayed), against the
    engine's log-probs: the gap, the KL(engine || learner) estimates (the samples are the engine's:
    r = pi_learner / pi_engine, k1 = -log r, k3 = r - 1 - log r) and the router's health."""
    learner.model.routing = routing
    lps, _ = learner.evaluate_old(exp)
    router = learner.router_metrics()
    log_r = (lps - exp.rollout_logprobs)[exp.response_mask].double()
    stats = {
        "gap_mean": float(log_r.abs().mean()),
        "gap_max": float(log_r.abs().max()),
        "kl_k1": float((-log_r).mean()),
        "kl_k3": float((log_r.exp() - 1 - log_r).mean()),
        "route_mismatch": router.get("router/route_mismatch", 0.0),
        "fallback_tokens": router.get("router/fallback_tokens", 0.0),
        "replayed_tokens": router.get("router/replayed_tokens", 0.0),
    }
    return stats, log_r


def _measure(learner, exp, mode: str) -> dict:
    """The batch measured both ways on the same weights (paired): own routing and replay. The
    step's headline fields are those of the run's ``mode``; ``route_mismatch`` is the own pass's
    (the engine's experts against the learner's own choice), ``fallback_tokens`` the replay's."""
    own, log_own = _pass_stats(learner, exp, "record")
    rep, log_rep = _pass_stats(learner, exp, "rollout")
    learner.model.routing = mode
    trained = own if mode == "record" else rep
    shift = (log_own - log_rep).abs()
    changed = shift > 1e-5  # tokens whose log-prob the replayed experts move (beyond summation order)
    row = {k: trained[k] for k in ("gap_mean", "gap_max", "kl_k1", "kl_k3")}
    row |= {"route_mismatch": own["route_mismatch"], "fallback_tokens": rep["fallback_tokens"]}
    row |= {"replayed_tokens": rep["replayed_tokens"], "response_tokens": int(exp.response_mask.sum())}
    row |= {f"own/{k}": v for k, v in own.items()} | {f"replay/{k}": v for k, v in rep.items()}
    row["tokens_moved_by_replay"] = int(changed.sum())
    if bool(changed.any()):
        row["moved/gap_mean_own"] = float(log_own[changed].abs().mean())
        row["moved/gap_mean_replay"] = float(log_rep[changed].abs().mean())
        row["moved/shift_mean"] = float(shift[changed].mean())
        row["moved/shift_max"] = float(shift[changed].max())
    return row


def _train_run(gen, path: str, mode: str, a) -> tuple[list[dict], object]:
    """``a.steps`` GRPO steps from the model's initial weights (synced into the engine first, so
    every run starts from the same engine); returns each step's record and the first batch."""
    learner = _learner(path, mode, a)
    probe = gen.encode_prompt("Verified sync probe: 12 + 30 = 42. The quick brown fox jumps over the lazy dog.")
    sync = _sync(learner, gen, a.engine_dtype, probe)
    series, first = [], None
    for step in range(a.steps):
        exp, gen_s = _sample(gen, step, a)
        first = exp if first is None else first
        row = {"step": step, "reward_mean": float(exp.scores.mean()), "gen_s": gen_s, **_measure(learner, exp, mode)}
        t0 = time.perf_counter()
        m = learner.train_step(exp)
        row["train_step_s"] = time.perf_counter() - t0
        for key in (
            "logprob_gap/mean_abs",
            "logprob_gap/kl_k3",
            "router/route_mismatch",
            "router/update_route_mismatch",
        ):
            row["step_metric/" + key] = m.get(key)
        row.update({f"before_{k}": v for k, v in sync.items()})
        sync = _sync(learner, gen, a.engine_dtype, probe)
        series.append(row)
        print(
            f"  {mode:8s} step {step}: reward {row['reward_mean']:.3f} gap own {row['own/gap_mean']:.5f}"
            f"/{row['own/gap_max']:.4f} replay {row['replay/gap_mean']:.5f}/{row['replay/gap_max']:.4f}"
            f" mismatch {row['route_mismatch']:.4f} fallback {row['fallback_tokens']:.0f}"
            f" moved {row['tokens_moved_by_replay']} step {row['train_step_s']:.2f}s",
            flush=True,
        )
    del learner
    gc.collect()
    return series, first


def _run_summary(series: list[dict]) -> dict:
    """A run's means over its steps (maxima for the max gap), as trained and paired."""

    def mean(key: str) -> float:
        return statistics.fmean(r[key] or 0.0 for r in series)

    out = {k: mean(k) for k in ("gap_mean", "kl_k1", "kl_k3", "route_mismatch")}
    out["gap_max"] = max(r["gap_max"] for r in series)
    out["update_route_mismatch"] = mean("step_metric/router/update_route_mismatch")
    out["fallback_tokens"] = sum(r["fallback_tokens"] for r in series)
    out["reward_first"], out["reward_last"] = series[0]["reward_mean"], series[-1]["reward_mean"]
    out["reward_mean"] = mean("reward_mean")
    out["paired"] = _paired_summary(series)
    return out


def _paired_summary(series: list[dict]) -> dict:
    """Own routing against replay on the same weights and batches: mean gap and k3, largest gap,
    and over the tokens whose log-prob replay moves, the mean gap either way (token-weighted)."""
    out = {}
    for side in ("own", "replay"):
        out[f"gap_mean_{side}"] = statistics.fmean(r[f"{side}/gap_mean"] for r in series)
        out[f"gap_max_{side}"] = max(r[f"{side}/gap_max"] for r in series)
        out[f"kl_k3_{side}"] = statistics.fmean(r[f"{side}/kl_k3"] for r in series)
    moved = [r for r in series if r["tokens_moved_by_replay"]]
    n = sum(r["tokens_moved_by_replay"] for r in moved)
    out["tokens_moved_by_replay_frac"] = n / sum(r["response_tokens"] for r in series)
    for key in ("gap_mean_own", "gap_mean_replay", "shift_mean"):
        total = sum(r[f"moved/{key}"] * r["tokens_moved_by_replay"] for r in moved)
        out[f"moved_{key}"] = total / n if n else None
    out["moved_shift_max"] = max((r["moved/shift_max"] for r in moved), default=None)
    out["gap_mean_replay_over_own_ratio"] = out["gap_mean_replay"] / out["gap_mean_own"]
    out["kl_k3_replay_over_own_ratio"] = out["kl_k3_replay"] / out["kl_k3_own"]
    return out


# ---------------------------------------------------------------- 2. the cost of carrying routes


def _carry_cost(exp) -> dict:
    """Routes' bytes per token against the rest of the record's (pickled as the object store
    serialises it, protocol 5), per real token and per padded position."""
    routes = exp.routes
    tokens = int(exp.attention_mask.sum())
    with_routes = len(pickle.dumps(exp, protocol=5))
    without = len(pickle.dumps(dataclasses.replace(exp, routes=None), protocol=5))
    route_bytes = routes.numel() * routes.element_size()
    return {
        "routes_shape": list(routes.shape),
        "routes_dtype": str(routes.dtype),
        "real_tokens": tokens,
        "padded_positions": int(exp.input_ids.numel()),
        "route_bytes_per_position": routes[0, 0].numel() * routes.element_size(),
        "route_bytes_per_token": route_bytes / tokens,
        "record_bytes_per_token_without_routes": without / tokens,
        "record_bytes_per_token_with_routes": with_routes / tokens,
        "routes_share_of_record": (with_routes - without) / with_routes,
        "record_with_over_without_ratio": with_routes / without,
    }


def _step_times(path: str, exp, a) -> dict:
    """``train_step`` seconds on the same batch for each replay mode, one learner per mode, in
    interleaved rounds (order rotated each round); the first round is warm-up, not counted. Each
    step is told the batch is fresh, so every round does the same passes."""
    learners = {mode: _learner(path, mode, a) for mode in COST_MODES}
    times: dict[str, list[float]] = {m: [] for m in COST_MODES}
    shared: dict[str, float] = {}
    for rnd in range(a.timing_rounds + 1):
        order = COST_MODES[rnd % 3 :] + COST_MODES[: rnd % 3]
        for mode in order:
            ln = learners[mode]
            t0 = time.perf_counter()
            m = ln.train_step(exp.replace(policy_version=ln.version))
            if rnd:
                times[mode].append(time.perf_counter() - t0)
            shared[mode] = m.get("learner/prefix_shared_frac", 0.0)
    del learners
    gc.collect()
    med = {m: statistics.median(v) for m, v in times.items()}
    return {
        "train_step_s": times,
        "median_s": med,
        "prefix_shared_frac": shared,
        "rollout_over_none_ratio": med["rollout"] / med["none"],
        "record_over_none_ratio": med["record"] / med["none"],
        "rollout_over_record_ratio": med["rollout"] / med["record"],
        "batch": {"rows": exp.batch_size, "positions": exp.seq_len, "response_tokens": int(exp.response_mask.sum())},
    }


# ---------------------------------------------------------------- driver


def _bench_model(name: str, path: str, a) -> dict:
    print(f"== {name} ({path})", flush=True)
    t0 = time.perf_counter()
    gen = _generator(path, a)
    runs, first = {}, None
    try:
        for mode in MODES:
            runs[mode], batch = _train_run(gen, path, mode, a)
            first = batch if first is None else first
    finally:
        gen.close()
    summary = {mode: _run_summary(series) for mode, series in runs.items()}
    rec, rep = summary["record"], summary["rollout"]
    ratios = {
        f"{k}_rollout_over_record_ratio": rep[k] / rec[k] if rec[k] else None for k in ("gap_mean", "gap_max", "kl_k3")
    }
    paired = _paired_summary(runs["record"] + runs["rollout"])
    print("  timing train_step (none / record / rollout) ...", flush=True)
    cost = {"carry": _carry_cost(first), "step_time": _step_times(path, first, a)}
    return {
        "path": path,
        "model": _model_info(path),
        "summary": summary,
        "ratios": ratios,
        "paired_all_steps": paired,
        "cost": cost,
        "steps": runs,
        "wall_s": time.perf_counter() - t0,
    }


def _host() -> dict:
    import torch
    import transformers
    import vllm

    from learners.training.precision import cpu_has_native_bf16

    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "cpu": _cpu_model(),
        "cpu_has_native_bf16": cpu_has_native_bf16(),
        "software": f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}",
        "python": platform.python_version(),
        "threads": "torch 1, vLLM engine 1 (a shared, noisy host)",
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _headline(models: dict) -> dict:
    """Per model: the run means with and without replay, bytes per token and step-time ratio."""
    out = {}
    for name, r in models.items():
        rec, rep = r["summary"]["record"], r["summary"]["rollout"]
        carry, st = r["cost"]["carry"], r["cost"]["step_time"]
        out[name] = {
            "gap_mean_record": rec["gap_mean"],
            "gap_mean_rollout": rep["gap_mean"],
            "gap_max_record": rec["gap_max"],
            "gap_max_rollout": rep["gap_max"],
            "kl_k3_record": rec["kl_k3"],
            "kl_k3_rollout": rep["kl_k3"],
            "route_mismatch_record": rec["route_mismatch"],
            "route_mismatch_rollout": rep["route_mismatch"],
            "fallback_tokens_rollout": rep["fallback_tokens"],
            "paired_gap_mean_own": r["paired_all_steps"]["gap_mean_own"],
            "paired_gap_mean_replay": r["paired_all_steps"]["gap_mean_replay"],
            "paired_moved_gap_mean_own": r["paired_all_steps"]["moved_gap_mean_own"],
            "paired_moved_gap_mean_replay": r["paired_all_steps"]["moved_gap_mean_replay"],
            "route_bytes_per_token": carry["route_bytes_per_token"],
            "record_with_over_without_ratio": carry["record_with_over_without_ratio"],
            "step_time_rollout_over_none_ratio": st["rollout_over_none_ratio"],
        }
    return out


def _print_table(models: dict) -> None:
    cols = ("gap_mean", "gap_max", "kl_k1", "kl_k3", "route_mismatch", "fallback_tokens", "reward_last")
    print(f"\n{'model':22s} {'mode':8s} " + " ".join(f"{c:>15s}" for c in cols))
    for name, r in models.items():
        for mode, s in r["summary"].items():
            print(f"{name:22s} {mode:8s} " + " ".join(f"{s[c]:15.6g}" for c in cols))
    pcols = ("gap_mean_own", "gap_mean_replay", "gap_max_own", "gap_max_replay", "kl_k3_own", "kl_k3_replay")
    pcols += ("tokens_moved_by_replay_frac", "moved_gap_mean_own", "moved_gap_mean_replay", "moved_shift_mean")
    print(
        f"\npaired (same weights and batch, every step of both runs)\n{'model':22s} "
        + " ".join(f"{c[:15]:>15s}" for c in pcols)
    )
    for name, r in models.items():
        p = r["paired_all_steps"]
        print(f"{name:22s} " + " ".join(f"{p[c] if p[c] is not None else float('nan'):15.6g}" for c in pcols))
    print(
        f"\n{'model':22s} {'route B/tok':>12s} {'record B/tok':>13s} {'with/without':>13s} "
        + "".join(f"{m + ' step s':>16s}" for m in COST_MODES)
        + f"{'rollout/none':>14s}"
    )
    for name, r in models.items():
        c, st = r["cost"]["carry"], r["cost"]["step_time"]
        print(
            f"{name:22s} {c['route_bytes_per_token']:12.2f} {c['record_bytes_per_token_without_routes']:13.1f}"
            f" {c['record_with_over_without_ratio']:13.3f} "
            + "".join(f"{st['median_s'][m]:16.3f}" for m in COST_MODES)
            + f"{st['rollout_over_none_ratio']:14.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=f"tiny-moe,{QWEN_NAME}")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--engine-dtype", default="bfloat16", help="float32 (with --perturb) for the stand-in")
    ap.add_argument("--perturb", type=float, default=0.0, help="std of a fixed noise on the learner's routers")
    ap.add_argument("--qwen-hidden", type=int, default=256)
    ap.add_argument("--qwen-layers", type=int, default=2)
    ap.add_argument("--timing-rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "moe_routing.json"))
    a = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    models = {name: _bench_model(name, path, a) for name, path in _paths(a).items()}
    source = f"learner routers perturbed by N(0, {a.perturb}^2)" if a.perturb else ""
    source = source or f"engine {a.engine_dtype} vs learner float32 kernels, same weights"
    res = {
        **_host(),
        "command": "python benchmarks/moe_routing.py " + " ".join(sys.argv[1:]),
        "mismatch_source": source,
        "summary": _headline(models),
        "settings": {k: v for k, v in vars(a).items() if k != "out"}
        | {"reward": "digit_density", "epochs": 2, "num_minibatches": 2, "kl_coef": 0.0, "train_bf16": False},
        "models": models,
        "wall_s": time.perf_counter() - t0,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    _print_table(models)
    print(f"\nwall {res['wall_s']:.0f}s -> {a.out}")


if __name__ == "__main__":
    main()
