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
correction from the rollout policy to the old policy is on by default. A weight sync waits
until the batches generating ahead are done, so each batch is sampled by one version whatever
the timing (what makes an asynchronous run reproducible and its resume exact); with
``rollout.inflight_updates`` it lands between two decoding steps instead, and a batch counts as
sampled by its oldest tokens' version.
With s = 0 this is the synchronous loop above, step for step.

The roles start in ``cluster/roles/__init__.py``; the loop around the step (evaluations, checkpoints,
the metrics row, early stopping) is ``cluster/step_loop.py``; this file is the algorithm's step.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ray

from cluster.config import UserError
from cluster.config.role_settings import self_judging
from cluster.recipes import Check, Recipe, RoleSet, reference_where
from cluster.data.sources import load_task_prompts
from cluster.ops.ledger import issue_records, outcome_records
from cluster.ops.metrics import step_metrics
from cluster.recipes.dynamic_sampling import Refill, informative_uids, select_groups
from cluster.roles import Roles
from cluster.run_context import RunContext, RunResult
from cluster.data.prompts import eval_seed, held_out_eval, sampling_seed
from cluster.data.streaming import make_sampler
from cluster.step_loop import StepOutcome, run_steps
from cluster.roles.transports import make_transport
from cluster.roles.weight_sync import probe_token_ids, sync_tolerance


def load_data(cfg: Any) -> tuple[Any, Any, str]:
    """The task's prompts; the teacher (``ppo.teacher``) and the critic's reward model
    (``ppo.critic_init``) checked first."""
    if cfg.ppo.teacher:
        check_teacher(cfg)
    if cfg.ppo.critic_init:
        import json

        conf = Path(cfg.ppo.critic_init) / "config.json"
        archs = json.loads(conf.read_text()).get("architectures") or [] if conf.is_file() else []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise UserError(
                f"ppo.critic_init: {cfg.ppo.critic_init} is not a reward-model folder (a "
                "*ForSequenceClassification checkpoint, as run.algorithm=reward_model saves)"
            )
        from cluster.assets import resolve_model

        check_same_tokens(
            "ppo.critic_init",
            Path(cfg.ppo.critic_init),
            Path(resolve_model(cfg.model.path, cfg.model.cache_dir or None)),
        )
    return load_task_prompts(cfg)


def check_teacher(cfg: Any) -> None:
    """One line before anything starts: the teacher is a model folder with the policy's vocabulary
    (its log-probs must score the student's token ids)."""
    from cluster.assets import resolve_model

    teacher = Path(cfg.ppo.teacher)
    if not (teacher / "config.json").is_file():
        raise UserError(f"ppo.teacher: {teacher} is not a model folder (no config.json)")
    try:
        student = Path(resolve_model(cfg.model.path, cfg.model.cache_dir or None))
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    check_same_tokens("ppo.teacher", teacher, student)


def check_same_tokens(what: str, other: Path, student: Path) -> None:
    """``other`` reads token ids as the policy does: the same tokenizer vocabulary (a larger
    embedding, padded for speed, is fine; the same vocabulary size of another tokenizer is not)."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(str(other)).get_vocab()
    except (OSError, ValueError) as e:
        raise UserError(f"{what}: {other} has no tokenizer to check its token ids against the policy's ({e})") from None
    ours = AutoTokenizer.from_pretrained(str(student)).get_vocab()
    if theirs != ours:
        differ = sum(1 for t, i in ours.items() if theirs.get(t) != i)
        raise UserError(
            f"{what}: its tokenizer is not the policy's ({differ} of {len(ours)} tokens differ); "
            "its log-probs or values would read other tokens"
        )


# An asynchronous run's batches already generating at a checkpoint (trainer_state/).
AHEAD_FILE = "ahead_batches.pt"


def run(ctx: RunContext, model_path: str, train_set: Any, eval_set: Any) -> RunResult:
    cfg = ctx.cfg
    with Roles(ctx, model_path) as roles:
        probe_ids = probe_token_ids(roles.tokenizer) if cfg.rollout.verify_sync else []
        roles.start_learners(probe_ids)
        roles.start_generators(colocate=cfg.cluster.layout == "colocated")
        reference = (
            "; no reference (no KL term)"
            if not cfg.ppo.uses_reference
            else f"; distilling from the teacher {cfg.ppo.teacher} (reference role)"
            if cfg.ppo.teacher
            else "; reference = base model with the LoRA adapter disabled, in the learner"
            if cfg.lora.enabled
            else "; reference = a frozen copy in the learners"
            if cfg.train.reference == "learners"
            else ""
        )
        roles.ready(f"{cfg.ppo.advantage_estimator} advantages{reference}")
        return run_steps(ctx, PPOSteps(ctx, roles, train_set, eval_set, probe_ids))


class PPOSteps:
    """The step of the module docstring's loop, with the launch-ahead queue feeding it."""

    def __init__(self, ctx: RunContext, roles: Roles, train_set: Any, eval_set: Any, probe_ids: list[int]) -> None:
        cfg = self.cfg = ctx.cfg
        self.ctx, self.roles, self.rollout, self.learners = ctx, roles, roles.rollout, roles.learners
        self.train_set, self.eval_set, self.probe_ids = train_set, eval_set, probe_ids
        self.ledger = roles.ledger
        self.sampler = make_sampler(train_set, cfg.rollout.prompts_per_step, cfg.run.seed, ctx.run_state["sampler"])
        self.queue = LaunchQueue(self._launch, cfg.rollout.max_staleness, cfg.run.steps)
        self.transport = make_transport(
            cfg.rollout.weight_transport, cfg.rollout.bucket_mb, cfg.rollout.collective_backend
        )
        self.tolerance = sync_tolerance(cfg.model.generator_dtype, cfg.rollout.sync_tolerance)
        self.learner_version = int(self.learners.wait_ready()["version"])
        self._position = SamplerPosition(self.sampler.consumed)
        if roles.resume:
            self._restore_ahead(Path(roles.resume) / "trainer_state" / AHEAD_FILE)

    def evaluate(self, step: int, weights: Any) -> dict[str, float]:
        return held_out_eval(
            self.rollout, self.eval_set.rows, eval_seed(self.cfg)
        )  # the generators hold the current weights

    def position(self) -> "SamplerPosition":
        return self._position  # the prompts of batches started ahead are not in it

    def close(self) -> None:
        getattr(self.sampler, "close", lambda: None)()

    def save(self, step: int, folder: str) -> dict:
        return self.learners.save(step, folder)

    def step(self, step: int) -> StepOutcome:
        cur = self.queue.take(step)
        exp, gen_stats, score_stats = self._sample_and_score(step, cur)
        refill = self._refill(step, cur, exp, gen_stats, score_stats) if self.cfg.rollout.dynamic_sampling else None
        sampled = min(s["policy_version"] for s in gen_stats)
        kept = self._record_outcomes(step, cur, gen_stats, score_stats)
        if refill is not None:  # only the informative groups it kept reach the loss
            keep = set(refill.keep)
            self.ledger.record("dropped", refill.dropped_records(step, kept))
            kept = {u: n for u, n in kept.items() if u in keep}
            exp = select_groups(exp, keep)
            if not exp:
                return self._nothing_informative(step, cur, gen_stats, score_stats, refill)
        self.queue.fill(step)  # the next batches generate while the learners train on this one
        if self.learner_version - sampled > self.cfg.rollout.max_staleness:
            return self._drop_stale(step, sampled, gen_stats, kept)
        with self.ctx.phase("reference"):
            exp, ref_stats = self.rollout.annotate_checked(exp)
        exports = export_step(self.ctx, step, exp) if self.cfg.run.export_transitions else []
        with self.ctx.phase("learn"):
            result = self.learners.learn(
                step, exp, save_dir=self.ctx.checkpoint_dir(step), sync=self.transport.packs_in_step
            )
        if result.get("saved"):
            self._save_ahead(Path(result["saved"]) / "trainer_state" / AHEAD_FILE)
        self.ledger.record(
            "trained",
            [
                {
                    "step": step,
                    "uid": u,
                    "samples": n,
                    "version": result["version"],
                    "sampled_version": sampled,
                    "learner_version": self.learner_version,
                }
                for u, n in kept.items()
            ],
        )
        synced = self._sync(result)
        self._position = SamplerPosition(cur.consumed)
        row = {
            "skipped_at_load": dict(self.train_set.skipped),
            "data/prompt_ids": cur.prompt_ids,
            **step_metrics(gen_stats, score_stats, result["metrics"]),
            "policy/version": result["version"],
            "policy/staleness": self.learner_version - sampled,
            **self._pool_metrics(gen_stats),
            **synced,
            **self.ledger.metrics(),
            **self.roles.record_restarts(step),
            **_memory_peaks(gen_stats, score_stats, ref_stats),
            **(refill.metrics() if refill else {}),
        }
        if exports:
            row["export/transitions"] = sum(d["rows"] for d in ray.get(exports))
        self.learner_version = result["version"]
        return StepOutcome(row, saved=result.get("saved"), version=result["version"])

    def _launch(self, step: int, draw: int = 0) -> "Launched":
        """Draws the step's prompts and starts their generation (returns at once). ``draw`` > 0:
        an extra draw of dynamic sampling (its own sampling seed)."""
        prompt_ids, uids = self.sampler.next_with_uids()
        units = self.rollout.assignment(uids)  # the uids of each work unit
        self.ledger.record(
            "issued",
            issue_records(step, uids, prompt_ids, [k for k, u in enumerate(units) for _ in u], self.rollout.version),
        )
        # Group ids are the prompts' uids: a prompt drawn twice in one batch is two groups.
        rows = [self.train_set.rows[i] for i in prompt_ids]
        pending = self.rollout.submit(rows, uids, seed=sampling_seed(self.cfg.run.seed, step) + 104_729 * draw)
        return Launched(step, prompt_ids, uids, units, pending, self.sampler.consumed)

    def _refill(self, step: int, cur: "Launched", exp: list, gen_stats: list[dict], score_stats: list[dict]) -> Refill:
        """DAPO's dynamic sampling (``dynamic_sampling.py``): draws more prompts until the batch
        holds ``rollout.dynamic_sampling`` informative groups or the draw budget is spent. The
        extra units join ``cur``, ``exp`` and the stats lists in place."""
        refill = Refill(self.cfg.rollout.dynamic_sampling)
        refill.informative = informative_uids(cur.units, score_stats)
        while len(refill.informative) < refill.target and refill.draws < self.cfg.rollout.dynamic_sampling_max_draws:
            refill.draws += 1
            extra = self._launch(step, draw=refill.draws)
            e, g, sc = self._sample_and_score(step, extra)
            exp += e
            gen_stats += g
            score_stats += sc
            cur.units += extra.units
            cur.uids += extra.uids
            cur.prompt_ids += extra.prompt_ids
            cur.consumed = extra.consumed
            refill.informative += informative_uids(extra.units, sc)
        return refill

    def _nothing_informative(
        self, step: int, cur: "Launched", gen_stats: list[dict], score_stats: list[dict], refill: Refill
    ) -> StepOutcome:
        """Every draw scored its groups evenly: no update this step (the groups are in the ledger
        as dropped, uninformative)."""
        self._position = SamplerPosition(cur.consumed)
        print(
            f"[rayrlhf] step {step}: no group with a non-zero advantage in {refill.draws + 1} draws "
            f"(rollout.dynamic_sampling_max_draws={self.cfg.rollout.dynamic_sampling_max_draws}): no update",
            flush=True,
        )
        return StepOutcome(
            {**step_metrics(gen_stats, score_stats, {}), **refill.metrics(), **self.ledger.metrics()},
            version=self.learner_version,
            trained=False,
        )

    def _sample_and_score(self, step: int, cur: "Launched") -> tuple[list, list[dict], list[dict]]:
        if cur.done is not None:  # finished before a checkpoint (asynchronous runs)
            return cur.done

        def reissue(gen: int, group: list[int], err: Exception) -> None:
            self.ledger.record(
                "reissued", [{"step": step, "uid": u, "generator": gen, "reason": type(err).__name__} for u in group]
            )

        # time/generate_s: the wait for the batch; an asynchronous run launched it steps earlier,
        # so there it is what the learner still waited, not the batch's generation time.
        with self.ctx.phase("generate"):
            exp, gen_stats = self.rollout.collect(cur.pending, on_reissue=reissue)
        with self.ctx.phase("score"):  # the units already finished were scored while the rest generated
            exp, score_stats = self.rollout.score_checked(exp, pending=cur.pending)
        return exp, gen_stats, score_stats

    def _save_ahead(self, path: Path) -> None:
        """Asynchronous runs: the batches already generating for the next steps (sampled by
        older weights than the checkpoint's) are finished, scored and kept in the checkpoint, so
        a resumed run trains on exactly the batches the uninterrupted one did."""
        import torch

        if not len(self.queue):
            return
        saved = []
        self._finish_ahead()
        for cur in self.queue.ahead:
            exp, gen_stats, score_stats = cur.done
            saved.append(
                {
                    "launched": dataclasses.asdict(dataclasses.replace(cur, pending=None, done=None)),
                    "records": [e.fields() for e in ray.get(exp)],
                    "gen_stats": gen_stats,
                    "score_stats": score_stats,
                }
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(saved, path)

    def _finish_ahead(self) -> None:
        """Waits for the batches generating ahead (and scores them). Before a sync this keeps every
        batch sampled by one policy version: the pool hands a generator its next unit when the
        last one ends, so a sync queued meanwhile would land between two units of the batch, and
        which units ran on the new weights would depend on timing (a resumed run would then not
        draw the same samples as the uninterrupted one)."""
        for cur in self.queue.ahead:
            if cur.done is None:
                cur.done = self._sample_and_score(cur.step, cur)

    def _restore_ahead(self, path: Path) -> None:
        """The batches a checkpoint kept (``_save_ahead``) go back into the queue, issued again in
        the ledger; the prompt stream continues after them."""
        import torch

        from learners.experience import Experience

        if not path.is_file():
            return
        for entry in torch.load(path, weights_only=True):
            cur = Launched(**entry["launched"])
            exp = [ray.put(Experience(**fields)) for fields in entry["records"]]
            cur.done = (exp, entry["gen_stats"], entry["score_stats"])
            self.queue.ahead.append(cur)
            self.ledger.record(
                "issued",
                issue_records(
                    cur.step, cur.uids, cur.prompt_ids, [k for k, u in enumerate(cur.units) for _ in u], None
                ),
            )
            self.sampler.consumed = cur.consumed

    def _record_outcomes(self, step: int, cur: "Launched", gen_stats: list[dict], score_stats: list[dict]) -> dict:
        scored, dropped, kept = outcome_records(
            step, cur.units, gen_stats, score_stats, self.cfg.rollout.samples_per_prompt
        )
        self.ledger.record("scored", scored)
        self.ledger.record("dropped", dropped)
        return kept

    def _drop_stale(self, step: int, sampled: int, gen_stats: list[dict], kept: dict) -> StepOutcome:
        """The pipeline never lets a batch fall further behind than allowed; should it, the batch
        never reaches a loss (counted and in the ledger)."""
        n = sum(len(s["groups"]) for s in gen_stats)
        self.ledger.record(
            "dropped",
            [{"step": step, "uid": u, "samples": k, "all": True, "reasons": {"stale": k}} for u, k in kept.items()],
        )
        staleness = self.learner_version - sampled
        print(
            f"[rayrlhf] step {step}: batch sampled by policy version {sampled}, {staleness} behind the learners "
            f"(rollout.max_staleness={self.cfg.rollout.max_staleness}): {n} samples dropped",
            flush=True,
        )
        return StepOutcome(
            {"skipped": {"stale": n}, "policy/staleness": staleness, **self.ledger.metrics()},
            version=self.learner_version,
            trained=False,
        )

    def _sync(self, result: dict) -> dict[str, Any]:
        """The new weights into the generators, verified by the probe when configured. Without
        in-flight updates, once the batches generating ahead are done (``_finish_ahead``)."""
        if not self.cfg.rollout.inflight_updates:
            self._finish_ahead()  # its time is the generate phase's, not the sync's
        with self.ctx.phase("sync"):
            synced = self.transport.sync(result, self.rollout, self.learners)
            verified = (
                self.rollout.verify_sync(self.probe_ids, synced["probe"], result["version"], self.tolerance)
                if self.probe_ids
                else {}
            )
        return {
            "sync/load_s": max(synced["load_s"]),
            **{k: v for k, v in synced.items() if k.startswith("sync/")},
            **verified,
        }

    def _pool_metrics(self, gen_stats: list[dict]) -> dict[str, Any]:
        """How the pool spread this step's work units over the generators, and the queue ahead."""
        return {
            "queue/depth": len(self.queue),
            "rollout/units_by_generator": [
                sum(1 for s in gen_stats if s.get("generator") == g) for g in range(len(self.rollout.generators))
            ],
            "reference/in_learner": self.rollout.reference is None and self.cfg.ppo.uses_reference,
        }


def _memory_peaks(gen_stats: list[dict], score_stats: list[dict], ref_stats: list[dict]) -> dict[str, float]:
    row = {
        "memory/generator_peak_gb": max(s["peak_rss_gb"] for s in gen_stats),
        # the judging generators' with llm_judge
        "memory/scorer_peak_gb": max(s["peak_rss_gb"] for s in score_stats),
    }
    if ref_stats:
        row["memory/reference_peak_gb"] = max(s["peak_rss_gb"] for s in ref_stats)
    return row


def export_step(ctx: RunContext, step: int, exp_refs: list) -> list:
    """Each generator's scored record as token transitions in ``<run>/data/transitions/`` (the
    data of offline Q-learning), written by Ray tasks while the learners train."""
    from cluster.roles.workers import export_transitions

    task = ray.remote(export_transitions).options(num_cpus=0)
    folder = ctx.dir / "data" / "transitions"
    return [task.remote(e, str(folder / f"step-{step:06d}-{i:02d}.parquet")) for i, e in enumerate(exp_refs)]


@dataclass
class Launched:
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
    # (records, generation stats, score stats) once finished before its step (a checkpoint kept it).
    done: tuple | None = None


class LaunchQueue:
    """Steps whose generation started ahead of the learners: with ``rollout.max_staleness = s``
    the next s steps' batches generate while the learners train (none with s = 0)."""

    def __init__(self, launch: Callable[[int], Launched], depth: int, last_step: int) -> None:
        self.launch, self.depth, self.last_step = launch, depth, last_step
        self.ahead: deque[Launched] = deque()

    def take(self, step: int) -> Launched:
        """The step's launched generation (launched now if it was not ahead)."""
        return self.ahead.popleft() if self.ahead else self.launch(step)

    def fill(self, step: int) -> None:
        while len(self.ahead) < self.depth and step + len(self.ahead) + 1 <= self.last_step:
            self.ahead.append(self.launch(step + len(self.ahead) + 1))

    def __len__(self) -> int:
        return len(self.ahead)


@dataclass
class SamplerPosition:
    """A checkpoint's prompt-sampler state: the position after the checkpointed step's prompts."""

    consumed: int

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}


def roles(cfg) -> RoleSet:
    """A teacher runs in an actor whatever the settings; a KL term's reference where they say."""
    reference = "rollout" if cfg.ppo.teacher else reference_where(cfg, cfg.ppo.uses_reference)
    return RoleSet(scorer=not self_judging(cfg), reference=reference)


def check(cfg) -> list[Check]:
    from learners.objectives.advantages import needs_group

    rollout, ppo = cfg.rollout, cfg.ppo
    return [
        (cfg.data.train_size >= rollout.prompts_per_step, "data.train_size must be >= rollout.prompts_per_step"),
        (
            not needs_group(ppo.advantage_estimator) or rollout.samples_per_prompt > 1,
            f"ppo.advantage_estimator={ppo.advantage_estimator} needs rollout.samples_per_prompt > 1 (a group)",
        ),
        (
            not cfg.model.dropout,
            "model.dropout is for sft, dpo, reward_model and qlearn: PPO's importance ratios compare the policy's "
            "forward passes, and dropout noise would bias them (every RL framework turns it off there)",
        ),
    ]


RECIPE = Recipe(
    name="ppo",
    learner="ppo",
    section="ppo",
    roles=roles,
    check=check,
    batch=lambda cfg: (cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt, "sequences"),
    features=frozenset({"colocated", "fsdp", "episodes", "streaming", "inflight_updates", "dynamic_sampling"}),
)
