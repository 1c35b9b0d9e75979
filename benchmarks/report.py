"""The benchmarks page, generated from the results: reads every ``docs/results/*.json`` and writes
``docs/benchmarks.md`` (the method once, then one section per result file: what it measures, a
table of its headline numbers, its host and date where the file records them) and, where
matplotlib is importable, an SVG bar chart of each file's ratios under ``docs/benchmarks/``.

    .venv/bin/python benchmarks/report.py [--results docs/results] [--out docs/benchmarks.md]

A result file this script has no description for still gets a section: a table of its scalar
leaves, so a new benchmark's numbers appear without editing this file. The output is
deterministic (files sorted, fixed float formatting), and ``tests/unit/test_docs.py`` checks that
the committed page is what :func:`render` makes of the committed results. Dated narrative (what
changed between runs and why) lives in ``docs/results-changelog.md``, written by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
PLOTS = "benchmarks"  # folder next to the page, and the prefix of its links

Row = tuple[str, str, object, object]  # contender, measure, value, ratio (None: not given)

RATIO_RE = re.compile(r"ratio|speedup|_over_|_vs_|^vs_|/ratio$|_gain$")
HOST_KEYS = (
    "date",
    "device",
    "machine",
    "cpu",
    "cpus",
    "cores",
    "cpu_bf16",
    "cpu_has_native_bf16",
    "software",
    "host_total_gb",
)
GENERIC_MAX_ROWS = 40


# ---------------------------------------------------------------- formatting


def fmt(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:.0f}"
        return f"{v:.4g}"
    s = str(v).replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= 80 else s[:77] + "..."


def fmt_ratio(v: object) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return fmt(v)
    return f"{v:.3g}x"


def is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def flatten(x: object, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """Scalar leaves as (path, value); a list of numbers becomes its median, a list of dicts is
    indexed by a label field where the dicts have one."""
    if isinstance(x, dict):
        out = []
        for k in x:
            out += flatten(x[k], path + (str(k),))
        return out
    if isinstance(x, list):
        if x and all(is_number(v) for v in x):
            return [(path[:-1] + (f"{path[-1]} (median of {len(x)})",) if path else ("median",), median(x))]
        out = []
        for i, v in enumerate(x):
            label = str(i)
            if isinstance(v, dict):
                for key in ("case", "mode", "name", "algorithm", "contender", "run", "batch", "round"):
                    if key in v and isinstance(v[key], (str, int)):
                        label = f"{v[key]}"
                        if "seed" in v:
                            label += f" seed {v['seed']}"
                        break
                v = {k: w for k, w in v.items() if k not in ("case", "mode", "name", "algorithm", "seed")}
            out += flatten(v, path + (label,))
        return out
    if x is None or (isinstance(x, str) and len(x) > 60):
        return []
    return [(path, x)]


def ratio_path(path: tuple[str, ...]) -> bool:
    return any(RATIO_RE.search(p) for p in path)


def generic_rows(d: object, keys: list[str] | None = None) -> list[Row]:
    if keys is not None and isinstance(d, dict):
        d = {k: d[k] for k in keys if k in d}
    rows = []
    for path, v in flatten(d):
        contender = ".".join(path[:-1])
        if ratio_path(path) and is_number(v):
            rows.append((contender, path[-1], None, v))
        else:
            rows.append((contender, path[-1], v, None))
    return rows


# ---------------------------------------------------------------- extractors


def ex_vs_trl(d: dict) -> list[Row]:
    rows: list[Row] = []
    for name in d:
        v = d[name]
        if isinstance(v, dict) and isinstance(v.get("summary"), dict):
            s = v["summary"]
            for m in ("median_step_s", "completions_per_s", "completions_per_s_steady", "reward_mean_all"):
                if m in s:
                    rows.append((name, m, s[m], None))
    for name in d:
        if name.startswith("heldout_") and isinstance(d[name], dict):
            for c, v in d[name].items():
                rows.append((c, name, v, None))
    for k, v in d.get("ratios", {}).items():
        rows.append(("rayrlhf over TRL", k, None, v))
    return rows


def ex_vs_trl_dpo(d: dict) -> list[Row]:
    rows: list[Row] = []
    for i, rnd in enumerate(d.get("rounds", [])):
        for tool, v in rnd.items():
            s = v.get("summary", {}) if isinstance(v, dict) else {}
            for m in ("pairs_per_s", "pairs_per_s_steady", "loss_last"):
                if m in s:
                    rows.append((f"{tool} (round {i})", m, s[m], None))
    for k, v in d.get("ratios_median", {}).items():
        rows.append(("rayrlhf over TRL (median of rounds)", k, None, v))
    if "max_abs_loss_difference" in d:
        rows.append(("rayrlhf vs TRL", "max_abs_loss_difference", d["max_abs_loss_difference"], None))
    return rows


def _conc(k: str) -> tuple[int, str]:
    return (int(k), k) if k.isdigit() else (1 << 30, k)


def ex_serve_throughput(d: dict) -> list[Row]:
    rows: list[Row] = []
    for server, by_c in d.get("median", {}).items():
        for c in sorted(by_c, key=_conc):
            for m in ("tokens_per_s", "p50_s"):
                if m in by_c[c]:
                    rows.append((server, f"{m} @ concurrency {c}", by_c[c][m], None))
    for key in sorted(k for k in d if k.startswith("ratio_")):
        for c in sorted(d[key], key=_conc):
            for m in ("tokens_per_s", "p50_s"):
                if m in d[key][c]:
                    rows.append((key[len("ratio_") :], f"{m} @ concurrency {c}", None, d[key][c][m]))
    return rows


def ex_rollout(d: dict) -> list[Row]:
    rows: list[Row] = []
    for r in d.get("rows", []):
        b = r.get("batch")
        for c, v in r.get("best_tokens_per_s", {}).items():
            rows.append((c, f"tokens_per_s @ batch {b}", v, None))
        for k, v in r.items():
            if is_number(v) and k != "batch":
                rows.append((k, f"batch {b}", v if k.endswith("_s") else None, None if k.endswith("_s") else v))
    return rows


def ex_weight_sync(d: dict) -> list[Row]:
    ratios = d.get("ratios_vs_raw_copy", {})
    rows: list[Row] = [(k, "median_s", v, ratios.get(k)) for k, v in d.get("median_s", {}).items()]
    for k, v in d.get("goal_ratio_vs_raw_copy_plus_vllm_load", {}).items():
        rows.append((k, "over raw copy + vLLM load", None, v))
    return rows


def ex_lora_sync(d: dict) -> list[Row]:
    rows: list[Row] = []
    for k, s in d.get("summary", {}).items():
        for m in ("bytes", "total_s"):
            if m in s:
                if k.endswith("/ratio"):
                    rows.append((k[: -len("/ratio")] + " adapter over merged", m, None, s[m]))
                else:
                    rows.append((k, m, s[m], None))
    return rows


def ex_median_ratio(d: dict) -> list[Row]:
    """``median: {mode: {measure: v}}`` and ``ratio_A_over_B: {measure: r}``."""
    rows: list[Row] = []
    rkey = next((k for k in d if k.startswith("ratio_")), None)
    num = rkey[len("ratio_") :].split("_over_")[0] if rkey else None
    for mode, ms in d.get("median", {}).items():
        for m, v in ms.items():
            r = d[rkey].get(m) if rkey and num and mode.startswith(num) else None
            rows.append((mode, m, v, r))
    return rows


def ex_summary(d: dict) -> list[Row]:
    """``summary: {contender: {measure: v}}``; the ratio is against the first contender listed."""
    rows: list[Row] = []
    summ = {k: v for k, v in d.get("summary", {}).items() if isinstance(v, dict)}
    base = next(iter(summ.values()), {})
    for i, (c, ms) in enumerate(summ.items()):
        for m, v in ms.items():
            r = None
            if i and is_number(v) and is_number(base.get(m)) and base[m]:
                r = v / base[m]
            rows.append((c, m, v, r))
    for k, v in d.get("ratios", {}).items():
        if is_number(v):
            rows.append(("ratio", k, None, v))
    for k, v in d.get("summary", {}).items():
        if not isinstance(v, dict) and v is not None:
            rows.append(("summary", k, v, None))
    return rows


def _final_eval(ev: dict) -> tuple[str, object] | None:
    steps = sorted((k for k in ev if str(k).isdigit()), key=int)
    return (steps[-1], ev[steps[-1]]) if steps else None


def _eval_rows(name: str, run: dict, base: dict | None) -> list[Row]:
    rows: list[Row] = []
    for key in ("eval_accuracy", "eval_sampled_reward"):
        fe = _final_eval(run.get(key) or {})
        if fe:
            first = _final_eval({"0": (run.get(key) or {}).get("0")}) if "0" in (run.get(key) or {}) else None
            rows.append((name, f"{key} @ step {fe[0]}" + (f" (step 0: {fmt(first[1])})" if first else ""), fe[1], None))
    if "median_step_s" in run:
        r = (
            run["median_step_s"] / base["median_step_s"]
            if base and base is not run and base.get("median_step_s")
            else None
        )
        rows.append((name, "median_step_s", run["median_step_s"], r))
    for k in ("sampled_gain", "greedy_gain"):
        if is_number(run.get(k)):
            rows.append((name, k, run[k], None))
    return rows


def ex_runs_eval(d: dict) -> list[Row]:
    """Preset runs side by side: ``runs: [...]`` (guessing game) or ``{group: {contender: run}}``."""
    rows: list[Row] = []
    if isinstance(d.get("runs"), list):
        for r in d["runs"]:
            name = f"{r.get('algorithm', '?')} seed {r.get('seed', '?')}"
            changes = [c for c in r.get("changes", []) if not str(c).startswith("run.")]
            if r.get("variant"):
                name += f" ({r['variant']})"
            elif changes and r.get("algorithm") != "grpo":
                name += " (" + ", ".join(map(str, changes))[:60] + ")"
            rows += _eval_rows(name, r, None)
        return rows
    runs = {}
    for k, v in d.items():
        if isinstance(v, dict) and "eval_accuracy" in v:
            runs[k] = v
        elif isinstance(v, dict):
            for c, w in v.items():
                if isinstance(w, dict) and "eval_accuracy" in w:
                    runs[f"{k}/{c}"] = w
    base = next(iter(runs.values()), None)
    for name, run in runs.items():
        rows += _eval_rows(name, run, base)
    return rows


def ex_gpu_learner(d: dict) -> list[Row]:
    rows: list[Row] = []
    for r in d.get("results", []):
        steps = r.get("step_s") or []
        if steps:
            rows.append((r["case"], "median step_s", median(steps), None))
        if r.get("gpu_peak_allocated_gb") is not None:
            rows.append((r["case"], "gpu_peak_allocated_gb", r["gpu_peak_allocated_gb"], None))
        if r.get("host_peak_rss_gb") is not None:
            rows.append((r["case"], "host_peak_rss_gb", r["host_peak_rss_gb"], None))
        rows.append((r["case"], "trained", r.get("trained") if r.get("trained") is not None else "not run", None))
    return rows


def ex_async_overlap(d: dict) -> list[Row]:
    rows: list[Row] = []
    for k, v in d.items():
        if isinstance(v, dict) and "step_s_median" in v:
            for m in ("step_s_median", "generate_s_median", "learn_s_median", "reward_mean_last3"):
                rows.append((k, m, v.get(m), None))
    for k in ("ideal_step_s",):
        if k in d:
            rows.append(("ideal", k, d[k], None))
    for k in ("speedup", "speedup_inflight", "ideal_speedup"):
        if k in d:
            rows.append(("async over sync", k, None, d[k]))
    return rows


def ex_calculator(d: dict) -> list[Row]:
    rows: list[Row] = [(k, "held-out accuracy", v.get("accuracy"), None) for k, v in d.get("results", {}).items()]
    for k in ("rl_over_base_no_tools", "rl_minus_sft"):
        if k in d:
            rows.append(
                (
                    "grpo_tools",
                    k,
                    None if k.endswith("over_base_no_tools") else d[k],
                    d[k] if k.endswith("over_base_no_tools") else None,
                )
            )
    return rows


def ex_serve_overhead(d: dict) -> list[Row]:
    """Rounds of contenders: median tokens/s and CPU seconds each, ratios against the first."""
    by: dict[str, dict[str, list[float]]] = {}
    for r in d.get("rounds", []):
        c = by.setdefault(str(r.get("contender")), {})
        for m in ("tokens_per_s", "cpu_s_all"):
            if is_number(r.get(m)):
                c.setdefault(m, []).append(r[m])
    rows: list[Row] = []
    base = next(iter(by.values()), {})
    for i, (c, ms) in enumerate(by.items()):
        for m, xs in ms.items():
            v = median(xs)
            r = v / median(base[m]) if i and base.get(m) and median(base[m]) else None
            rows.append((c, f"{m} (median of {len(xs)})", v, r))
    return rows


def ex_scaling(d: dict) -> list[Row]:
    rows: list[Row] = []
    for p in d.get("projections", []):
        name = f"{p.get('model')} on {p.get('cluster')}"
        for m in ("step_s", "step_s_async", "completions_per_s"):
            if is_number(p.get(m)):
                rows.append((name, m, p[m], None))
    return rows


def ex_keys(*keys: str) -> Callable[[dict], list[Row]]:
    return lambda d: generic_rows(d, list(keys))


def ex_precision(d: dict) -> list[Row]:
    s = d.get("summary", {})
    rows = generic_rows(s)
    mm = s.get("matmul_gflops", {})
    if is_number(mm.get("bf16")) and mm.get("fp32"):
        rows.append(("bf16 over fp32", "matmul_gflops", None, mm["bf16"] / mm["fp32"]))
    g32, g16 = s.get("generate_float32_tokens_per_s"), s.get("generate_bfloat16_tokens_per_s")
    if is_number(g32) and is_number(g16) and g32:
        rows.append(("bf16 over fp32", "generate tokens_per_s", None, g16 / g32))
    return rows


_MOE_MEASURES = (("gap_mean", "paired_gap_mean"), ("moved-token gap_mean", "paired_moved_gap_mean"))


def ex_moe_routing(d: dict) -> list[Row]:
    """Per model: the paired log-prob gap (learner's own routes vs the engine's replayed, same
    batch), the KL and route mismatch of each run, and the cost of carrying routes."""
    rows: list[Row] = []
    for model, s in d.get("summary", {}).items():
        for label, key in _MOE_MEASURES:
            own, rep = s.get(key + "_own"), s.get(key + "_replay")
            rows.append((f"{model} own routes", label, own, None))
            ratio = rep / own if is_number(rep) and is_number(own) and own else None
            rows.append((f"{model} replayed", label, rep, ratio))
        for m in ("kl_k3", "route_mismatch"):
            rows.append((f"{model} record run", m, s.get(m + "_record"), None))
            rows.append((f"{model} replay run", m, s.get(m + "_rollout"), None))
        rows.append((f"{model} replay run", "fallback_tokens", s.get("fallback_tokens_rollout"), None))
        rows.append((f"{model} routes", "bytes_per_token", s.get("route_bytes_per_token"), None))
        rows.append(
            (f"{model} record with routes over without", "bytes", None, s.get("record_with_over_without_ratio"))
        )
        rows.append((f"{model} replay over none", "train_step_s", None, s.get("step_time_rollout_over_none_ratio")))
    return rows


# ---------------------------------------------------------------- descriptions

Spec = tuple[str, str, str, Callable[[dict], list[Row]]]  # title, script, description, extractor

VS_TRL = (
    "End to end against TRL",
    "vs_trl.py",
    "rayrlhf GRPO and TRL's `GRPOTrainer` on the same workload in one run: SmolLM2-135M-Instruct, "
    "reasoning-gym basic_arithmetic, the same prompts in the same order, prompts per step, samples per "
    "prompt, completion length, sampling, reward and learning rate. Each contender's median step time, "
    "completions per second, train reward and held-out greedy accuracy; the ratios are rayrlhf's "
    "throughput over TRL's (step time: TRL's over rayrlhf's, so above 1 rayrlhf is faster). Variants "
    "(`_colocate`: TRL generating with vLLM colocated; `_compiled`, `_realtime`, `_skip_zero_advantage`: "
    "rayrlhf options on; `_repeat`, `_epyc_avx512`: the same again, another hour or host) differ in the "
    "settings recorded in the file.",
    ex_vs_trl,
)

BENCHMARKS: dict[str, Spec] = {
    "vs_trl": VS_TRL,
    "vs_trl_agents": (
        "End to end against TRL, multi-turn",
        "vs_trl_agents.py",
        "The multi-turn counterpart of `vs_trl`: rayrlhf GRPO and TRL's `GRPOTrainer` "
        "(`rollout_func`, vLLM colocated) on the same guessing game (1..16, four guesses, "
        '"Higher."/"Lower." after each), the same episodes per step and tokens per turn. '
        "Ratios: rayrlhf's throughput over TRL's.",
        ex_vs_trl,
    ),
    "vs_trl_dpo": (
        "Offline DPO against TRL",
        "vs_trl_dpo.py",
        "rayrlhf DPO and TRL's `DPOTrainer` on the same preference pairs in the same order, pairs "
        "per step, precision and loss (sigmoid DPO, reference log-probs computed once). Pairs per "
        "second per round; the ratios are rayrlhf's over TRL's, median of the rounds; the loss "
        "difference checks both trained the same thing.",
        ex_vs_trl_dpo,
    ),
    "rollout": (
        "Rollout throughput",
        "rollout.py",
        "Tokens per second generating the same prompts with the same sampling and a fixed number of new "
        "tokens: a bare vLLM engine, rayrlhf's Generator, the Generator inside a Ray actor (what "
        "training uses) and a pool of two generator actors, each family in its own fresh process. "
        "Ratios: the actor over the bare engine, a pool actor over a bare one-thread engine, and 1 -> 2 "
        "replicas (`_inflight`: with in-flight weight updates; `_compiled`: `rollout.compile`).",
        ex_rollout,
    ),
    "weight_sync": (
        "Weight sync per transport",
        "weight_sync.py",
        "Seconds per weight sync of SmolLM2-135M (bf16 on the wire), per transport, next to a raw "
        "in-memory copy (the floor): the learner's pack, the object store (flat buffer or a dict of "
        "tensors), vLLM's load inside the generator actor, and the gloo collective end to end. Ratios "
        "against the raw copy, and the goal's ratio against the raw copy plus vLLM's own load.",
        ex_weight_sync,
    ),
    "lora_sync": (
        "LoRA syncs, adapter-only vs merged",
        "lora_sync.py",
        "Bytes and seconds of one weight sync with LoRA on every linear layer at r = 8 and 64: the "
        "adapter's factors only (`lora.sync: adapter`, merged on the generator) against every merged "
        "weight (`lora.sync: merged`), in one process on the same cores.",
        ex_lora_sync,
    ),
    "start_up": (
        "A run's start-up, the cyclic GC",
        "start_up.py",
        "Time to a run's first step, and the process's wall time, with `cluster.lighter_gc` on (the "
        "default) and off: `rayrlhf train configs/ppo_tiny.yaml` as a user runs it, the two "
        "alternated after a warm-up. Ratio: lighter GC over the default.",
        ex_median_ratio,
    ),
    "streaming_prompts": (
        "A 1-million-row prompt file, streamed vs read whole",
        "streaming_prompts.py",
        "Time to the first step and the driver's peak memory with a large Parquet prompt file, "
        "read whole (`data.streaming=false`) or streamed with Ray Data (`data.streaming=true`), "
        "alternated. Ratio: streamed over whole.",
        ex_median_ratio,
    ),
    "tool_sandbox": (
        "The python tool's sandbox",
        "tool_sandbox.py",
        "The python tool's cost per call, sandboxed with bubblewrap against the former unsandboxed "
        "subprocess (`env.python_sandbox: unsafe`), alternated round by round: the latency of one "
        "call at a time and the throughput of parallel calls.",
        ex_keys("latency_ms", "calls_per_s", "ratios"),
    ),
    "agent_rollout": (
        "Multi-turn rollouts",
        "agent_rollout.py",
        "Multi-turn episodes per second on one engine: `continuous` (each episode's next turn joins "
        "vLLM's running batch as soon as its environment answered) against `lockstep` (turn k of every "
        "episode as one batch), and a slow tool against an instant one (`_slow_env`: a 1 s tool).",
        ex_keys("episodes_per_s", "continuous_over_lockstep", "slow_tool_over_instant"),
    ),
    "agent_clients": (
        "Agent programs by client, and OpenEnv over WebSocket",
        "agent_clients.py",
        "Agent rollout throughput by client on one engine (threads or asyncio, chat or Responses "
        "API, streamed or not), every contender playing the same episodes with the same seeded "
        "sampling, and an OpenEnv environment over WebSocket against the same environment "
        "in-process.",
        ex_keys("episodes_per_s", "ratios"),
    ),
    "moe_routing": (
        "Mixture of experts: rollout routing replay",
        "moe_routing.py",
        "A short GRPO run on a MoE model with routes recorded but not replayed "
        "(`train.routing_replay: record`) and with them replayed (`rollout`), the engine in bf16 "
        "and the learner in fp32 on the same weights: the tiny MoE test model and a random-weight "
        "Qwen3-MoE with Qwen3-30B-A3B's routing (128 experts, top-8) at reduced width. Paired: "
        "the same batch scored with the learner's own routes and with the engine's (ratio: "
        "replayed over own; moved tokens: those whose experts replay changes). Cost: route bytes "
        "per token through the object store, and the learner's step time with replay over without.",
        ex_moe_routing,
    ),
    "async_overlap": (
        "Synchronous vs asynchronous steps",
        "async_overlap.py",
        "GRPO step time on `configs/grpo_smollm2.yaml` with `rollout.max_staleness=0` (generate, then "
        "learn) and 1 (generation overlapping the update, also with in-flight weight updates), one "
        "after the other in fresh processes; the ideal is the longer of the two phases. Ratios: the "
        "sync step over the async one (above 1 async is faster).",
        ex_async_overlap,
    ),
    "reward_model_prefix": (
        "Reward model: a pair's prompt run once",
        "reward_model_prefix.py",
        "Bradley-Terry reward-model training with and without a pair's shared prompt run once "
        "(`train.shared_prefix`), the same pairs and steps; the loss gap checks both train the "
        "same thing.",
        ex_keys("median_step_s_after_first", "speedup", "max_loss_gap"),
    ),
    "serve_throughput": (
        "Policy server throughput",
        "serve_throughput.py",
        "rayrlhf's policy server (Ray Serve) against vLLM's own OpenAI server on the same model and "
        "machine, the same chat requests at each concurrency (64 tokens each), several starts. "
        "Median tokens per second and p50 latency; ratios: the policy server over vLLM's server "
        "(tokens/s above 1 and p50 below 1 favour the policy server). The file name's suffix names "
        "the layout, host or setting of that run.",
        ex_serve_throughput,
    ),
    "serve_overhead": (
        "Where the policy server's CPU goes",
        "serve_overhead.py",
        "The bare vLLM server and the policy server under Ray settings that change what Ray's own "
        "processes do while the engine serves: one round of 128 chat requests at concurrency 32 "
        "each, with each process's CPU seconds. Ratios: against the first contender (the bare "
        "server).",
        ex_serve_overhead,
    ),
    "scaling": (
        "Scaling on paper",
        "scaling_model.py",
        "A roofline model of one synchronous RL step (generate, score, reference, learn, sync) calibrated "
        "on the measured phases of `vs_trl.json`, projected to larger models and GPU clusters: step time "
        "and completions per second per projection. A model, not a measurement.",
        ex_scaling,
    ),
    "sharded_learners": (
        "Sharded learners",
        "sharded_learners.py",
        "Peak memory per learner worker and step time, replicated against sharded "
        "(`train.sharding: fsdp`) learners of SmolLM2-135M, 1 and 2 workers on the same cores, the "
        "GRPO preset's batch (`_checkpointed`: with gradient checkpointing). Ratios: FSDP over "
        "replicated at 2 workers.",
        ex_summary,
    ),
    "learner_memory": (
        "Memory and step time of the learner",
        "learner_memory.py",
        "Peak memory (RSS) and step time of one learner update of SmolLM2-135M, contender by "
        "contender in fresh processes (full fine-tuning, its options, LoRA). Ratios: against the "
        "first contender listed.",
        ex_summary,
    ),
    "precision": (
        "Precision on CPUs without native bf16",
        "precision.py",
        "bf16 against fp32 on the CPU, precisions alternating round by round: a matrix multiply's "
        "GFLOP/s, generation tokens per second and a learner step; what `auto` precision decides "
        "from.",
        ex_precision,
    ),
    "gpu_learner": (
        "The sharded learner on one GPU",
        "gpu_learner.py",
        "The sharded learner alone (no Ray, no vLLM) on one GPU: step time, GPU and host memory, and the "
        "largest model that trains with its state offloaded to host memory (`train.cpu_offload`).",
        ex_gpu_learner,
    ),
    "calculator": (
        "The calculator preset",
        "calculator.py",
        "Held-out accuracy of `configs/calculator_smollm2.yaml`: the base model without tools, with the "
        "calculator, after the SFT stage and after multi-turn GRPO, all greedy on the same held-out "
        "prompts with the same checker.",
        ex_calculator,
    ),
    "guess_game": (
        "The guessing game: GRPO and token-level Q-learning",
        "guess_game.py",
        "The guessing game learnt by multi-turn GRPO (`configs/grpo_guess_smollm2.yaml`) and token-level "
        "Q-learning (`configs/qlearn_guess_smollm2.yaml`) with the same seeds, steps and held-out games: "
        "greedy accuracy and sampled reward on the 64 held-out games, median step time. The suffix names "
        "the Q-learning variant tried (`--qlearn-set`).",
        ex_runs_eval,
    ),
    "objectives": (
        "Policy objectives on the GRPO preset",
        "objectives.py",
        "GRPO, GSPO, CISPO and DAPO from the same start with the same seed, prompts and steps on "
        "`configs/grpo_smollm2.yaml`: held-out greedy accuracy, median step time (ratio against the "
        "first listed).",
        ex_runs_eval,
    ),
    "critic": (
        "PPO: a separate critic vs the shared value head",
        "objectives.py",
        "`benchmarks/objectives.py --critic`: PPO with the shared value head against a separate critic, "
        "same start, seed and steps: held-out greedy accuracy and median step time (ratio against the "
        "first listed).",
        ex_runs_eval,
    ),
    "distill": (
        "On-policy distillation vs GRPO",
        "distill.py",
        "A teacher (the SFT preset trained further), the student distilled from it on-policy, and GRPO, "
        "from the same start on basic_arithmetic: held-out greedy accuracy on 128 prompts and median step "
        "time (ratio against the teacher's).",
        ex_runs_eval,
    ),
}


for _stem in (
    "learner_attention",
    "learner_compile_option",
    "learner_critic_micro_batches",
    "learner_grpo_options",
    "learner_options",
    "learner_packed",
    "learner_step_options",
):
    BENCHMARKS[_stem] = BENCHMARKS["learner_memory"]  # the same script's contenders, another set


def spec_for(stem: str) -> Spec | None:
    """The description of a result file: its stem, else the longest key it extends (``key_...``)."""
    if stem in BENCHMARKS:
        return BENCHMARKS[stem]
    keys = [k for k in BENCHMARKS if stem.startswith(k + "_")]
    return BENCHMARKS[max(keys, key=len)] if keys else None


# ---------------------------------------------------------------- page

METHOD = """\
# Benchmarks

Generated by `benchmarks/report.py` from `docs/results/*.json`; do not edit by hand
(`.venv/bin/python benchmarks/report.py` rewrites this page and its plots). What changed between
runs, and why, is in the [results changelog](results-changelog.md).

## Method

- **Side by side, in one run.** Each benchmark runs its contenders in the same invocation on the
  same machine, alternating or in fresh processes as its script describes, so they see the same
  machine state.
- **The same work.** Contenders get the same model, prompts, sampling, token counts and steps;
  a contender that does less work is not compared.
- **Ratios, not absolute times.** The machines are shared and repeat runs vary by 10-20%; compare
  the ratios within one file, not absolute seconds across files or hosts. Unless a table says
  otherwise a ratio is the first contender named over the second (throughput: above 1 is faster;
  times: below 1 is faster); where a file records no ratio, ratios are against the first
  contender listed.
- **The host is noted** where the result file records it (CPU, cores, device, date). Most CPU
  results come from a 2-core x86-64 machine without a GPU, SmolLM2-135M-Instruct, November and
  December 2026.
- **Rerun** with `.venv/bin/python benchmarks/<name>.py` as each script's docstring says (its
  `--out` names the result file), then `.venv/bin/python benchmarks/report.py`.

Values: 4 significant digits; ratios: 3. A list of samples is shown as its median.
"""


def _host_line(d: object) -> str:
    if not isinstance(d, dict):
        return ""
    found = {}
    for src in (d, d.get("settings") if isinstance(d.get("settings"), dict) else {}):
        for k in HOST_KEYS:
            if k in src and k not in found and not isinstance(src[k], (dict, list)):
                found[k] = src[k]
    if not found:
        return "Host and date: not recorded in the file."
    return "Host: " + "; ".join(f"{k} {fmt(found[k])}" for k in HOST_KEYS if k in found) + "."


def _table(rows: list[Row]) -> str:
    out = ["| contender | measure | value | ratio |", "|---|---|---|---|"]
    for c, m, v, r in rows:
        out.append(f"| {fmt(c) or '—'} | {fmt(m)} | {fmt(v)} | {fmt_ratio(r) if r is not None else ''} |")
    return "\n".join(out)


def load(results: Path) -> dict[str, object]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def headline(stem: str, d: object) -> tuple[Spec | None, list[Row], int]:
    """The file's spec, its table rows and how many generic rows were left off."""
    spec = spec_for(stem)
    if spec is not None and isinstance(d, dict):
        try:
            rows = spec[3](d)
        except (KeyError, TypeError, AttributeError, ValueError, ZeroDivisionError):
            rows = []
        if rows:
            return spec, rows, 0
    rows = generic_rows(d)
    return None, rows[:GENERIC_MAX_ROWS], max(0, len(rows) - GENERIC_MAX_ROWS)


def ratios_of(rows: list[Row]) -> list[tuple[str, float]]:
    return [(f"{c} {m}".strip(), float(r)) for c, m, _, r in rows if is_number(r) and r > 0 and math.isfinite(r)]


def plot_name(stem: str) -> str:
    return f"{PLOTS}/{stem}.svg"


def render(results: Path = RESULTS, page_dir: Path | None = None) -> str:
    """The page for the result files in ``results``; a plot is linked where its SVG exists under
    ``page_dir`` (the page's folder, by default the one ``results`` sits in)."""
    page_dir = page_dir if page_dir is not None else results.parent
    data = load(results)
    groups: dict[str, list[str]] = {}
    for stem in data:
        spec, _, _ = headline(stem, data[stem])
        groups.setdefault(f"{spec[0]}\0{spec[1]}\0{spec[2]}" if spec else "", []).append(stem)
    parts = [METHOD]
    toc = ["## Contents", ""]
    order = [f"{v[0]}\0{v[1]}\0{v[2]}" for v in BENCHMARKS.values()]
    described = sorted((g for g in groups if g), key=order.index)  # the table's order
    for g in described + ([""] if "" in groups else []):
        title = g.split("\0")[0] if g else "Other results"
        toc.append(f"- {title}: " + ", ".join(f"[{s}](#{s})" for s in groups[g]))
    parts.append("\n".join(toc) + "\n")
    for g in described + ([""] if "" in groups else []):
        if g:
            title, script, desc = g.split("\0")
            sec = [
                f"## {title}",
                "",
                desc,
                "",
                f"Script: `benchmarks/{script}`; rerun: `.venv/bin/python benchmarks/{script}`.",
                "",
            ]
        else:
            sec = [
                "## Other results",
                "",
                "Result files `benchmarks/report.py` has no description for: each table lists the file's "
                "scalar leaves (a ratio where the key names one). Their context is in the "
                "[results changelog](results-changelog.md).",
                "",
            ]
        for stem in groups[g]:
            d = data[stem]
            _, rows, left = headline(stem, d)
            sec += [f"### {stem}", "", f"`docs/results/{stem}.json`. {_host_line(d)}"]
            if isinstance(d, dict):
                for k in ("what", "note"):
                    if isinstance(d.get(k), str):
                        sec[-1] += f" {k.capitalize()}: {fmt(d[k]) if len(d[k]) <= 80 else d[k].replace(chr(10), ' ')}"
            sec += ["", _table(rows) if rows else "No scalar values.", ""]
            if left:
                sec += [f"{left} more values in the file.", ""]
            if ratios_of(rows) and (page_dir / plot_name(stem)).is_file():
                sec += [f"![ratios of {stem}]({plot_name(stem)})", ""]
        parts.append("\n".join(sec))
    return "\n".join(parts).rstrip() + "\n"


def write_plots(results: Path, page_dir: Path) -> int:
    """SVG bar charts of each file's ratios; 0 when matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    plt.rcParams["svg.hashsalt"] = "rayrlhf"
    plt.rcParams["svg.fonttype"] = "none"
    out = page_dir / PLOTS
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for stem, d in load(results).items():
        _, rows, _ = headline(stem, d)
        rs = ratios_of(rows)
        if not rs:
            continue
        fig, ax = plt.subplots(figsize=(7, 0.3 * len(rs) + 1.0))
        labels = [lab if len(lab) <= 60 else lab[:57] + "..." for lab, _ in rs]
        ax.barh(range(len(rs)), [v for _, v in rs], color=["#3b7dd8" if v >= 1 else "#d8833b" for _, v in rs])
        ax.set_yticks(range(len(rs)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("ratio (log scale; 1 = parity)", fontsize=8)
        ax.set_title(stem, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.svg", format="svg", metadata={"Date": None})
        plt.close(fig)
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=PAGE)
    args = ap.parse_args(argv)
    n = write_plots(args.results, args.out.parent)
    args.out.write_text(render(args.results, args.out.parent))
    print(f"wrote {args.out} ({n} plots)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
