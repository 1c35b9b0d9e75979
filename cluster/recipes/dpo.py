"""DPO recipe (Rafailov et al. 2023, sec. 4 and 5) on a fixed set of pairs:

    pairs       <- preference rows (JSONL / Parquet), checked, counted, split, tokenised
                   or, without a preference file: the generators sample rollout.samples_per_prompt
                   candidates per prompt of data.task, reward.function scores them, and the best
                   and worst candidate of a prompt form a pair when their scores differ
    ref logps   <- the reference model scores every pair once (cached in the run directory)
    for each step:
        batch    <- the next pairs_per_step pairs
        learners <- DPO-family update on the batch
        every eval_every steps: held-out loss, reward accuracy and margin (and, with generators,
                   greedy task accuracy on held-out prompts after a weight sync)

With LoRA the learners score the reference themselves (the adapter disabled) and no Reference
actor starts; SimPO needs no reference at all.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import ray
import torch

from actors.offline_data import PreferenceSet, encode_pairs, read_preferences, write_preferences
from actors.tasks import PromptSet
from cluster.actor_groups import ReferenceWorker, RolloutGroup, reference_config, role_env
from cluster.config import Config, UserError
from cluster.learner_group import LearnerGroup, learner_spec
from cluster.run_context import PromptSampler, RunContext, RunResult, greedy_accuracy
from learners.dpo import preference_pairs
from learners.experience import Experience

REFERENCE_CACHE = "data/reference_logprobs.parquet"
PAIRS_CACHE = "data/scored_pairs.pt"
PAIRS_TABLE = "data/scored_pairs.parquet"


def load_data(cfg: Config) -> tuple[Any, Any, str]:
    """Train and held-out pairs of ``data.preference_file`` (a seeded shuffle, then a split), or,
    without one, the prompts of ``data.task`` to build scored pairs from."""
    if not cfg.data.preference_file:
        from cluster.recipes import ppo

        train_set, eval_set, description = ppo.load_data(cfg)
        return train_set, eval_set, (description + f"; pairs: best vs worst of {cfg.rollout.samples_per_prompt} "
                                     f"samples per prompt, ranked by {cfg.reward.function}")
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


def _scored_pairs(ctx: RunContext, rollout: RolloutGroup, prompts: PromptSet) -> Experience:
    """Best and worst candidate of each of ``dpo.pair_prompts`` prompts, as pairs (the
    generators' own tokens); prompts whose candidates all score the same give no pair. Cached in
    the run directory (a resumed run reuses them) with a readable Parquet copy."""
    cfg = ctx.cfg
    cache = ctx.dir / PAIRS_CACHE
    if cache.is_file():
        fields = torch.load(cache, weights_only=True)
        return Experience(**fields).validate()
    ids = PromptSampler(len(prompts.rows), min(cfg.dpo.pair_prompts, len(prompts.rows)), cfg.run.seed + 1).next()
    exp_refs, gen_stats = rollout.generate([prompts.rows[i] for i in ids], ids, seed=cfg.run.seed * 100_003)
    exp_refs, score_stats = rollout.score(exp_refs)
    exp = Experience.concat(ray.get(exp_refs), pad_token_id=0)
    gen_stats, score_stats = ray.get(gen_stats), ray.get(score_stats)
    best, worst, kept_groups, ties = [], [], [], 0
    for g in dict.fromkeys(exp.group_ids.tolist()):
        rows = (exp.group_ids == g).nonzero().flatten()
        scores = exp.scores[rows]
        if float(scores.max() - scores.min()) <= cfg.dpo.min_score_gap:
            ties += 1
            continue
        best.append(int(rows[scores.argmax()]))
        worst.append(int(rows[scores.argmin()]))
        kept_groups.append(g)
    rows = [r for pair in zip(best, worst) for r in pair]
    pairs = exp.select(rows).trimmed()
    pairs = pairs.replace(scores=torch.tensor([1.0, 0.0] * len(best)),
                          skipped={**exp.skipped, "prompts_without_a_pair": ties}).validate()
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({f.name: getattr(pairs, f.name) for f in dataclasses.fields(pairs)}, cache)
    write_preferences(ctx.dir / PAIRS_TABLE, [
        {"prompt_id": g, "prompt": prompts.rows[g]["prompt"], "chosen": exp.completions[b], "rejected": exp.completions[w],
         "score_chosen": float(exp.scores[b]), "score_rejected": float(exp.scores[w])}
        for g, b, w in zip(kept_groups, best, worst)])
    seconds = sum(s["seconds"] for s in gen_stats) + sum(s["seconds"] for s in score_stats)
    print(f"[rayrlhf] {len(best)} pairs from {len(ids)} prompts x {cfg.rollout.samples_per_prompt} samples "
          f"({ties} prompts with equal scores, skipped: {exp.skipped}; mean score {float(exp.scores.mean()):.3f}) "
          f"in {seconds:.0f}s -> {ctx.dir / PAIRS_TABLE}", flush=True)
    return pairs


def _split_pairs(pairs: Experience, n_eval: int) -> tuple[Experience, Experience | None]:
    chosen, _, _ = preference_pairs(pairs.group_ids, pairs.scores)
    n = len(chosen)
    held = min(n_eval, n // 4)
    rows = lambda a, b: [r for i in range(a, b) for r in (2 * i, 2 * i + 1)]  # noqa: E731
    return pairs.select(rows(held, n)), (pairs.select(rows(0, held)) if held else None)


def run(ctx: RunContext, model_path: str, train_set: Any, eval_set: Any) -> RunResult:
    cfg = ctx.cfg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    resume = str(ctx.resume_from) if ctx.resume_from else None
    rollout = None
    if isinstance(train_set, PromptSet):  # pairs from the generators' samples, ranked by the scorer
        ctx.runlog.eval_label = "greedy accuracy"
        rollout = RolloutGroup(cfg, model_path, policy_path=resume, policy_version=int(ctx.run_state["version"]),
                               with_reference=False)
        rollout.wait_ready()
        with ctx.phase("pairs"):
            train_pairs, eval_pairs = _split_pairs(_scored_pairs(ctx, rollout, train_set), cfg.dpo.eval_pairs)
        parts = {"train": train_pairs, **({"eval": eval_pairs} if eval_pairs is not None else {})}
        eval_prompts = eval_set.rows
    else:
        ctx.runlog.eval_label = "reward accuracy"
        parts = {"train": _encode(cfg, tok, train_set.rows)}
        if eval_set.rows:
            parts["eval"] = _encode(cfg, tok, eval_set.rows)
        eval_prompts = []
    with ctx.phase("reference"):
        parts = _with_reference(ctx, model_path, parts)
    train_pairs, n_pairs = parts["train"], parts["train"].batch_size // 2
    if n_pairs < cfg.dpo.pairs_per_step:
        raise UserError(f"{n_pairs} training pairs (after the token budget and ties), fewer than dpo.pairs_per_step="
                        f"{cfg.dpo.pairs_per_step}")
    eval_ref = ray.put(parts["eval"]) if "eval" in parts else None
    # What the pairs came from, logged with every step.
    data_counts = {"data/train_pairs": n_pairs, "data/held_out_pairs": parts["eval"].batch_size // 2 if "eval" in parts else 0}
    if "prompts_without_a_pair" in train_pairs.skipped:
        data_counts["data/prompts_without_a_pair"] = train_pairs.skipped["prompts_without_a_pair"]
    learners = LearnerGroup(learner_spec(cfg, model_path, pad_id, resume_from=resume), ctx.dir / "ray_train")

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

    try:
        info = learners.wait_ready()
        print(f"[rayrlhf] roles ready: {cfg.cluster.num_learners} learner(s), {cfg.dpo.loss} loss, beta {cfg.dpo.beta}, "
              f"reference {'in the learner (LoRA)' if cfg.lora.enabled else 'scored once' if cfg.dpo.uses_reference else 'none'}"
              f"; {n_pairs} training pairs; trainable fraction {info['trainable_fraction']:.4f}"
              + (f"; resumed from {resume} (step {ctx.start_step})" if resume else ""), flush=True)
        sampler = PromptSampler(n_pairs, cfg.dpo.pairs_per_step, cfg.run.seed, **ctx.run_state["sampler"])
        if ctx.eval_due(0):
            with ctx.phase("eval"):
                ctx.log_base_eval(evaluate(0))
        for step in ctx.steps():
            pair_ids = sampler.next()
            rows = [r for i in pair_ids for r in (2 * i, 2 * i + 1)]
            batch_ref = ray.put(train_pairs.select(rows))
            save_dir = ctx.checkpoint_dir(step)
            eval_now = ctx.eval_due(step)
            with ctx.phase("learn"):
                # Weights go to the generators only when a greedy evaluation needs them.
                result = learners.learn(step, [batch_ref], save_dir=save_dir, sync=eval_now and rollout is not None)
            if result.get("saved"):
                ctx.finish_checkpoint(result["saved"], step, sampler, result["version"])
            row: dict[str, Any] = {"data/pair_ids": pair_ids, "skipped_at_load": dict(train_set.skipped),
                                   **data_counts, **result["metrics"]}
            if result.get("saved"):
                row["checkpoint"] = result["saved"]
            if eval_now:
                with ctx.phase("eval"):
                    row.update(evaluate(step, (result.get("weights") or [None])[0]))
            ctx.log_step(step, row)
    finally:
        learners.stop()
        if rollout is not None:
            rollout.shutdown()
    return ctx.result()
