"""Supervised fine-tuning recipe (stage 0 of the preference recipes):

    demos     <- demonstration rows (JSONL / Parquet), checked, counted, split, tokenised
                 or, without a file: data.task's prompts with their reference answers
    for each step:
        batch    <- the next sft.examples_per_step demonstrations
        learners <- prompt-masked cross-entropy update
        every eval_every steps: held-out NLL (and, for data.task, greedy task accuracy on held-out
                   prompts after a weight sync to the generators)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from actors.offline_data import encode_demonstrations, read_demonstrations, split_rows, task_demonstrations
from cluster.actor_groups import RolloutGroup
from cluster.config import Config, UserError
from cluster.learner_group import LearnerGroup, learner_spec
from cluster.run_context import PromptSampler, RunContext, RunResult, greedy_accuracy


@dataclass
class Demonstrations:
    # {"prompt": messages, "response": str, "index": int}
    rows: list[dict[str, Any]]
    # Rows excluded while loading, by reason.
    skipped: dict[str, int] = field(default_factory=dict)
    # Held-out task rows (prompt, answer, meta) for greedy accuracy; empty for a file.
    task_rows: list[dict[str, Any]] = field(default_factory=list)


def load_data(cfg: Config) -> tuple[Demonstrations, Demonstrations, str]:
    """Train and held-out demonstrations of ``data.demonstration_file`` (seeded shuffle, split),
    or of ``data.task`` (its answers as responses)."""
    if not cfg.data.demonstration_file:
        from cluster.recipes import ppo

        train_set, eval_set, description = ppo.load_data(cfg)
        demos = task_demonstrations(train_set.rows)
        if cfg.sft.judge_demonstrations:
            from actors.judge import judge_demonstrations

            eft = judge_demonstrations(train_set.rows, cfg.sft.judge_demonstrations, cfg.judge.template,
                                       seed=cfg.run.seed, max_score=cfg.judge.max_score,
                                       min_points=max(cfg.judge.min_score, 1.0))
            demos = demos + [dict(r, index=len(demos) + i) for i, r in enumerate(eft)]
            description += f"; {len(eft)} judge demonstrations (EFT)"
        return (Demonstrations(demos, dict(train_set.skipped)),
                Demonstrations(task_demonstrations(eval_set.rows), {}, list(eval_set.rows)),
                description + "; demonstrations: the task's reference answers")
    try:
        demos = read_demonstrations(cfg.data.demonstration_file)
    except FileNotFoundError as e:
        raise UserError(f"data.demonstration_file: {e}") from None
    train, held = split_rows(demos.rows, cfg.run.seed, cfg.data.eval_size)
    if not train:
        raise UserError(f"data.demonstration_file: no usable training rows (skipped while loading: {demos.skipped})")
    return (Demonstrations(train, demos.skipped), Demonstrations(held),
            f"{len(train)} train / {len(held)} held-out demonstrations from {cfg.data.demonstration_file}"
            + (f" (skipped while loading: {demos.skipped})" if demos.skipped else ""))


def encode(cfg: Config, tok: Any, rows: list[dict]) -> Any:
    # Judge demonstrations wrap a prompt in the judge's template: they get the judge's budget.
    budget = max(cfg.model.max_prompt_tokens, cfg.judge.max_prompt_tokens if cfg.sft.judge_demonstrations else 0)
    exp, skipped = encode_demonstrations(rows, tok, max_prompt_tokens=budget,
                                         max_response_tokens=cfg.model.max_new_tokens + 1,
                                         system_prompt=cfg.data.system_prompt)
    if skipped:
        print(f"[rayrlhf] demonstrations over the token budget (model.max_prompt_tokens / max_new_tokens), "
              f"left out: {skipped}", flush=True)
    return exp


def run(ctx: RunContext, model_path: str, train_set: Demonstrations, eval_set: Demonstrations) -> RunResult:
    cfg = ctx.cfg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    resume = str(ctx.resume_from) if ctx.resume_from else None
    train = encode(cfg, tok, train_set.rows)
    if train.batch_size == 0:
        raise UserError("no demonstration fits the token budget")
    held = encode(cfg, tok, eval_set.rows) if eval_set.rows else None
    held_ref = ray.put(held) if held is not None and held.batch_size else None
    ctx.runlog.eval_label = "greedy accuracy" if eval_set.task_rows else "NLL"
    # Generators only for greedy task accuracy: SFT itself needs none.
    rollout = None
    if eval_set.task_rows and cfg.run.eval_every:
        rollout = RolloutGroup(cfg, model_path, policy_path=resume, policy_version=int(ctx.run_state["version"]),
                               with_reference=False)
    learners = None

    def evaluate(step: int, weights: Any = None) -> dict[str, float]:
        row: dict[str, float] = {}
        if held_ref is not None:
            row.update(learners.evaluate(step, [held_ref]))
            row.update({"eval/accuracy": row["eval/nll"], "eval/n": row["eval/examples"]})
        if rollout is not None:
            if weights is not None:
                rollout.sync_weights(weights)
            row.update(greedy_accuracy(rollout, eval_set.task_rows))
        return row

    try:
        learners = LearnerGroup(learner_spec(cfg, model_path, pad_id, resume_from=resume), ctx.dir / "ray_train")
        if rollout is not None:
            rollout.wait_ready()
        info = learners.wait_ready()
        print(f"[rayrlhf] roles ready: {cfg.cluster.num_learners} learner(s), SFT on {train.batch_size} demonstrations; "
              f"trainable fraction {info['trainable_fraction']:.4f}"
              + (f"; resumed from {resume} (step {ctx.start_step})" if resume else ""), flush=True)
        sampler = PromptSampler(train.batch_size, cfg.sft.examples_per_step, cfg.run.seed, **ctx.run_state["sampler"])
        if ctx.eval_due(0):
            with ctx.phase("eval"):
                ctx.log_base_eval(evaluate(0))
        for step in ctx.steps():
            ids = sampler.next()
            save_dir = ctx.checkpoint_dir(step)
            eval_now = ctx.eval_due(step)
            with ctx.phase("learn"):
                result = learners.learn(step, [ray.put(train.select(ids))], save_dir=save_dir,
                                        sync=eval_now and rollout is not None)
            if result.get("saved"):
                ctx.finish_checkpoint(result["saved"], step, sampler, result["version"])
            row: dict[str, Any] = {"data/example_ids": ids, "skipped_at_load": dict(train_set.skipped),
                                   "data/train_examples": train.batch_size, **result["metrics"]}
            if result.get("saved"):
                row["checkpoint"] = result["saved"]
            if eval_now:
                with ctx.phase("eval"):
                    row.update(evaluate(step, (result.get("weights") or [None])[0]))
            ctx.log_step(step, row)
            if ctx.early_stop(row, lambda: learners.save(step, ctx.checkpoint_path(step)), sampler):
                break
    finally:
        if learners is not None:
            learners.stop()
        if rollout is not None:
            rollout.shutdown()
    return ctx.result()
