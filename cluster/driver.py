"""The PPO driver: generate -> score -> reference log-probs -> learn -> sync weights.

The driver holds prompts, ObjectRefs and small stats dicts; experience tensors and weights move
between actors through the object store and never pass through this process.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import ray

from actors.tasks import load_prompts
from cluster.actor_groups import RolloutGroup
from cluster.assets import resolve_model
from cluster.config import Config
from cluster.learner_group import LearnerGroup
from cluster.metrics import RunLog

log = logging.getLogger("rayrlhf.driver")


@dataclass
class RunResult:
    run_dir: Path
    history: list[dict[str, Any]]
    final_checkpoint: Path | None
    seconds: float


def connect(cfg: Config) -> bool:
    """Joins the configured / ambient cluster, else starts a local one. True if we started it."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    # Job-wide default for every worker, Ray Train's included: Ray would otherwise pin each
    # process's OpenMP pool to its reserved CPUs (often 1); the roles work one phase at a time.
    env_vars = {
        "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(cfg.cluster.threads or os.cpu_count() or 1),
    }
    if address:
        ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
        return False
    needed = (
        cfg.rollout.num_generators * cfg.rollout.cpus_per_generator
        + cfg.cluster.num_learners * cfg.cluster.cpus_per_learner
        + cfg.cluster.cpus_per_reference
        + 1
    )
    num_cpus = cfg.cluster.num_cpus or max(os.cpu_count() or 1, math.ceil(needed))
    kwargs: dict[str, Any] = dict(
        num_cpus=num_cpus, include_dashboard=cfg.cluster.include_dashboard,
        dashboard_host=cfg.cluster.dashboard_host, runtime_env={"env_vars": env_vars},
    )
    if cfg.cluster.temp_dir:
        kwargs["_temp_dir"] = cfg.cluster.temp_dir
    ray.init(**kwargs)
    return True


class PromptSampler:
    """Epoch-wise shuffled prompts; each prompt's samples share its dataset index as group id."""

    def __init__(self, rows: list[dict], per_step: int, seed: int) -> None:
        self.rows = rows
        self.per_step = per_step
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def next(self) -> tuple[list[dict], list[int]]:
        while len(self.order) < self.per_step:
            perm = list(range(len(self.rows)))
            self.rng.shuffle(perm)
            self.order.extend(perm)
        idx, self.order = self.order[: self.per_step], self.order[self.per_step :]
        return [self.rows[i] for i in idx], idx


def _merge_counts(stats: list[dict], key: str = "skipped") -> dict[str, int]:
    out: dict[str, int] = {}
    for s in stats:
        for k, v in s.get(key, {}).items():
            out[k] = out.get(k, 0) + int(v)
    return out


def evaluate(rollout: RolloutGroup, rows: list[dict]) -> dict[str, float]:
    """Greedy accuracy on held-out prompts (score >= 1 counts as solved)."""
    if not rows:
        return {}
    t0 = time.perf_counter()
    exp_refs, _ = rollout.generate(rows, list(range(len(rows))), greedy=True)
    _, score_stats = rollout.score(exp_refs)
    scores = [x for s in ray.get(score_stats) for x in s["scores"]]
    return {
        "eval/accuracy": sum(1.0 for x in scores if x >= 1.0) / max(len(scores), 1),
        "eval/mean_score": sum(scores) / max(len(scores), 1),
        "eval/n": float(len(scores)),
        "time/eval_s": time.perf_counter() - t0,
    }


def train(cfg: Config, run_dir: str | Path | None = None) -> RunResult:
    t_start = time.time()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_path = Path(run_dir) if run_dir else Path(cfg.run.output_dir) / f"{cfg.run.name}-{stamp}"
    runlog = RunLog(run_path, cfg.run.steps)
    runlog.save_config(cfg.to_dict())
    print(f"[rayrlhf] run directory: {run_path.resolve()}", flush=True)

    model_path = resolve_model(cfg.model.path, cfg.model.cache_dir or None)
    train_set, eval_set = load_prompts(
        cfg.data.task, cfg.data.train_size, cfg.data.eval_size, cfg.run.seed, cfg.data.task_kwargs, cfg.data.instruction
    )
    print(f"[rayrlhf] {len(train_set)} train / {len(eval_set)} held-out prompts from {cfg.data.task}"
          + (f" (skipped while loading: {train_set.skipped})" if train_set.skipped else ""), flush=True)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    started_here = connect(cfg)
    t0 = time.time()
    rollout = RolloutGroup(cfg, model_path)
    learners = LearnerGroup(cfg, model_path, pad_id, run_path / "ray_train")
    rollout.wait_ready()
    info = learners.wait_ready()
    if not cfg.ppo.uses_reference:
        ref_role = "no reference (no KL term)"
    elif cfg.lora.enabled:
        ref_role = "reference = base model with the LoRA adapter disabled, in the learner"
    else:
        ref_role = "1 reference"
    print(f"[rayrlhf] roles ready in {time.time() - t0:.1f}s: {cfg.rollout.num_generators} generator(s), "
          f"1 scorer, {ref_role}, {cfg.cluster.num_learners} learner(s); "
          f"{cfg.ppo.advantage_estimator} advantages, trainable fraction {info['trainable_fraction']:.4f}", flush=True)

    sampler = PromptSampler(train_set.rows, cfg.rollout.prompts_per_step, cfg.run.seed)
    final: Path | None = None
    try:
        for step in range(1, cfg.run.steps + 1):
            row: dict[str, Any] = {"step": step, "skipped_at_load": dict(train_set.skipped)}
            rows, group_ids = sampler.next()

            t = time.perf_counter()
            exp_refs, gen_stats_refs = rollout.generate(rows, group_ids)
            gen_stats = ray.get(gen_stats_refs)
            row["time/generate_s"] = time.perf_counter() - t

            t = time.perf_counter()
            exp_refs, score_stats_refs = rollout.score(exp_refs)
            score_stats = ray.get(score_stats_refs)
            row["time/score_s"] = time.perf_counter() - t

            t = time.perf_counter()
            exp_refs, ref_stats_refs = rollout.annotate_reference(exp_refs)
            ref_stats = ray.get(ref_stats_refs)
            row["time/reference_s"] = time.perf_counter() - t
            row["reference/in_learner"] = rollout.reference is None and cfg.ppo.uses_reference

            last = step == cfg.run.steps
            save = (cfg.run.save_every and step % cfg.run.save_every == 0) or (last and cfg.run.save_final)
            save_dir = str((run_path / "checkpoints" / f"step_{step:05d}").resolve()) if save else None
            t = time.perf_counter()
            result = learners.learn(step, exp_refs, save_dir=save_dir)
            row["time/learn_s"] = time.perf_counter() - t
            row["learner/trainable_fraction"] = info["trainable_fraction"]

            t = time.perf_counter()
            load_times = rollout.sync_weights(result["weights"][0])
            row["time/sync_s"] = time.perf_counter() - t
            row["sync/load_s"] = max(load_times)

            row.update(_step_metrics(gen_stats, score_stats, result["metrics"]))
            row["memory/generator_peak_gb"] = max(s["peak_rss_gb"] for s in gen_stats)
            row["memory/scorer_peak_gb"] = max(s["peak_rss_gb"] for s in score_stats)
            if ref_stats:
                row["memory/reference_peak_gb"] = max(s["peak_rss_gb"] for s in ref_stats)
            if result.get("saved"):
                final = Path(result["saved"])
                row["checkpoint"] = result["saved"]
            if cfg.run.eval_every and (step % cfg.run.eval_every == 0 or last or step == 1):
                row.update(evaluate(rollout, eval_set.rows))
            row["time/step_s"] = sum(row[k] for k in ("time/generate_s", "time/score_s", "time/reference_s", "time/learn_s", "time/sync_s"))
            row["time/elapsed_s"] = time.time() - t_start
            runlog.log(row)
            runlog.progress(row)
    finally:
        learners.stop()
        rollout.shutdown()
        if started_here:
            ray.shutdown()
    if cfg.run.plot:
        runlog.plot()
    seconds = time.time() - t_start
    print(f"[rayrlhf] done in {seconds:.0f}s; metrics: {runlog.path}" + (f"; checkpoint: {final}" if final else ""), flush=True)
    return RunResult(run_path, runlog.rows, final, seconds)


def _step_metrics(gen_stats: list[dict], score_stats: list[dict], learner: dict[str, float]) -> dict[str, Any]:
    lengths = [x for s in gen_stats for x in s["response_lengths"]]
    scores = [x for s in score_stats for x in s["scores"]]
    gen_s = max(s["seconds"] for s in gen_stats)
    tokens = sum(s["tokens"] for s in gen_stats)
    n = max(len(scores), 1)
    mean = sum(scores) / n
    out: dict[str, Any] = {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((x - mean) ** 2 for x in scores) / n),
        "reward/n": len(scores),
        "response/length_mean": sum(lengths) / max(len(lengths), 1),
        "response/truncated_frac": sum(s["truncated"] for s in gen_stats) / max(len(lengths), 1),
        "generate/tokens": tokens,
        "generate/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "generate/policy_version": min(s["policy_version"] for s in gen_stats),
        "skipped": _merge_counts(score_stats),
        "sample": gen_stats[0]["samples"][:1],
    }
    out.update({k: v for k, v in learner.items() if k != "response/length_mean"})
    return out
