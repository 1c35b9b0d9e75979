"""Token-level Q-learning recipe (Q-Transformer, Chebotar et al. 2023, alg. 1, with tokens as the
action dimensions; the learner is ``learners/qlearn.py``):

    online (no data.transition_file):
        for each step:
            prompts     <- sample a batch of prompts
            experience  <- generators act with the Q-policy: Boltzmann over Q (sampling at
                           rollout.temperature) or greedy
            experience  <- scorer adds rewards
            replay      <- experience as token transitions (kept in <run>/data/transitions/ too)
            batch       <- replay samples qlearn.batch_sequences sequences
            batch       <- reference log-probs (only with the KL anchor)
            learners    <- Q updates: TD + conservative loss, EMA target network
            generators  <- the learners' new weights

    offline (data.transition_file, e.g. exported by a PPO run with run.export_transitions):
        replay <- the file's transitions, qlearn.eval_transitions of them held out
        for each step:
            batch    <- replay samples qlearn.batch_sequences sequences
            learners <- Q updates
        every eval_every steps: TD loss on the held-out transitions, and the greedy Q-policy's
        reward on data.task's held-out prompts (generators get the weights for it), reported
        against the data's behaviour policy.
"""

from __future__ import annotations

import random
from typing import Any

import ray

from actors.transitions import transitions_to_experience
from cluster.actor_groups import ReplayWorker, RolloutGroup
from cluster.config import Config, UserError
from cluster.learner_group import LearnerGroup, learner_spec
from cluster.metrics import step_metrics
from cluster.run_context import PromptSampler, RunContext, RunResult, greedy_accuracy


def load_data(cfg: Config):
    """data.task's prompts (online acting, held-out evaluation) and, offline, the transitions of
    data.transition_file (checked and counted here, before anything starts)."""
    from cluster.recipes import ppo

    train_set, eval_set, description = ppo.load_data(cfg)
    if not cfg.data.transition_file:
        return (train_set, None), eval_set, description + "; online Q-learning"
    from actors.transitions import TransitionsError, read_transitions

    try:
        rows, skipped = read_transitions(cfg.data.transition_file)
    except (FileNotFoundError, TransitionsError) as e:
        raise UserError(f"data.transition_file: {e}") from None
    train, held = split_by_group(rows, min(cfg.qlearn.eval_transitions, len(rows) // 4), cfg.run.seed)
    if not train:
        raise UserError(f"data.transition_file: no usable transitions (excluded while reading: {skipped})")
    transitions = {"train": train, "held_out": held, "skipped": skipped}
    description += (f"; offline Q-learning on {len(train)} transitions ({len(held)} held out) from "
                    f"{cfg.data.transition_file}" + (f", excluded while reading: {skipped}" if skipped else ""))
    return (train_set, transitions), eval_set, description


def split_by_group(rows: list, n_eval: int, seed: int) -> tuple[list, list]:
    """(train, held-out) with whole prompts (``group_id``) held out, at least ``n_eval`` rows
    (when there are): a prompt's other samples in the training split would flatter the held-out
    TD loss."""
    groups: dict[int, list] = {}
    for t in rows:
        groups.setdefault(t.group_id, []).append(t)
    order = sorted(groups)
    random.Random(seed).shuffle(order)
    held: list = []
    for g in order:
        if len(held) >= n_eval:
            break
        held += groups.pop(g)
    return [t for t in rows if t.group_id in groups], held


def sampling_seed(run_seed: int, step: int) -> int:
    return run_seed * 100_003 + step


def behaviour_summary(rows: list) -> dict[str, float]:
    """The logged data's own reward: what its behaviour policy earned (sampled)."""
    returns = [sum(t.rewards) for t in rows]
    return {"data/behaviour_mean_reward": sum(returns) / len(returns),
            "data/behaviour_versions": float(len({t.behaviour_version for t in rows})),
            "data/transitions": float(len(rows))}


def run(ctx: RunContext, model_path: str, train_data, eval_set) -> RunResult:
    cfg = ctx.cfg
    from transformers import AutoTokenizer

    train_set, transitions = train_data
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    resume = str(ctx.resume_from) if ctx.resume_from else None
    online = transitions is None
    rollout = RolloutGroup(cfg, model_path, policy_path=resume, policy_version=int(ctx.run_state["version"]),
                           with_reference=cfg.qlearn.uses_reference and not cfg.lora.enabled)
    export_dir = str(ctx.dir / "data" / "transitions") if online else None
    replay = ray.remote(ReplayWorker).options(num_cpus=0).remote(
        cfg.qlearn.buffer_capacity if online else max(len(transitions["train"]), 1), cfg.run.seed, pad_id, export_dir)
    learners = None
    try:
        learners = LearnerGroup(learner_spec(cfg, model_path, pad_id, resume_from=resume), ctx.dir / "ray_train")
        rollout.wait_ready()
        info = learners.wait_ready()
        if online:
            filled = ray.get(replay.refill.remote(export_dir, ctx.start_step)) if resume else {"size": 0}
            source = f"online, acting {cfg.qlearn.acting}" + (f", buffer refilled with {filled['size']} sequences"
                                                             if resume else "")
            held_ref, behaviour = None, {}
        else:
            ray.get(replay.add_rows.remote(transitions["train"]))
            held = transitions["held_out"]
            held_ref = None
            if held:  # reference log-probs once (the KL anchor's term is part of the held-out loss)
                held_ref = rollout.annotate_reference([ray.put(transitions_to_experience(held, pad_id))])[0][0]
            behaviour = behaviour_summary(transitions["train"])
            source = (f"offline, {len(transitions['train'])} transitions, behaviour policy's mean reward "
                      f"{behaviour['data/behaviour_mean_reward']:.3f}")
        print(f"[rayrlhf] roles ready: {cfg.rollout.num_generators} generator(s), {cfg.cluster.num_learners} "
              f"learner(s), Q-learning ({source}); gamma {cfg.qlearn.gamma}, n_step {cfg.qlearn.n_step}, "
              f"conservative weight {cfg.qlearn.conservative_weight}, trainable fraction {info['trainable_fraction']:.4f}"
              + (f"; resumed from {resume} (step {ctx.start_step})" if resume else ""), flush=True)

        def evaluate(step: int, weights: Any = None) -> dict[str, float]:
            row: dict[str, float] = dict(behaviour)
            if held_ref is not None:
                row.update(learners.evaluate(step, [held_ref]))
            if weights is not None:
                rollout.sync_weights(weights)
            row.update(greedy_accuracy(rollout, eval_set.rows))
            return row

        if ctx.eval_due(0):
            with ctx.phase("eval"):
                ctx.log_base_eval(evaluate(0))
        if online:
            _online_steps(ctx, rollout, replay, learners, train_set, evaluate)
        else:
            _offline_steps(ctx, rollout, replay, learners, evaluate, {"skipped_at_load": dict(transitions["skipped"])})
    finally:
        if learners is not None:
            learners.stop()
        rollout.shutdown()
        ray.kill(replay)
    return ctx.result()


def _learn(ctx: RunContext, rollout: RolloutGroup, replay: Any, learners: LearnerGroup, step: int,
           sync: bool) -> tuple[dict, dict]:
    """Samples the step's batch from the replay buffer and updates the learners."""
    cfg = ctx.cfg
    batch = replay.sample.remote(cfg.qlearn.batch_sequences, step)
    batch_refs, _ = rollout.annotate_reference([batch])  # only with the KL anchor (and no LoRA)
    with ctx.phase("learn"):
        result = learners.learn(step, batch_refs, save_dir=ctx.checkpoint_dir(step), sync=sync)
    return result, ray.get(replay.stats.remote())


def _online_steps(ctx: RunContext, rollout: RolloutGroup, replay: Any, learners: LearnerGroup, train_set: Any,
                  evaluate: Any) -> None:
    cfg = ctx.cfg
    sampler = PromptSampler(len(train_set.rows), cfg.rollout.prompts_per_step, cfg.run.seed, **ctx.run_state["sampler"])
    greedy = cfg.qlearn.acting == "greedy"
    for step in ctx.steps():
        prompt_ids = sampler.next()
        with ctx.phase("generate"):
            exp, gen_stats = rollout.generate_checked([train_set.rows[i] for i in prompt_ids], prompt_ids,
                                                      greedy=greedy, seed=sampling_seed(cfg.run.seed, step))
        with ctx.phase("score"):
            exp, score_stats = rollout.score(exp)
            score_stats = ray.get(score_stats)
        with ctx.phase("replay"):
            added = ray.get(replay.add.remote(exp, step))
        row: dict[str, Any] = {"skipped_at_load": dict(train_set.skipped), "data/prompt_ids": prompt_ids}
        if added["size"] < max(cfg.qlearn.warmup_sequences, 1):  # still filling the buffer: no update
            save_dir = ctx.checkpoint_dir(step)
            if save_dir:
                saved = learners.save(step, save_dir)
                ctx.finish_checkpoint(saved["saved"], step, sampler, saved["version"])
                row["checkpoint"] = saved["saved"]
            row.update(step_metrics(gen_stats, score_stats, {"learner/warmup": 1.0}))
            row.update(_replay_metrics(added, added))
            ctx.log_step(step, row)
            continue
        result, stats = _learn(ctx, rollout, replay, learners, step, sync=True)
        with ctx.phase("sync"):
            load_times = rollout.sync_weights(result["weights"][0])
        if result.get("saved"):
            ctx.finish_checkpoint(result["saved"], step, sampler, result["version"])
            row["checkpoint"] = result["saved"]
        row.update(step_metrics(gen_stats, score_stats, result["metrics"]))
        row.update(_replay_metrics(added, stats))
        row["sync/load_s"] = max(load_times)
        if ctx.eval_due(step):
            with ctx.phase("eval"):
                row.update(evaluate(step))
        ctx.log_step(step, row)


def _offline_steps(ctx: RunContext, rollout: RolloutGroup, replay: Any, learners: LearnerGroup, evaluate: Any,
                   loaded: dict[str, Any]) -> None:
    # The offline loop consumes no prompts; the sampler only carries the checkpoint format.
    sampler = PromptSampler(1, 1, ctx.cfg.run.seed, **ctx.run_state["sampler"])
    for step in ctx.steps():
        eval_now = ctx.eval_due(step)
        result, stats = _learn(ctx, rollout, replay, learners, step, sync=eval_now)
        if result.get("saved"):
            ctx.finish_checkpoint(result["saved"], step, sampler, result["version"])
        row: dict[str, Any] = {**loaded, **result["metrics"], **_replay_metrics({}, stats)}
        if result.get("saved"):
            row["checkpoint"] = result["saved"]
        if eval_now:
            with ctx.phase("eval"):
                row.update(evaluate(step, result["weights"][0]))
        ctx.log_step(step, row)
        if ctx.early_stop(row, lambda: learners.save(step, ctx.checkpoint_path(step)), sampler):
            break


def _replay_metrics(added: dict, stats: dict) -> dict[str, float]:
    out = {"replay/size": float(stats.get("size", 0)), "replay/evicted": float(stats.get("evicted", 0))}
    if stats.get("mean_behaviour_version") is not None:
        out["replay/mean_behaviour_version"] = float(stats["mean_behaviour_version"])
    if added:
        out["replay/added"] = float(added.get("rows", 0))
        for k, n in (added.get("skipped") or {}).items():
            out[f"replay/skipped/{k}"] = float(n)
    return out
