"""DPO recipe (Rafailov et al. 2023, sec. 4 and 5) on a fixed set of pairs; also the recipe of
``run.algorithm=reward_model`` (a Bradley–Terry reward model on the same pairs: no reference, no
generators after the pairs are made, held-out pairwise accuracy as its evaluation):

    pairs       <- preference rows (JSONL / Parquet), checked, counted, split, tokenised
                   or, without a preference file, made by the generators (``dpo.pairs``, see
                   ``pairs.py``): candidates ranked by reward.function (scorer) or by the model
                   itself as judge (self_judge, Self-Rewarding LMs), or demonstration vs own
                   reply (spin, SPIN)
    ref logps   <- the reference model (the run's starting model: model t in an iteration)
                   scores every pair once (cached in the run directory)
    for each step:
        batch    <- the next pairs_per_step pairs
        learners <- DPO-family update on the batch
        every eval_every steps: held-out loss, reward accuracy and margin (and, with generators,
                   greedy task accuracy on held-out prompts after a weight sync)
    generators  <- the trained weights (model t+1)

One iteration of self-rewarding DPO or SPIN is one run of this recipe; ``stages`` in the config
chain iterations (and an SFT stage before them), each starting from the last one's checkpoint.
With LoRA the learners score the reference themselves (the adapter disabled) and no Reference
actor starts; SimPO needs no reference at all.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import ray
import torch

from actors.offline_data import PreferenceSet, encode_pairs, read_preferences, split_rows, write_preferences
from cluster.actor_groups import ReferenceWorker, RolloutGroup, reference_config, role_env
from cluster.config import Config, UserError
from cluster.learner_group import LearnerGroup, learner_spec
from cluster.recipes import pairs
from cluster.run_context import PromptSampler, RunContext, RunResult, greedy_accuracy
from learners.experience import Experience

REFERENCE_CACHE = "data/reference_logprobs.parquet"


def load_data(cfg: Config) -> tuple[Any, Any, str]:
    """Train and held-out pairs of ``data.preference_file`` (a seeded shuffle, then a split), or,
    without one, what the generators make pairs from: data.task's prompts (scorer, self_judge) or
    demonstrations (spin)."""
    if not cfg.data.preference_file:
        from cluster.recipes import ppo, sft

        if cfg.dpo.pairs == "spin":
            train_set, eval_set, description = sft.load_data(cfg)
            return train_set, eval_set, description + "; pairs: demonstration (chosen) vs the model's own reply (SPIN)"
        train_set, eval_set, description = ppo.load_data(cfg)
        ranker = "the model as judge (self-rewarding)" if cfg.dpo.pairs == "self_judge" else cfg.reward.function
        return train_set, eval_set, (description + f"; pairs: best vs worst of {cfg.dpo.candidates} candidates per "
                                     f"prompt, ranked by {ranker}")
    try:
        prefs = read_preferences(cfg.data.preference_file)
    except FileNotFoundError as e:
        raise UserError(f"data.preference_file: {e}") from None
    train, held = split_rows(prefs.rows, cfg.run.seed, cfg.data.eval_size)
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
    if not cfg.dpo.uses_reference or cfg.lora.enabled or cfg.run.algorithm == "reward_model":
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


def _generator_config(cfg: Config) -> Config:
    """The generators sample ``dpo.candidates`` candidates at ``dpo.candidate_temperature``."""
    gen = cfg.model_copy(deep=True)
    gen.rollout.samples_per_prompt = cfg.dpo.candidates
    gen.rollout.temperature = cfg.dpo.candidate_temperature
    return gen


def _generated_pairs(ctx: RunContext, rollout: RolloutGroup, tok: Any, train_set: Any) -> tuple[Experience, dict]:
    """The pairs of ``dpo.pairs`` (made once; a resumed run reuses them)."""
    cached = pairs.cached_pairs(ctx.dir)
    if cached is not None:
        return cached
    if ctx.cfg.dpo.pairs == "spin":
        return pairs.spin_pairs(ctx, rollout, tok, train_set.rows)
    return pairs.ranked_pairs(ctx, rollout, train_set.rows, by=ctx.cfg.dpo.pairs)


def _pairs_and_generators(ctx: RunContext, tok: Any, model_path: str, train_set: Any,
                          eval_set: Any) -> tuple[RolloutGroup | None, dict[str, Experience], list[dict], dict]:
    """The encoded train (and held-out) pairs; with generated pairs also the generators, the
    held-out task prompts for greedy accuracy and the pair counts."""
    cfg = ctx.cfg
    if isinstance(train_set, PreferenceSet):
        ctx.runlog.eval_label = "reward accuracy"
        parts = {"train": _encode(cfg, tok, train_set.rows)}
        if eval_set.rows:
            parts["eval"] = _encode(cfg, tok, eval_set.rows)
        return None, parts, [], {}
    ctx.runlog.eval_label = "greedy accuracy"
    # The generators hold the run's starting weights (model t) until they are trained, also when
    # a resumed run restarts them: the pairs are cached, later evaluations sync.
    resume = str(ctx.resume_from) if ctx.resume_from else None
    rollout = RolloutGroup(_generator_config(cfg), model_path, policy_path=resume,
                           policy_version=int(ctx.run_state["version"]), with_reference=False)
    try:
        rollout.wait_ready()
        with ctx.phase("pairs"):
            made, counts = _generated_pairs(ctx, rollout, tok, train_set)
            train_pairs, eval_pairs = pairs.split_pairs(made, cfg.dpo.eval_pairs)
    except BaseException:
        rollout.shutdown()
        raise
    parts = {"train": train_pairs, **({"eval": eval_pairs} if eval_pairs is not None else {})}
    if cfg.run.algorithm == "reward_model":  # a reward model is no policy: the generators are done
        rollout.shutdown()
        ctx.runlog.eval_label = "pairwise accuracy"
        return None, parts, [], counts
    return rollout, parts, eval_set.task_rows if cfg.dpo.pairs == "spin" else eval_set.rows, counts


def run(ctx: RunContext, model_path: str, train_set: Any, eval_set: Any) -> RunResult:
    cfg = ctx.cfg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    resume = str(ctx.resume_from) if ctx.resume_from else None
    rollout, parts, eval_prompts, pair_counts = _pairs_and_generators(ctx, tok, model_path, train_set, eval_set)
    learners = None
    try:
        with ctx.phase("reference"):
            parts = _with_reference(ctx, model_path, parts)
        train_pairs, n_pairs = parts["train"], parts["train"].batch_size // 2
        if n_pairs < cfg.dpo.pairs_per_step:
            if rollout is None or n_pairs == 0:  # a preference file: the user's data is too small
                raise UserError(f"{n_pairs} training pairs (after the token budget), fewer than dpo.pairs_per_step="
                                f"{cfg.dpo.pairs_per_step}")
            # Generated pairs: how many form depends on the model (a later self-rewarding iteration may
            # find fewer); train on what there is rather than end a staged run.
            print(f"[rayrlhf] warning: only {n_pairs} training pairs were formed, fewer than dpo.pairs_per_step="
                  f"{cfg.dpo.pairs_per_step}: each step uses all {n_pairs}", flush=True)
        eval_ref = ray.put(parts["eval"]) if "eval" in parts else None
        # What the pairs came from, logged with every step.
        data_counts = {"data/train_pairs": n_pairs,
                       "data/held_out_pairs": parts["eval"].batch_size // 2 if "eval" in parts else 0,
                       **{f"pairs/{k}": v for k, v in pair_counts.items()}}
        learners = LearnerGroup(learner_spec(cfg, model_path, pad_id, resume_from=resume), ctx.dir / "ray_train")
        _train(ctx, learners, rollout, train_pairs, eval_ref, eval_prompts, data_counts, dict(train_set.skipped))
    finally:
        if learners is not None:
            learners.stop()
        if rollout is not None:
            rollout.shutdown()
    return ctx.result()


def _train(ctx: RunContext, learners: LearnerGroup, rollout: RolloutGroup | None, train_pairs: Experience,
           eval_ref: Any, eval_prompts: list[dict], data_counts: dict, skipped_at_load: dict) -> None:
    """The loop: ``pairs_per_step`` pairs per update, evaluations, checkpoints, the final sync."""
    cfg = ctx.cfg
    n_pairs = train_pairs.batch_size // 2

    def evaluate(step: int, weights: Any = None) -> dict[str, float]:
        row: dict[str, float] = {}
        if eval_ref is not None:
            row.update(learners.evaluate(step, [eval_ref]))
            row.update({"eval/accuracy": row.get("eval/rewards/accuracy", float("nan")), "eval/n": row.get("eval/pairs", 0.0)})
        if rollout is not None and eval_prompts:
            if weights is not None:
                rollout.sync_weights(weights)
            row.update(greedy_accuracy(rollout, eval_prompts))  # eval/accuracy: the task's, greedy
        return row

    info = learners.wait_ready()
    if cfg.run.algorithm == "reward_model":
        objective = "Bradley-Terry reward model"
    else:
        objective = (f"{cfg.dpo.loss} loss, beta {cfg.dpo.beta}, reference "
                     f"{'in the learner (LoRA)' if cfg.lora.enabled else 'scored once' if cfg.dpo.uses_reference else 'none'}")
    print(f"[rayrlhf] roles ready: {cfg.cluster.num_learners} learner(s), {objective}"
          f"; {n_pairs} training pairs; trainable fraction {info['trainable_fraction']:.4f}"
          + (f"; resumed from {ctx.resume_from} (step {ctx.start_step})" if ctx.resume_from else ""), flush=True)
    sampler = PromptSampler(n_pairs, min(cfg.dpo.pairs_per_step, n_pairs), cfg.run.seed, **ctx.run_state["sampler"])
    if ctx.eval_due(0):
        with ctx.phase("eval"):
            ctx.log_base_eval(evaluate(0))
    for step in ctx.steps():
        pair_ids = sampler.next()
        rows = [r for i in pair_ids for r in (2 * i, 2 * i + 1)]
        batch_ref = ray.put(train_pairs.select(rows))
        save_dir = ctx.checkpoint_dir(step)
        eval_now = ctx.eval_due(step)
        last = step == cfg.run.steps
        with ctx.phase("learn"):
            # Weights go to the generators when a greedy evaluation needs them, and at the end.
            result = learners.learn(step, [batch_ref], save_dir=save_dir,
                                    sync=(eval_now or last) and rollout is not None)
        if result.get("saved"):
            ctx.finish_checkpoint(result["saved"], step, sampler, result["version"])
        row: dict[str, Any] = {"data/pair_ids": pair_ids, "skipped_at_load": skipped_at_load,
                               **data_counts, **result["metrics"]}
        if result.get("saved"):
            row["checkpoint"] = result["saved"]
        weights = (result.get("weights") or [None])[0]
        if eval_now:
            with ctx.phase("eval"):
                row.update(evaluate(step, weights))
        elif weights is not None:
            with ctx.phase("sync"):
                rollout.sync_weights(weights)
        if weights is not None:
            row["sync/generator_version"] = float(ray.get(rollout.generators[0].version.remote()))
        ctx.log_step(step, row)
        if ctx.early_stop(row, lambda: learners.save(step, ctx.checkpoint_path(step)), sampler):
            break

