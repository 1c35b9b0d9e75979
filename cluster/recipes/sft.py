"""Supervised fine-tuning recipe (stage 0 of the preference recipes):

demos     <- demonstration rows (JSONL / Parquet), checked, counted, split, tokenised
             or, without a file: data.task's prompts with their reference answers, or
             tool-use conversations written from them by code (sft.transcripts)
for each step:
    batch    <- the next sft.examples_per_step demonstrations
    learners <- prompt-masked cross-entropy update
    every eval_every steps: held-out NLL (and, for data.task, greedy task accuracy on held-out
               prompts after a weight sync to the generators)
"""

from __future__ import annotations

from typing import Any

import ray

from actors.data.offline_data import encode_demonstrations
from cluster.config import Config, UserError
from cluster.config.role_settings import self_judging
from cluster.recipes import Recipe, RoleSet
from cluster.data.sources import Demonstrations, load_demonstrations
from cluster.recipes.fixed_data import FixedData, FixedDataSteps
from cluster.roles import Roles
from cluster.run_context import RunContext, RunResult
from cluster.step_loop import run_steps

load_data = load_demonstrations


def encode(cfg: Config, tok: Any, rows: list[dict]) -> Any:
    # Judge demonstrations wrap a prompt in the judge's template: they get the judge's budget.
    budget = max(cfg.model.max_prompt_tokens, cfg.judge.max_prompt_tokens if cfg.sft.judge_demonstrations else 0)
    exp, skipped = encode_demonstrations(
        rows,
        tok,
        max_prompt_tokens=budget,
        max_response_tokens=cfg.model.max_new_tokens + 1,
        system_prompt=cfg.data.system_prompt,
        max_total_tokens=cfg.env.episode_tokens(budget, cfg.model.max_new_tokens) if cfg.env.name else 0,
    )
    if skipped:
        print(
            f"[rayrlhf] demonstrations over the token budget (model.max_prompt_tokens / max_new_tokens), "
            f"left out: {skipped}",
            flush=True,
        )
    return exp


def run(ctx: RunContext, model_path: str, train_set: Demonstrations, eval_set: Demonstrations) -> RunResult:
    cfg = ctx.cfg
    with Roles(ctx, model_path, unit="demonstration") as roles:
        train = encode(cfg, roles.tokenizer, train_set.rows)
        if train.batch_size == 0:
            raise UserError("no demonstration fits the token budget")
        held = encode(cfg, roles.tokenizer, eval_set.rows) if eval_set.rows else None
        ctx.runlog.eval_label = "greedy accuracy" if eval_set.task_rows else "NLL"
        roles.start_learners()
        if eval_set.task_rows and cfg.run.eval_every:  # generators only for greedy task accuracy
            roles.start_generators()
        roles.ready(f"SFT on {train.batch_size} demonstrations")
        data = FixedData(
            train,
            train.batch_size,
            cfg.sft.examples_per_step,
            rows_of=lambda i: [i],
            ids_key="data/example_ids",
            held_ref=ray.put(held) if held is not None and held.batch_size else None,
            eval_keys=("eval/nll", "eval/examples"),
            eval_prompts=eval_set.task_rows,
            row_extra={"skipped_at_load": dict(train_set.skipped), "data/train_examples": train.batch_size},
        )
        return run_steps(ctx, FixedDataSteps(ctx, roles, data))


def roles(cfg) -> RoleSet:
    """Generators (and their scorer) only for the held-out task accuracy; no reference."""
    return RoleSet(scorer=not self_judging(cfg))


RECIPE = Recipe(
    name="sft",
    learner="sft",
    section="sft",
    roles=roles,
    batch=lambda cfg: (cfg.sft.examples_per_step, "demonstrations"),
    features=frozenset({"fsdp", "episodes"}),
)
