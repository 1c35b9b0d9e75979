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

from actors.data.transitions import transitions_to_experience
from cluster.config import Config, UserError
from cluster.config.role_settings import self_judging
from cluster.recipes import Check, Recipe, RoleSet, reference_where
from cluster.data.sources import load_task_prompts
from cluster.ops.ledger import issue_records, outcome_records
from cluster.ops.metrics import step_metrics
from cluster.roles import Roles
from cluster.run_context import RunContext, RunResult
from cluster.data.prompts import PromptSampler, eval_seed, held_out_eval, sampling_seed
from cluster.data.streaming import make_sampler
from cluster.step_loop import StepOutcome, run_steps


def load_data(cfg: Config):
    """data.task's prompts (online acting, held-out evaluation) and, offline, the transitions of
    data.transition_file (checked and counted here, before anything starts)."""
    train_set, eval_set, description = load_task_prompts(cfg)
    if not cfg.data.transition_file:
        return (train_set, None), eval_set, description + "; online Q-learning"
    from actors.data.transitions import TransitionsError, read_transitions

    try:
        rows, skipped = read_transitions(cfg.data.transition_file)
    except (FileNotFoundError, TransitionsError) as e:
        raise UserError(f"data.transition_file: {e}") from None
    train, held = split_by_group(rows, min(cfg.qlearn.eval_transitions, len(rows) // 4), cfg.run.seed)
    if not train:
        raise UserError(f"data.transition_file: no usable transitions (excluded while reading: {skipped})")
    transitions = {"train": train, "held_out": held, "skipped": skipped}
    description += (
        f"; offline Q-learning on {len(train)} transitions ({len(held)} held out) from "
        f"{cfg.data.transition_file}" + (f", excluded while reading: {skipped}" if skipped else "")
    )
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


def behaviour_summary(rows: list) -> dict[str, float]:
    """The logged data's own reward: what its behaviour policy earned (sampled)."""
    returns = [sum(t.rewards) for t in rows]
    return {
        "data/behaviour_mean_reward": sum(returns) / len(returns),
        "data/behaviour_versions": float(len({t.behaviour_version for t in rows})),
        "data/transitions": float(len(rows)),
    }


def run(ctx: RunContext, model_path: str, train_data, eval_set) -> RunResult:
    cfg = ctx.cfg
    train_set, transitions = train_data
    with Roles(ctx, model_path, unit="prompt" if transitions is None else "transition") as roles:
        roles.start_learners()
        roles.start_generators()
        steps = (
            OnlineSteps(ctx, roles, train_set, eval_set)
            if transitions is None
            else OfflineSteps(ctx, roles, transitions, eval_set)
        )
        q = cfg.qlearn
        roles.ready(
            f"Q-learning ({steps.source}); gamma {q.gamma}, n_step {q.n_step}, "
            f"conservative weight {q.conservative_weight}"
        )
        return run_steps(ctx, steps)


class QSteps:
    """What online and offline Q-learning share: the replay buffer's batch into the learners,
    the evaluation, the checkpoint position."""

    def __init__(self, ctx: RunContext, roles: Roles, eval_set: Any, sampler: PromptSampler) -> None:
        self.ctx, self.cfg, self.roles, self.eval_set, self.sampler = ctx, ctx.cfg, roles, eval_set, sampler
        self.rollout, self.learners = roles.rollout, roles.learners
        self.held_ref: Any = None
        self.behaviour: dict[str, float] = {}

    def position(self) -> PromptSampler:
        return self.sampler

    def close(self) -> None:
        getattr(self.sampler, "close", lambda: None)()

    def save(self, step: int, folder: str) -> dict:
        return self.learners.save(step, folder)

    def evaluate(self, step: int, weights: Any) -> dict[str, float]:
        row: dict[str, float] = dict(self.behaviour)
        if self.held_ref is not None:
            row.update(self.learners.evaluate(step, [self.held_ref]))
        if weights is not None:
            self.rollout.sync_weights(weights)
        row.update(held_out_eval(self.rollout, self.eval_set.rows, eval_seed(self.cfg)))
        return row

    def learn(self, step: int, sync: bool) -> tuple[dict, dict]:
        """Samples the step's batch from the replay buffer and updates the learners."""
        batch = self.roles.replay.sample.remote(self.cfg.qlearn.batch_sequences, step)
        batch_refs, _ = self.rollout.annotate_checked([batch])  # only with the KL anchor (and no LoRA)
        with self.ctx.phase("learn"):
            result = self.learners.learn(step, batch_refs, save_dir=self.ctx.checkpoint_dir(step), sync=sync)
        return result, ray.get(self.roles.replay.stats.remote())


class OnlineSteps(QSteps):
    def __init__(self, ctx: RunContext, roles: Roles, train_set: Any, eval_set: Any) -> None:
        cfg = ctx.cfg
        super().__init__(
            ctx,
            roles,
            eval_set,
            make_sampler(train_set, cfg.rollout.prompts_per_step, cfg.run.seed, ctx.run_state["sampler"]),
        )
        self.train_set, self.ledger = train_set, roles.ledger
        export_dir = str(ctx.dir / "data" / "transitions")
        replay = roles.start_replay(cfg.qlearn.buffer_capacity, export_dir, whole_prompts(cfg))
        self.source = f"online, acting {cfg.qlearn.acting}"
        if roles.resume:
            filled = ray.get(replay.refill.remote(export_dir, ctx.start_step))
            self.source += f", buffer refilled with {filled['size']} sequences"

    def step(self, step: int) -> StepOutcome:
        cfg = self.cfg
        exp, gen_stats, score_stats, kept, prompt_ids = self._act(step)
        with self.ctx.phase("replay"):
            added = ray.get(self.roles.replay.add.remote(exp, step))
        # "trained": the prompt's samples are in the buffer the learners sample from.
        self.ledger.record("trained", [{"step": step, "uid": u, "samples": n, "replay": True} for u, n in kept.items()])
        row: dict[str, Any] = {"skipped_at_load": dict(self.train_set.skipped), "data/prompt_ids": prompt_ids}
        if added["size"] < max(cfg.qlearn.warmup_sequences, 1):  # still filling the buffer: no update
            saved = self.learners.save(step, self.ctx.checkpoint_dir(step)) if self.ctx.checkpoint_dir(step) else {}
            row.update(step_metrics(gen_stats, score_stats, {"learner/warmup": 1.0}))
            row.update({**_replay_metrics(added, added), **self.ledger.metrics(), **self.roles.record_restarts(step)})
            return StepOutcome(row, saved=saved.get("saved"), version=saved.get("version", 0))
        result, stats = self.learn(step, sync=True)
        with self.ctx.phase("sync"):
            load_times = self.rollout.sync_weights(result["weights"][0], version=result["version"])
        row.update(step_metrics(gen_stats, score_stats, result["metrics"]))
        row.update(
            {
                **_replay_metrics(added, stats),
                "sync/load_s": max(load_times),
                **self.ledger.metrics(),
                **self.roles.record_restarts(step),
            }
        )
        return StepOutcome(row, saved=result.get("saved"), version=result["version"])

    def _act(self, step: int) -> tuple[list, list[dict], list[dict], dict, list[int]]:
        """The step's prompts acted on by the generators and scored, in the ledger."""
        prompt_ids, uids = self.sampler.next_with_uids()
        units = self.rollout.assignment(uids)
        self.ledger.record(
            "issued",
            issue_records(step, uids, prompt_ids, [k for k, u in enumerate(units) for _ in u], self.rollout.version),
        )

        def reissue(gen: int, group: list[int], err: Exception) -> None:
            self.ledger.record(
                "reissued", [{"step": step, "uid": u, "generator": gen, "reason": type(err).__name__} for u in group]
            )

        rows = [self.train_set.rows[i] for i in prompt_ids]
        with self.ctx.phase("generate"):
            pending = self.rollout.submit(
                rows, uids, greedy=self.cfg.qlearn.acting == "greedy", seed=sampling_seed(self.cfg.run.seed, step)
            )
            exp, gen_stats = self.rollout.collect(pending, on_reissue=reissue)
        with self.ctx.phase("score"):
            exp, score_stats = self.rollout.score_checked(exp, pending=pending)
        scored, dropped, kept = outcome_records(
            step, units, gen_stats, score_stats, self.cfg.rollout.samples_per_prompt
        )
        self.ledger.record("scored", scored)
        self.ledger.record("dropped", dropped)
        return exp, gen_stats, score_stats, kept, prompt_ids


class OfflineSteps(QSteps):
    def __init__(self, ctx: RunContext, roles: Roles, transitions: dict, eval_set: Any) -> None:
        # The offline loop consumes no prompts; the sampler only carries the checkpoint format.
        super().__init__(ctx, roles, eval_set, PromptSampler(1, 1, ctx.cfg.run.seed, **ctx.run_state["sampler"]))
        replay = roles.start_replay(max(len(transitions["train"]), 1), None, whole_prompts(ctx.cfg))
        ray.get(replay.add_rows.remote(transitions["train"]))
        held = transitions["held_out"]
        if held:  # reference log-probs once (the KL anchor's term is part of the held-out loss)
            self.held_ref = self.rollout.annotate_checked([ray.put(transitions_to_experience(held, roles.pad_id))])[0][
                0
            ]
        self.behaviour = behaviour_summary(transitions["train"])
        self.loaded = {"skipped_at_load": dict(transitions["skipped"])}
        self.source = (
            f"offline, {len(transitions['train'])} transitions, behaviour policy's mean reward "
            f"{self.behaviour['data/behaviour_mean_reward']:.3f}"
        )

    def step(self, step: int) -> StepOutcome:
        """The step's replay batch (its transitions in the ledger: a draw's uid is its position in
        the run's stream of draws, ``prompt`` the transition's row) and the Q update on it."""
        eval_now = self.ctx.eval_due(step)
        n, ledger = self.cfg.qlearn.batch_sequences, self.roles.ledger
        rows = ray.get(self.roles.replay.sampled.remote(n, step))
        uids = list(range((step - 1) * n, step * n))
        ledger.record("issued", [{"step": step, "uid": u, "prompt": r} for u, r in zip(uids, rows)])
        result, stats = self.learn(step, sync=eval_now)
        ledger.record("trained", [{"step": step, "uid": u, "samples": 1, "version": result["version"]} for u in uids])
        row = {
            **self.loaded,
            **result["metrics"],
            **_replay_metrics({}, stats),
            **ledger.metrics(),
            **self.roles.record_restarts(step),
        }
        return StepOutcome(
            row,
            saved=result.get("saved"),
            version=result["version"],
            weights=result["weights"][0] if eval_now else None,
        )


def whole_prompts(cfg: Config) -> bool:
    """Whether the replay samples whole prompts: a per-prompt baseline sees each prompt's samples."""
    return cfg.qlearn.reward_baseline == "group_mean"


def _replay_metrics(added: dict, stats: dict) -> dict[str, float]:
    out = {"replay/size": float(stats.get("size", 0)), "replay/evicted": float(stats.get("evicted", 0))}
    if stats.get("mean_behaviour_version") is not None:
        out["replay/mean_behaviour_version"] = float(stats["mean_behaviour_version"])
    if added:
        out["replay/added"] = float(added.get("rows", 0))
        for k, n in (added.get("skipped") or {}).items():
            out[f"replay/skipped/{k}"] = float(n)
    return out


def roles(cfg) -> RoleSet:
    return RoleSet(scorer=not self_judging(cfg), reference=reference_where(cfg, cfg.qlearn.uses_reference), replay=True)


def check(cfg) -> list[Check]:
    """What a calibrated Q (``qlearn.calibration``, ``state_value``) and the group filter
    (``skip_uniform_groups``) need of the rest of the config; what offline data rules out."""
    q, offline = cfg.qlearn, bool(cfg.data.transition_file)
    in_learners = cfg.train.reference == "learners" or cfg.lora.enabled
    return [
        (
            q.calibration == "none" or in_learners,
            "qlearn.calibration=reference reads the frozen initial model's logits in the learners: set "
            "train.reference=learners (or use LoRA, whose base model is the reference)",
        ),
        (
            q.calibration == "none" or q.conservative == "logsumexp" or q.conservative_weight == 0,
            "qlearn.calibration=reference measures Q against the reference's logits, which the floor term would "
            "need for every token of the vocabulary: use qlearn.conservative=logsumexp (or conservative_weight=0)",
        ),
        (
            q.state_value == "model" or (q.calibration == "reference" and q.value_grad == 0),
            "qlearn.state_value=reference reads each state's value as the calibration's reference (0) and trains "
            "the log-prob alone: set qlearn.calibration=reference and qlearn.value_grad=0",
        ),
        (
            not q.skip_uniform_groups or q.reward_baseline == "group_mean",
            "qlearn.skip_uniform_groups leaves out groups whose centered rewards are all 0, which needs groups: "
            "set qlearn.reward_baseline=group_mean",
        ),
        (
            not (offline and (cfg.env.name or cfg.rollout.agent)),
            "env.name: offline Q-learning (data.transition_file) runs no episodes; leave env.name empty",
        ),
        (
            not (offline and cfg.data.streaming),
            "data.streaming streams prompts to online Q-learning; offline "
            "(data.transition_file) reads its transitions: leave data.streaming off",
        ),
    ]


RECIPE = Recipe(
    name="qlearn",
    learner="qlearn",
    section="qlearn",
    roles=roles,
    check=check,
    batch=lambda cfg: (cfg.qlearn.batch_sequences, "sequences"),
    features=frozenset({"fsdp", "episodes", "streaming"}),
)
