"""Offline DPO recipe (Rafailov et al. 2023, sec. 4 and 5):

    pairs       <- preference rows (JSONL / Parquet), checked, counted, split, tokenised
    ref logps   <- the reference model scores every pair once (cached beside the run as Parquet)
    for each step:
        batch    <- the next pairs_per_step pairs
        learners <- DPO-family update on the batch
        every eval_every steps: held-out loss, reward accuracy and margin

No generator runs: the data is fixed, so no weights are synced. With LoRA the learners score
the reference themselves (the adapter disabled) and no Reference actor starts; SimPO needs no
reference at all.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import ray
import torch

from actors.offline_data import PreferenceSet, encode_pairs, read_preferences, write_preferences
from cluster.actor_groups import ReferenceWorker, reference_config, role_env
from cluster.config import Config, UserError
from cluster.learner_group import LearnerGroup, learner_spec
from cluster.run_context import PromptSampler, RunContext, RunResult
from learners.experience import Experience

REFERENCE_CACHE = "data/reference_logprobs.parquet"


def load_data(cfg: Config) -> tuple[PreferenceSet, PreferenceSet, str]:
    """Train and held-out pairs of ``data.preference_file`` (a seeded shuffle, then a split)."""
    try:
        prefs = read_preferences(cfg.data.preference_file)
    except FileNotFoundError as e:
        raise UserError(f"data.preference_file: {e}") from None
    rows = list(prefs.rows)
    random.Random(cfg.run.seed).shuffle(rows)
    held, train = rows[: cfg.data.eval_size], rows[cfg.data.eval_size :]
    if len(train) < cfg.dpo.pairs_per_step:
        raise UserError(f"data.preference_file: {len(train)} usable training pairs, fewer than dpo.pairs_per_step="
                        f"{cfg.dpo.pairs_per_step} (skipped while loading: {prefs.skipped})")
    description = (f"{len(train)} train / {len(held)} held-out preference pairs from {cfg.data.preference_file}"
                   + (f" (skipped while loading: {prefs.skipped})" if prefs.skipped else ""))
    return PreferenceSet(train, prefs.skipped), PreferenceSet(held, {}), description


def _encode(cfg: Config, tok: Any, rows: list[dict]) -> Experience:
    exp, skipped = encode_pairs(rows, tok, max_prompt_tokens=cfg.model.max_prompt_tokens,
                                max_response_tokens=cfg.model.max_new_tokens, system_prompt=cfg.data.system_prompt)
    if skipped:
        print(f"[rayrlhf] pairs over the token budget (model.max_prompt_tokens / max_new_tokens), left out: {skipped}",
              flush=True)
    return exp


def _with_reference(ctx: RunContext, model_path: str, parts: dict[str, Experience]) -> dict[str, Experience]:
    """Reference log-probs of every pair, computed once by a Reference actor (then stopped) and
    cached in the run directory, so a resumed run does not score the data again."""
    cfg = ctx.cfg
    if not cfg.dpo.uses_reference or cfg.lora.enabled:
        return parts
    cache = ctx.dir / REFERENCE_CACHE
    if cache.is_file():
        return _read_reference(cache, parts)
    rcfg = dataclasses.replace(reference_config(cfg, model_path), temperature=1.0)
    actor = ray.remote(ReferenceWorker).options(num_cpus=cfg.cluster.cpus_per_reference,
                                                runtime_env=role_env(cfg.cluster.threads)).remote(rcfg)
    try:
        out = {}
        for name, exp in parts.items():
            annotated, stats = ray.get(list(actor.annotate.options(num_returns=2).remote(exp)))
            out[name] = annotated
            print(f"[rayrlhf] reference log-probs of {exp.batch_size // 2} {name} pairs in {stats['seconds']:.1f}s",
                  flush=True)
    finally:
        ray.kill(actor)
    _write_reference(cache, out)
    return out


def _write_reference(path: Path, parts: dict[str, Experience]) -> None:
    rows = []
    for name, exp in parts.items():
        for i in range(exp.batch_size):
            mask = exp.response_mask[i]
            rows.append({"split": name, "row": i, "completion": exp.completions[i],
                         "ref_logprobs": exp.ref_logprobs[i][mask].tolist()})
    write_preferences(path, rows)


def _read_reference(path: Path, parts: dict[str, Experience]) -> dict[str, Experience]:
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    out = {}
    for name, exp in parts.items():
        rows = sorted((r for r in table if r["split"] == name), key=lambda r: r["row"])
        if [r["completion"] for r in rows] != exp.completions:
            raise UserError(f"{path} does not match the preference data; delete it to score the data again")
        ref = torch.zeros(exp.input_ids.shape)
        for i, r in enumerate(rows):
            ref[i][exp.response_mask[i]] = torch.tensor(r["ref_logprobs"])
        out[name] = exp.replace(ref_logprobs=ref).validate()
    return out


def run(ctx: RunContext, model_path: str, train_set: PreferenceSet, eval_set: PreferenceSet) -> RunResult:
    cfg = ctx.cfg
    from transformers import AutoTokenizer

    ctx.runlog.eval_label = "reward accuracy"
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    parts = {"train": _encode(cfg, tok, train_set.rows)}
    if eval_set.rows:
        parts["eval"] = _encode(cfg, tok, eval_set.rows)
    with ctx.phase("reference"):
        parts = _with_reference(ctx, model_path, parts)
    train_pairs, n_pairs = parts["train"], parts["train"].batch_size // 2
    if n_pairs < cfg.dpo.pairs_per_step:
        raise UserError(f"{n_pairs} training pairs fit the token budget, fewer than dpo.pairs_per_step")
    eval_ref = ray.put(parts["eval"]) if "eval" in parts else None
    resume = str(ctx.resume_from) if ctx.resume_from else None
    learners = LearnerGroup(learner_spec(cfg, model_path, pad_id, resume_from=resume), ctx.dir / "ray_train")
    try:
        info = learners.wait_ready()
        print(f"[rayrlhf] roles ready: {cfg.cluster.num_learners} learner(s), {cfg.dpo.loss} loss, beta {cfg.dpo.beta}, "
              f"reference {'in the learner (LoRA)' if cfg.lora.enabled else 'scored once' if cfg.dpo.uses_reference else 'none'}"
              f"; trainable fraction {info['trainable_fraction']:.4f}"
              + (f"; resumed from {resume} (step {ctx.start_step})" if resume else ""), flush=True)
        sampler = PromptSampler(n_pairs, cfg.dpo.pairs_per_step, cfg.run.seed, **ctx.run_state["sampler"])
        if eval_ref is not None and ctx.eval_due(0):
            with ctx.phase("eval"):
                ctx.log_base_eval(_eval_row(learners.evaluate(0, [eval_ref])))
        for step in ctx.steps():
            pair_ids = sampler.next()
            rows = [r for i in pair_ids for r in (2 * i, 2 * i + 1)]
            batch_ref = ray.put(train_pairs.select(rows))
            save_dir = ctx.checkpoint_dir(step)
            with ctx.phase("learn"):
                result = learners.learn(step, [batch_ref], save_dir=save_dir, sync=False)
            if result.get("saved"):
                ctx.finish_checkpoint(result["saved"], step, sampler, result["version"])
            row: dict[str, Any] = {"data/pair_ids": pair_ids, "skipped_at_load": dict(train_set.skipped),
                                   **result["metrics"]}
            if result.get("saved"):
                row["checkpoint"] = result["saved"]
            if eval_ref is not None and ctx.eval_due(step):
                with ctx.phase("eval"):
                    row.update(_eval_row(learners.evaluate(step, [eval_ref])))
            ctx.log_step(step, row)
    finally:
        learners.stop()
    return ctx.result()


def _eval_row(metrics: dict[str, float]) -> dict[str, float]:
    """Held-out reward accuracy doubles as the run's ``eval/accuracy`` (what progress lines show)."""
    return {**metrics, "eval/accuracy": metrics.get("eval/rewards/accuracy", float("nan")),
            "eval/n": metrics.get("eval/pairs", 0.0)}
