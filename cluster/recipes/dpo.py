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

from actors.data.offline_data import PreferenceSet, encode_pairs, read_preferences, split_rows, write_preferences
from cluster.recipes import Check, Recipe, RoleSet, reference_where
from cluster.config.role_settings import self_judging, reference_config, role_env
from cluster.roles.rollout_group import RolloutGroup
from cluster.roles.workers import ReferenceWorker
from cluster.config import Config, UserError
from cluster.data.sources import load_demonstrations, load_task_prompts
from cluster.recipes import pairs
from cluster.recipes.fixed_data import FixedData, FixedDataSteps
from cluster.roles import Roles
from cluster.run_context import RunContext, RunResult
from cluster.step_loop import run_steps
from learners.experience import Experience

REFERENCE_CACHE = "data/reference_logprobs.parquet"


def load_data(cfg: Config) -> tuple[Any, Any, str]:
    """Train and held-out pairs of ``data.preference_file`` (a seeded shuffle, then a split), or,
    without one, what the generators make pairs from: data.task's prompts (scorer, self_judge) or
    demonstrations (spin)."""
    if not cfg.data.preference_file:
        if cfg.dpo.pairs == "spin":
            train_set, eval_set, description = load_demonstrations(cfg)
            return train_set, eval_set, description + "; pairs: demonstration (chosen) vs the model's own reply (SPIN)"
        train_set, eval_set, description = load_task_prompts(cfg)
        ranker = "the model as judge (self-rewarding)" if cfg.dpo.pairs == "self_judge" else cfg.reward.function
        return (
            train_set,
            eval_set,
            (description + f"; pairs: best vs worst of {cfg.dpo.candidates} candidates per prompt, ranked by {ranker}"),
        )
    try:
        prefs = read_preferences(cfg.data.preference_file)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.preference_file: {e}") from None
    train, held = split_rows(prefs.rows, cfg.run.seed, cfg.data.eval_size)
    if len(train) < cfg.dpo.pairs_per_step:
        raise UserError(
            f"data.preference_file: {len(train)} usable training pairs, fewer than dpo.pairs_per_step="
            f"{cfg.dpo.pairs_per_step} (skipped while loading: {prefs.skipped})"
        )
    description = f"{len(train)} train / {len(held)} held-out preference pairs from {cfg.data.preference_file}" + (
        f" (skipped while loading: {prefs.skipped})" if prefs.skipped else ""
    )
    return PreferenceSet(train, prefs.skipped), PreferenceSet(held, {}), description


def _encode(cfg: Config, tok: Any, rows: list[dict]) -> Experience:
    exp, skipped = encode_pairs(
        rows,
        tok,
        max_prompt_tokens=cfg.model.max_prompt_tokens,
        max_response_tokens=cfg.model.max_new_tokens,
        system_prompt=cfg.data.system_prompt,
    )
    if skipped:
        print(
            f"[rayrlhf] pairs over the token budget (model.max_prompt_tokens / max_new_tokens), left out: {skipped}",
            flush=True,
        )
    return exp


def _with_reference(ctx: RunContext, model_path: str, parts: dict[str, Experience]) -> dict[str, Experience]:
    """Reference log-probs of every pair, computed once by a Reference actor (then stopped) and
    cached in the run directory, so a resumed run does not score the data again."""
    cfg = ctx.cfg
    if (
        not cfg.dpo.uses_reference
        or cfg.lora.enabled
        or cfg.train.reference == "learners"
        or cfg.run.algorithm == "reward_model"
    ):
        return parts
    cache = ctx.dir / REFERENCE_CACHE
    if cache.is_file():
        return _read_reference(cache, parts)
    rcfg = dataclasses.replace(reference_config(cfg, model_path), temperature=1.0)
    actor = (
        ray.remote(ReferenceWorker)
        .options(num_cpus=cfg.cluster.cpus_per_reference, runtime_env=role_env(cfg.cluster.threads))
        .remote(rcfg)
    )
    try:
        out = {}
        for name, exp in parts.items():
            annotated, stats = ray.get(list(actor.annotate.options(num_returns=2).remote(exp)))
            out[name] = annotated
            print(
                f"[rayrlhf] reference log-probs of {exp.batch_size // 2} {name} pairs in {stats['seconds']:.1f}s",
                flush=True,
            )
    finally:
        ray.kill(actor)
    _write_reference(cache, out)
    return out


def _write_reference(path: Path, parts: dict[str, Experience]) -> None:
    rows = []
    for name, exp in parts.items():
        for i in range(exp.batch_size):
            mask = exp.response_mask[i]
            rows.append(
                {
                    "split": name,
                    "row": i,
                    "completion": exp.completions[i],
                    "ref_logprobs": exp.ref_logprobs[i][mask].tolist(),
                }
            )
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
    """The generators sample ``dpo.candidates`` candidates at ``dpo.candidate_temperature`` (and
    ``dpo.candidate_top_k``)."""
    gen = cfg.model_copy(deep=True)
    gen.rollout.samples_per_prompt = cfg.dpo.candidates
    gen.rollout.temperature = cfg.dpo.candidate_temperature
    gen.rollout.top_k = cfg.dpo.candidate_top_k
    return gen


def _generated_pairs(ctx: RunContext, rollout: RolloutGroup, tok: Any, train_set: Any) -> tuple[Experience, dict]:
    """The pairs of ``dpo.pairs`` (made once; a resumed run reuses them)."""
    cached = pairs.cached_pairs(ctx.dir)
    if cached is not None:
        return cached
    if ctx.cfg.dpo.pairs == "spin":
        return pairs.spin_pairs(ctx, rollout, tok, train_set.rows)
    return pairs.ranked_pairs(ctx, rollout, train_set.rows, by=ctx.cfg.dpo.pairs)


def _pairs_and_generators(
    ctx: RunContext, roles: Roles, train_set: Any, eval_set: Any
) -> tuple[dict[str, Experience], list[dict], dict]:
    """The encoded train (and held-out) pairs; with generated pairs also the generators (left
    running for greedy evaluations, except for a reward model), the held-out task prompts for
    greedy accuracy and the pair counts."""
    cfg, tok = ctx.cfg, roles.tokenizer
    if isinstance(train_set, PreferenceSet):
        ctx.runlog.eval_label = "reward accuracy"
        parts = {"train": _encode(cfg, tok, train_set.rows)}
        if eval_set.rows:
            parts["eval"] = _encode(cfg, tok, eval_set.rows)
        return parts, [], {}
    ctx.runlog.eval_label = "greedy accuracy"
    # The generators hold the run's starting weights (model t) until they are trained, also when
    # a resumed run restarts them: the pairs are cached, later evaluations sync.
    rollout = roles.start_generators(_generator_config(cfg))
    rollout.wait_ready()
    with ctx.phase("pairs"):
        made, counts = _generated_pairs(ctx, rollout, tok, train_set)
        train_pairs, eval_pairs = pairs.split_pairs(made, cfg.dpo.eval_pairs)
    parts = {"train": train_pairs, **({"eval": eval_pairs} if eval_pairs is not None else {})}
    if cfg.run.algorithm == "reward_model":  # a reward model is no policy: the generators are done
        roles.stop_generators()
        ctx.runlog.eval_label = "pairwise accuracy"
        return parts, [], counts
    return parts, eval_set.task_rows if cfg.dpo.pairs == "spin" else eval_set.rows, counts


def _training_pairs(cfg: Config, parts: dict[str, Experience], generated: bool) -> int:
    """The number of training pairs; too few for a step is the user's error with a file, a
    warning with generated pairs (a later self-rewarding iteration may form fewer)."""
    n_pairs = parts["train"].batch_size // 2
    if n_pairs < cfg.dpo.pairs_per_step:
        if not generated or n_pairs == 0:
            raise UserError(
                f"{n_pairs} training pairs (after the token budget), fewer than dpo.pairs_per_step="
                f"{cfg.dpo.pairs_per_step}"
            )
        print(
            f"[rayrlhf] warning: only {n_pairs} training pairs were formed, fewer than dpo.pairs_per_step="
            f"{cfg.dpo.pairs_per_step}: each step uses all {n_pairs}",
            flush=True,
        )
    return n_pairs


def _objective(cfg: Config, n_pairs: int) -> str:
    if cfg.run.algorithm == "reward_model":
        what = "Bradley-Terry reward model"
    else:
        reference = (
            "none"
            if not cfg.dpo.uses_reference
            else "in the learner (LoRA)"
            if cfg.lora.enabled
            else "in the learners (a frozen copy)"
            if cfg.train.reference == "learners"
            else "scored once"
        )
        what = f"{cfg.dpo.loss} loss, beta {cfg.dpo.beta}, reference {reference}"
    return f"{what}; {n_pairs} training pairs"


def run(ctx: RunContext, model_path: str, train_set: Any, eval_set: Any) -> RunResult:
    cfg = ctx.cfg
    with Roles(ctx, model_path, unit="pair") as roles:
        parts, eval_prompts, pair_counts = _pairs_and_generators(ctx, roles, train_set, eval_set)
        with ctx.phase("reference"):
            parts = _with_reference(ctx, model_path, parts)
        n_pairs = _training_pairs(cfg, parts, generated=roles.rollout is not None or bool(pair_counts))
        roles.start_learners()
        roles.ready(_objective(cfg, n_pairs))
        held = parts.get("eval")
        data = FixedData(
            parts["train"],
            n_pairs,
            cfg.dpo.pairs_per_step,
            rows_of=lambda i: [2 * i, 2 * i + 1],
            ids_key="data/pair_ids",
            held_ref=ray.put(held) if held is not None else None,
            eval_keys=("eval/rewards/accuracy", "eval/pairs"),
            eval_prompts=eval_prompts,
            sync_last=True,
            # What the pairs came from, logged with every step.
            row_extra={
                "skipped_at_load": dict(train_set.skipped),
                "data/train_pairs": n_pairs,
                "data/held_out_pairs": held.batch_size // 2 if held is not None else 0,
                **{f"pairs/{k}": v for k, v in pair_counts.items()},
            },
        )
        return run_steps(ctx, FixedDataSteps(ctx, roles, data))


def roles(cfg) -> RoleSet:
    """DPO's reference scores the pairs once, before training (``data``), unless the learners
    hold it; a reward model needs none."""
    where = reference_where(cfg, cfg.run.algorithm == "dpo" and cfg.dpo.uses_reference)
    return RoleSet(scorer=not self_judging(cfg), reference="data" if where == "rollout" else where)


def check(cfg) -> list[Check]:
    dpo, episodes = cfg.dpo, bool(cfg.env.name or cfg.rollout.agent)
    return [
        (
            not (cfg.data.preference_file and dpo.pairs != "scorer"),
            f"dpo.pairs={dpo.pairs} makes its own pairs: leave data.preference_file empty",
        ),
        (
            not (episodes and dpo.pairs != "scorer"),
            f"env.name with run.algorithm=dpo pairs the best and worst episode "
            f"of a prompt (dpo.pairs=scorer), not dpo.pairs={dpo.pairs}",
        ),
    ]


def check_reward_model(cfg) -> list[Check]:
    return [
        (
            cfg.dpo.pairs == "scorer",
            "run.algorithm=reward_model trains on data.preference_file or on scored pairs "
            f"(dpo.pairs=scorer), not dpo.pairs={cfg.dpo.pairs}",
        )
    ]


def _pairs(cfg) -> tuple[int, str]:
    return cfg.dpo.pairs_per_step, "pairs"


RECIPE = Recipe(
    name="dpo",
    learner="dpo",
    section="dpo",
    roles=roles,
    check=check,
    batch=_pairs,
    features=frozenset({"fsdp", "episodes"}),
)
REWARD_MODEL = Recipe(
    name="reward_model",
    learner="reward_model",
    section="reward_model",
    roles=roles,
    check=check_reward_model,
    batch=_pairs,
    features=frozenset({"fsdp"}),
)
