"""PPO / GRPO-family recipe (Ouyang et al. 2022, fig. 2 step 3; Shao et al. 2024, alg. 1):

    for each step:
        prompts    <- sample a batch of prompts
        experience <- generators sample responses (rollout log-probs, policy version)
        experience <- scorer adds task rewards
        experience <- reference adds its log-probs (when a KL term needs them)
        learners   <- PPO update on the batch (advantages, clipped losses)
        generators <- the learners' new weights (verified by a probe)

Asynchronous (``rollout.max_staleness = s > 0``): the generation of the next s steps' batches
is started before the learners train on this one, so sampling overlaps learning. A batch is
then sampled by weights up to s versions older than the learners' (its ``policy_version``);
one older than that never reaches a loss (counted as ``skipped.stale``), and the importance
correction from the rollout policy to the old policy is on by default. Weight syncs queue
behind the generation calls on each generator actor, so an update never lands mid-generation;
with ``rollout.inflight_updates`` it lands between two decoding steps instead, and a batch counts
as sampled by its oldest tokens' version.
With s = 0 this is the synchronous loop above, step for step.

Placement, object refs and data-parallel details live in ``cluster/actor_groups.py`` and
``cluster/learner_group.py``; this file is the algorithm's loop.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cluster.actor_groups import RolloutGroup
from cluster.learner_group import LearnerGroup, learner_spec
from cluster.ledger import Ledger, issue_records, outcome_records
from cluster.transports import make_transport
from cluster.weight_sync import probe_token_ids, sync_tolerance
from cluster.metrics import step_metrics
from cluster.config import Config, UserError
from cluster.run_context import PromptSampler, RunContext, RunResult, greedy_accuracy


def load_data(cfg: Config):
    """Train and held-out prompts of ``data.task``; checks that the reward function imports."""
    from actors.scorer import SCORER_KINDS, resolve_reward_fn
    from actors.tasks import load_prompts

    try:
        train_set, eval_set = load_prompts(
            cfg.data.task, cfg.data.train_size, cfg.data.eval_size, cfg.run.seed, cfg.data.task_kwargs,
            cfg.data.instruction,
        )
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.task: {e}") from None
    try:
        if cfg.reward.function not in SCORER_KINDS:  # a rule function: it must import
            resolve_reward_fn(cfg.reward.function)
    except ValueError as e:
        raise UserError(f"reward.function: {e}") from None
    if cfg.reward.model and not (Path(cfg.reward.model) / "config.json").is_file():
        raise UserError(f"reward.model: {cfg.reward.model} is not a model folder (no config.json)")
    description = (f"{len(train_set)} train / {len(eval_set)} held-out prompts from {cfg.data.task}"
                   + (f" (skipped while loading: {train_set.skipped})" if train_set.skipped else ""))
    return train_set, eval_set, description


def sampling_seed(run_seed: int, step: int) -> int:
    """Seed of a step's sampling: a function of the step, so a resumed run samples as the
    uninterrupted one would."""
    return run_seed * 100_003 + step


def export_step(ctx: RunContext, step: int, exp_refs: list) -> list:
    """Each generator's scored record as token transitions in ``<run>/data/transitions/`` (the
    data of offline Q-learning), written by Ray tasks while the learners train."""
    from cluster.actor_groups import export_transitions

    task = ray.remote(export_transitions).options(num_cpus=0)
    folder = ctx.dir / "data" / "transitions"
    return [task.remote(e, str(folder / f"step-{step:06d}-{i:02d}.parquet")) for i, e in enumerate(exp_refs)]


def run(ctx: RunContext, model_path: str, train_set, eval_set) -> RunResult:
    cfg = ctx.cfg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    resume = str(ctx.resume_from) if ctx.resume_from else None
    probe_ids = probe_token_ids(tok) if cfg.rollout.verify_sync else []
    learners = LearnerGroup(learner_spec(cfg, model_path, pad_id, resume_from=resume, probe_ids=probe_ids),
                            ctx.dir / "ray_train")
    try:  # colocated: each generator goes to its learner's node, so the learners are placed first
        colocate = learners.wait_ready()["nodes"] if cfg.cluster.layout == "colocated" else None
        rollout = RolloutGroup(cfg, model_path, policy_path=resume, policy_version=int(ctx.run_state["version"]),
                               colocate_nodes=colocate)
    except BaseException:
        learners.stop()
        raise
    tolerance = sync_tolerance(cfg.model.generator_dtype, cfg.rollout.sync_tolerance)
    transport = make_transport(cfg.rollout.weight_transport, cfg.rollout.bucket_mb, cfg.rollout.collective_backend)
    # A generator that restarts gets the weights the learners hold.
    rollout.weights_source = lambda: learners.current_weights()["weights"][0]
    ledger = Ledger(ctx.dir, resume_step=ctx.start_step if resume else None)
    try:
        rollout.wait_ready()
        info = learners.wait_ready()
        ref_role = ("no reference (no KL term)" if not cfg.ppo.uses_reference else
                    "reference = base model with the LoRA adapter disabled, in the learner" if cfg.lora.enabled else
                    "1 reference")
        scorer = "the generators as judge" if rollout.scorer is None else "1 scorer"
        print(f"[rayrlhf] roles ready: {cfg.rollout.num_generators} generator(s), {scorer}, {ref_role}, "
              f"{cfg.cluster.num_learners} learner(s); {cfg.ppo.advantage_estimator} advantages, trainable "
              f"fraction {info['trainable_fraction']:.4f}"
              + (f"; resumed from {resume} (step {ctx.start_step}, policy version {info['version']})" if resume else ""),
              flush=True)
        # Where the roles run (multi-node layouts): each generator's node, learner rank 0's node.
        (ctx.dir / "placement.json").write_text(json.dumps({
            "layout": cfg.cluster.layout, "generators": rollout.nodes(), "learner_rank0": info.get("node"),
            "learners": info.get("nodes"), "generator_placement_group": rollout.placement_group is not None,
            "learner_env": info.get("env")}))
        sampler = PromptSampler(len(train_set.rows), cfg.rollout.prompts_per_step, cfg.run.seed,
                                **ctx.run_state["sampler"])
        learner_version = int(info["version"])
        if ctx.eval_due(0):
            with ctx.phase("eval"):
                ctx.log_base_eval(greedy_accuracy(rollout, eval_set.rows))
        max_staleness = cfg.rollout.max_staleness
        ahead: deque[_Launched] = deque()

        def launch(step: int) -> _Launched:
            """Draws the step's prompts and starts their generation (returns at once)."""
            prompt_ids, uids = sampler.next_with_uids()
            units = rollout.assignment(uids)  # the uids of each work unit
            ledger.record("issued", issue_records(step, uids, prompt_ids, [k for k, u in enumerate(units) for _ in u],
                                                  rollout.version))
            # Group ids are the prompts' uids: a prompt drawn twice in one batch is two groups.
            pending = rollout.submit([train_set.rows[i] for i in prompt_ids], uids, seed=sampling_seed(cfg.run.seed, step))
            return _Launched(step, prompt_ids, uids, units, pending, sampler.consumed)

        for step in ctx.steps():
            cur = ahead.popleft() if ahead else launch(step)

            def reissue(gen: int, group: list[int], err: Exception, step: int = step) -> None:
                ledger.record("reissued", [{"step": step, "uid": u, "generator": gen, "reason": type(err).__name__}
                                           for u in group])

            with ctx.phase("generate"):
                exp, gen_stats = rollout.collect(cur.pending, on_reissue=reissue)
            with ctx.phase("score"):  # the units already finished were scored while the rest generated
                exp, score_stats = rollout.score(exp, pending=cur.pending)
                score_stats = ray.get(score_stats)
            sampled = min(s["policy_version"] for s in gen_stats)
            staleness = learner_version - sampled
            scored, dropped, kept = outcome_records(step, cur.units, gen_stats, score_stats, cfg.rollout.samples_per_prompt)
            ledger.record("scored", scored)
            ledger.record("dropped", dropped)
            # Overlap: the next batches' generation runs while the learners train on this one.
            while len(ahead) < max_staleness and step + len(ahead) + 1 <= cfg.run.steps:
                ahead.append(launch(step + len(ahead) + 1))
            if staleness > max_staleness:
                # The pipeline never lets this happen; should it, the batch never reaches a loss.
                n = sum(len(s["groups"]) for s in gen_stats)
                ledger.record("dropped", [{"step": step, "uid": u, "samples": k, "all": True, "reasons": {"stale": k}}
                                          for u, k in kept.items()])
                print(f"[rayrlhf] step {step}: batch sampled by policy version {sampled}, {staleness} behind the "
                      f"learners (rollout.max_staleness={max_staleness}): {n} samples dropped", flush=True)
                ctx.log_step(step, {"skipped": {"stale": n}, "policy/staleness": staleness, **ledger.metrics()})
                continue
            with ctx.phase("reference"):
                exp, ref_stats = rollout.annotate_reference(exp)
                ref_stats = ray.get(ref_stats)
            exports = export_step(ctx, step, exp) if cfg.run.export_transitions else []
            save_dir = ctx.checkpoint_dir(step)
            with ctx.phase("learn"):
                result = learners.learn(step, exp, save_dir=save_dir, sync=transport.packs_in_step)
            ledger.record("trained", [{"step": step, "uid": u, "samples": n, "version": result["version"],
                                       "sampled_version": sampled, "learner_version": learner_version}
                                      for u, n in kept.items()])
            with ctx.phase("sync"):
                synced = transport.sync(result, rollout, learners)
                verified = rollout.verify_sync(probe_ids, synced["probe"], result["version"], tolerance) \
                    if probe_ids else {}
            position = _SamplerPosition(cur.consumed)  # the prompts of batches started ahead are not in it
            if result.get("saved"):
                ctx.finish_checkpoint(result["saved"], step, position, result["version"])
            _record_restarts(ledger, step, rollout, learners)

            row: dict[str, Any] = {"skipped_at_load": dict(train_set.skipped), "data/prompt_ids": cur.prompt_ids}
            row.update(step_metrics(gen_stats, score_stats, result["metrics"]))
            row["policy/version"] = result["version"]
            row["policy/staleness"] = staleness
            row["queue/depth"] = len(ahead)
            # How the pool spread this step's work units over the generators.
            row["rollout/units_by_generator"] = [sum(1 for s in gen_stats if s.get("generator") == g)
                                                 for g in range(len(rollout.generators))]
            learner_version = result["version"]
            row.update(ledger.metrics())
            row["restarts/generator"], row["restarts/learner"] = rollout.restarts, learners.restarts
            row["reference/in_learner"] = rollout.reference is None and cfg.ppo.uses_reference
            row["sync/load_s"] = max(synced["load_s"])
            row.update({k: v for k, v in synced.items() if k.startswith("sync/")})
            row.update(verified)
            row["memory/generator_peak_gb"] = max(s["peak_rss_gb"] for s in gen_stats)
            row["memory/scorer_peak_gb"] = max(s["peak_rss_gb"] for s in score_stats)  # the judging generators' with llm_judge
            if ref_stats:
                row["memory/reference_peak_gb"] = max(s["peak_rss_gb"] for s in ref_stats)
            if result.get("saved"):
                row["checkpoint"] = result["saved"]
            if exports:
                done = ray.get(exports)
                row["export/transitions"] = sum(d["rows"] for d in done)
            if ctx.eval_due(step):
                with ctx.phase("eval"):
                    row.update(greedy_accuracy(rollout, eval_set.rows))
            ctx.log_step(step, row)
    finally:
        learners.stop()
        rollout.shutdown()
    return ctx.result()


@dataclass
class _Launched:
    """A step whose generation has been started."""

    step: int
    prompt_ids: list[int]
    uids: list[int]
    # The uids of each work unit (in unit order).
    units: list[list[int]]
    # ``RolloutGroup.submit``'s handle.
    pending: dict
    # The sampler's position after this step's prompts (what a checkpoint of this step records).
    consumed: int


@dataclass
class _SamplerPosition:
    """A checkpoint's prompt-sampler state: the position after the checkpointed step's prompts."""

    consumed: int

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}


def _record_restarts(ledger: Ledger, step: int, rollout: RolloutGroup, learners: LearnerGroup) -> None:
    """Restarts since the last step into the ledger (each role keeps its own list)."""
    for role, entries in (("generator", rollout.restart_log), ("learner", learners.restart_log)):
        if entries:
            ledger.record("restart", [{"step": step, "role": role, "detail": e} for e in entries])
            entries.clear()
