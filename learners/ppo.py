"""Policy-gradient learner: PPO with a critic (Ouyang et al. 2022 recipe) or critic-free
group/batch baselines (GRPO, Dr. GRPO, RLOO, REINFORCE++), full fine-tuning or LoRA.

One ``train_step`` on the global batch of a step:

1. each data-parallel rank takes its rows (whole groups, ``Experience.shard_rows``);
2. old log-probs and values of the current weights for those rows (or, on-policy, the training
   pass itself), summed across ranks into global tensors;
3. rewards (KL to the reference folded in), advantages and every batch statistic (group
   baselines, whitening, the KL controller's measurement) computed on the global batch, exactly
   as one learner would;
4. clipped policy/value updates over minibatch epochs; each loss is normalised by the global
   token / sequence count of its minibatch and gradients are summed across ranks, so N learners
   take the same step as one learner on the same batch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol

import torch

from learners.objectives.advantages import AdvantageInputs, Estimate, get_estimator, teacher_advantages
from learners.base import CRITIC_DIR, LearnerContext, TrainParams
from learners.training.distributed import fill_missing_gradients
from learners.experience import Experience
from learners.objectives.kl_control import make_kl_controller
from learners.objectives.losses import kl_penalty, masked_mean, rollout_importance_weights, value_loss_clipped
from learners.training.modeling import autocast, micro_batch_order, shared_weight_casts
from learners.policy import PolicyLearner
from learners.objectives.policy_losses import policy_loss
from learners.objectives.reward_shaping import overlong_penalty
from learners.training.sharding import full_tensor, idle_inputs, load_full_weights, shard_group_rank, zero_loss


class PPOParams(Protocol):
    """The fields of ``cluster.config.PPOConfig`` the learner reads (documented there)."""

    critic_lr: float
    clip_eps: float
    value_clip_eps: float
    vf_coef: float
    entropy_coef: float
    kl_coef: float
    kl_estimator: str
    kl_loss_coef: float
    kl_loss_estimator: str  # "k3" (sampled) or "full" (exact, over the vocabulary)
    gamma: float
    lam: float
    whiten_advantages: bool
    advantage_estimator: str
    loss_agg: str
    loss_agg_constant: float
    kl_controller: str
    kl_target: float
    kl_horizon: int
    reward_clip: float
    truncation: str
    truncation_penalty: float
    rollout_correction: str
    rollout_is_cap: float
    rollout_is_low: float
    rollout_is_high: float
    skip_zero_advantage: bool
    policy_loss: str
    clip_eps_high: float
    overlong_buffer: int
    overlong_penalty: float
    distill_coef: float
    distill_discount: float
    distill_center: bool
    task_coef: float
    critic: str
    critic_init: str
    critic_weight_decay: float
    critic_lora_r: int
    critic_pooling: str

    @property
    def uses_reference(self) -> bool: ...


# Metrics accumulated over micro-batches; every rank reports all of them (zeros where it had no
# rows) so that one all-reduce turns them into global values.
_STATS = (
    "loss/policy",
    "loss/value",
    "loss/total",
    "policy/entropy",
    "policy/clip_frac",
    "policy/approx_kl",
    "value/clip_frac",
    "rollout_is/weight_mean",
    "rollout_is/corrected_frac",
    "kl/loss_term",
)


# Statistics of the policy on the rows that ran a pass (absent when none did).
_MEASURED_ON_RUN_ROWS = (
    "policy/entropy",
    "policy/clip_frac",
    "policy/approx_kl",
    "rollout_is/weight_mean",
    "rollout_is/corrected_frac",
    "logprob_gap/mean_abs",
    "logprob_gap/max_abs",
    "logprob_gap/kl_k3",
)


def router_step_metrics(before: dict[str, float], during: dict[str, float]) -> dict[str, float]:
    """A step's router health: the old-policy pass's (the engine's routes against the weights that
    sampled them), and the mismatch of the update's passes, whose weights move away from the
    ones that routed the rollout (``router/update_route_mismatch``). A fused old pass is the
    first update pass: then ``during`` holds it all."""
    if not before:
        return during
    out = dict(before)
    if "router/route_mismatch" in during:
        out["router/update_route_mismatch"] = during["router/route_mismatch"]
    return out


class _Shares(NamedTuple):
    """A micro-batch's weights in its global minibatch's aggregates: ``tok`` its share of the
    loss normaliser's tokens, ``agg`` of the policy loss's aggregate (tokens or sequences, by
    ``loss_agg``), ``stat`` of the tokens that ran (the statistics' means)."""

    tok: float
    agg: float
    stat: float


class _Fixed(NamedTuple):
    """What an update holds fixed for a micro-batch's rows: the old policy's log-probs and
    values (before this step's first update), the advantages and the returns."""

    old_logprobs: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


class _Step(NamedTuple):
    """One ``train_step``'s prepared batch (``_prepare``): the global batch (reference log-probs
    and reward shaping applied), every rank's rows (``shards``; ``rows`` and ``local`` this
    rank's), the step's KL coefficient, the rows left out of the passes (``inert``, with the
    advantages ``scored`` from the scores alone and the loss ``normalisers`` of the whole batch;
    all None when none are), and what the metrics report of the preparation."""

    batch: Experience
    shards: list[list[int]]
    rows: list[int]
    local: Experience
    kl_coef: float
    inert: torch.Tensor | None
    scored: Estimate | None
    normalisers: tuple[float, float] | None
    n_truncated: int
    t0: float
    t_ref: float
    lr: float

    @property
    def shape(self) -> tuple[int, ...]:
        """(B, L) of the global batch."""
        return tuple(self.batch.input_ids.shape)


class _OldPolicy(NamedTuple):
    """The old policy of a step (``_old_policy``): which pass gave it (``kind``: "fused",
    "streamed" or "separate"), whether the step is on-policy and its batch fresh, the frozen
    model's states of the full KL loss, the global (B, L) log-probs and values, and what a fused
    pass hands to the update (its outputs; a sharded rank without rows: its idle pass)."""

    kind: str
    on_policy: bool
    fresh: bool
    ref_states: torch.Tensor | None
    logprobs: torch.Tensor
    values: torch.Tensor
    fused_out: dict[str, torch.Tensor] | None = None
    idle_out: dict[str, torch.Tensor] | None = None

    @property
    def streamed(self) -> bool:
        """Whether the update's training passes fill in the log-probs (zeros until then)."""
        return self.kind == "streamed"


class PPOLearner(PolicyLearner):
    name = "ppo"
    config_section = "ppo"
    shardable = True
    required_fields = ("scores",)

    def __init__(self, ctx: LearnerContext, train: TrainParams, hp: PPOParams) -> None:
        super().__init__(ctx, train, with_value_head=True)
        self.hp = hp
        self.temperature = ctx.temperature or 1.0
        self.estimator = get_estimator(hp.advantage_estimator)  # ValueError naming the registered ones
        self.use_critic = self.estimator.needs_critic
        self.loss_agg_constant = hp.loss_agg_constant or float(ctx.max_new_tokens) or None
        self.kl_ctl = make_kl_controller(hp.kl_controller, hp.kl_coef, hp.kl_target, hp.kl_horizon)
        # "auto" is resolved by the run (truncate for asynchronous runs); on its own it means none.
        self.rollout_correction = "none" if hp.rollout_correction == "auto" else hp.rollout_correction
        self.separate_critic = self.use_critic and hp.critic == "separate"
        if not self.use_critic or self.separate_critic:
            # Critic-free estimators never touch the value head; a separate critic has its own.
            self.model.value_head.requires_grad_(False)
        head = [p for p in self.model.value_head.parameters() if p.requires_grad]
        group = {"params": head, "lr": hp.critic_lr}
        if self.separate_critic:
            from learners.training.critic import build_critic

            empty = self.from_rank0 and shard_group_rank() != 0
            self.model.critic = build_critic(
                ctx.model_path,
                hp.critic_init,
                lora=ctx.lora,
                lora_r=hp.critic_lora_r,
                seed=ctx.seed,
                gradient_checkpointing=train.gradient_checkpointing,
                pooling=hp.critic_pooling,
                empty=empty and not hp.critic_init,
            )
            if not empty or hp.critic_init:
                self.model.critic.to(self.device)
            group = {
                "params": [p for p in self.model.critic.parameters() if p.requires_grad],
                "lr": hp.critic_lr,
                "weight_decay": hp.critic_weight_decay,
            }
        self._init_optimizer([group], updates_per_step=train.epochs * train.num_minibatches)
        if self.separate_critic:
            # The critic's group as the optimiser holds it (sharding replaced the parameters).
            critic_params = list(self.optimizer.param_groups[1]["params"])
            critic = {id(p) for p in critic_params}
            self.clip_groups = [[p for p in self.trainable if id(p) not in critic], critic_params]

    # -- forward helpers -------------------------------------------------------------------------
    def _forward(
        self, exp: Experience, *, grad: bool, ref_states: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        return self._pass(
            exp.input_ids,
            exp.attention_mask,
            exp.response_mask,
            exp.group_ids if self.tr.shared_prefix else None,
            grad=grad,
            ref_states=ref_states,
            routes=exp.routes,
        )

    def _pass(
        self,
        ids: torch.Tensor,
        att: torch.Tensor,
        positions: torch.Tensor,
        group_ids: torch.Tensor | None,
        *,
        grad: bool,
        ref_states: torch.Tensor | None = None,
        routes: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The policy's pass; with ``ref_states`` (the frozen model's hidden states over the same
        rows) also the exact KL to it over the vocabulary (``kl_full``)."""
        ref = {"ref_states": ref_states, "ref_head": self.base_head_weight()} if ref_states is not None else {}
        with torch.set_grad_enabled(grad), autocast(self.tr.bf16, self.device):
            return self.model(
                ids,
                att,
                positions,
                temperature=self.temperature,
                chunk=self.tr.logprob_chunk,
                with_values=self.use_critic,
                with_entropy=True,
                group_ids=group_ids,
                fused=self.tr.fused_logprobs,
                routes=routes,
                **ref,
            )

    @property
    def full_kl_loss(self) -> bool:
        """Whether the KL loss term is the exact KL over the vocabulary (``ppo.kl_loss_estimator``)."""
        return bool(self.hp.kl_loss_coef) and getattr(self.hp, "kl_loss_estimator", "k3") == "full"

    def _local_ref_states(self, local: Experience) -> torch.Tensor | None:
        """This rank's rows' frozen-model hidden states when the KL loss is the full one (sharded
        ranks without rows still run the aligned passes); else None."""
        if not self.full_kl_loss:
            return None
        self.base_head_weight()  # gathered before any pass, at the same point on every rank
        return self.base_states(local.input_ids, local.attention_mask)

    def idle_outputs(self) -> dict[str, torch.Tensor]:
        with self.uncounted_routing():
            return self._pass(*idle_inputs(self.device), None, grad=torch.is_grad_enabled())

    def _pad_passes(self, extra: int, idle_out: dict[str, torch.Tensor] | None) -> None:
        """``extra`` idle training passes after this rank's own (sharded ranks with fewer rows);
        ``idle_out``: an idle forward already run, whose backward counts as one."""
        if idle_out is not None and extra:
            zero_loss(idle_out).backward()
            extra -= 1
        self.idle_passes(extra, grad=True)

    @torch.no_grad()
    def evaluate_old(self, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) log-probs and values of the current weights, before any update."""
        lps = torch.zeros(exp.batch_size, exp.seq_len, device=self.device)
        vals = torch.zeros_like(lps)
        # Length-sorted, trimmed micro-batches (see _update); results go back to their rows.
        order = micro_batch_order(exp.attention_mask.sum(1), exp.group_ids)
        for idx in self.rank_passes(torch.split(order, self.tr.micro_batch_size), grad=False):
            part = exp.select(idx).trimmed()
            out = self._forward(part, grad=False)
            lps[idx, : part.seq_len] = out["logprobs"]
            if self.use_critic:
                vals[idx, : part.seq_len] = out["values"]
        return lps, vals

    def reference_logprobs(self, exp: Experience) -> torch.Tensor:
        """(B, L) log-probs of the frozen initial model (LoRA: the adapter disabled; else the
        learner's own copy, ``train.reference=learners``)."""
        replay = self.model.routing == "rollout"
        return self.base_logprobs(
            exp.input_ids,
            exp.attention_mask,
            exp.response_mask,
            exp.group_ids,
            temperature=self.temperature,
            routes=exp.routes if replay else None,
        )

    def _gather(self, local: torch.Tensor, rows: list[int], shape: tuple[int, int]) -> torch.Tensor:
        """Global (B, L) tensor from each rank's (n_local, <=L) rows."""
        out = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if rows:
            out[rows, : local.shape[1]] = local.float()
        return self.comm.all_reduce_sum(out)

    def _apply_overlong(self, exp: Experience) -> Experience:
        """DAPO's soft overlong punishment added to the scores (``learners/objectives/reward_shaping.py``)."""
        if not self.hp.overlong_buffer:
            return exp
        lengths = exp.response_mask.sum(1)
        return exp.replace(
            scores=exp.scores
            + overlong_penalty(lengths, self.ctx.max_new_tokens, self.hp.overlong_buffer, self.hp.overlong_penalty).to(
                exp.scores.device
            )
        )

    def _apply_truncation(self, exp: Experience) -> Experience:
        """Responses cut at the length limit: kept, penalised, or left out of the loss."""
        if self.hp.truncation == "keep" or not bool(exp.truncated.any()):
            return exp
        if self.hp.truncation == "penalize":
            return exp.replace(scores=exp.scores + self.hp.truncation_penalty * exp.truncated.float())
        rm = exp.response_mask & ~exp.truncated[:, None]
        return exp.replace(response_mask=rm)

    def _advantages(
        self,
        exp: Experience,
        old_logprobs: torch.Tensor,
        old_values: torch.Tensor,
        ref_logprobs: torch.Tensor,
        kl_coef: float,
    ) -> Estimate:
        """(advantages, returns, per-token KL) over the global batch, all (B, L): the registered
        estimator ``ppo.advantage_estimator``, weighted by ``task_coef``, plus the teacher's term."""
        hp, mask = self.hp, exp.response_mask
        est = self.estimator.fn(
            AdvantageInputs(
                exp.scores,
                exp.group_ids,
                mask,
                old_logprobs,
                ref_logprobs,
                old_values,
                kl_coef,
                kl_estimator=hp.kl_estimator,
                reward_clip=hp.reward_clip,
                gamma=hp.gamma,
                lam=hp.lam,
                whiten=hp.whiten_advantages,
            )
        )
        advantages = est.advantages
        if hp.task_coef != 1.0:
            advantages = hp.task_coef * advantages
        if hp.distill_coef:  # on-policy distillation: the reference holds the teacher (ppo.teacher)
            advantages = advantages + hp.distill_coef * teacher_advantages(
                old_logprobs, ref_logprobs, mask, hp.distill_discount, hp.distill_center
            )
        return est._replace(advantages=advantages)

    def _inert_rows(self, exp: Experience) -> tuple[torch.Tensor | None, Estimate | None]:
        """((B,) rows whose advantage is 0 at every response token, the (advantages, returns, KL)
        of ``_advantages``, which then read the scores alone), or (None, None) where leaving rows
        out would change the step.

        Without a critic, a KL term (reward or loss) or an entropy bonus, a row's every loss term
        is its advantage times a function of the ratio, so a row whose advantage is 0 everywhere
        (a GRPO group whose samples all scored the same) adds an exact 0 to the loss and to every
        gradient, whatever the policy. Its passes can be skipped as long as its tokens stay in the
        normalisers; one minibatch keeps that exact (several would be drawn from the full rows)."""
        hp = self.hp
        # uses_reference covers every KL term (reward, loss, adaptive controller); reference
        # log-probs would feed KL statistics over every row.
        if (
            not hp.skip_zero_advantage
            or self.use_critic
            or hp.uses_reference
            or hp.entropy_coef
            or self.tr.num_minibatches != 1
            or exp.ref_logprobs is not None
        ):
            return None, None
        # No KL term: the advantages read the scores only (the log-probs enter multiplied by 0).
        zeros = torch.zeros(exp.input_ids.shape, device=self.device)
        scored = self._advantages(exp, zeros, zeros, zeros, 0.0)
        active = ((scored[0] != 0) & exp.response_mask).any(1).float()
        # Every rank must shard the same rows; a GPU's unordered sums could leave one rank a 1-ulp
        # advantage where another has 0, so a row any rank sees as active runs.
        return self.comm.all_reduce_max(active) == 0, scored

    # -- the update ------------------------------------------------------------------------------
    def train_step(self, batch: Experience) -> dict[str, float]:
        """One PPO iteration on the global batch (every rank passes the same batch): prepare it,
        the old policy's pass, the advantages, the minibatch updates, the metrics."""
        t0 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.check_batch(batch)
        batch = self.on_device(batch)
        if batch.batch_size == 0 or not bool(batch.response_mask.any()):
            # Every sample was dropped upstream (failed rewards, over-long prompts): nothing to learn.
            return {"learner/empty_batch": 1.0, "learner/sequences": float(batch.batch_size)}
        step = self._prepare(batch, t0, lr)
        old = self._old_policy(step)
        router_before = self.router_metrics()  # the weights that sampled the batch (empty: dense)
        # No KL term (beta = 0, no KL loss): no reference pass ran, and the penalty is an exact 0.
        ref_logprobs = step.batch.ref_logprobs if step.batch.ref_logprobs is not None else old.logprobs
        est = Estimate(
            *(step.scored or self._advantages(step.batch, old.logprobs, old.values, ref_logprobs, step.kl_coef))
        )
        t_prep = time.perf_counter() - t0
        stats, grad_norms, old_logprobs = self._run_update(step, old, est)
        self.version += 1
        metrics = self._step_metrics(step, old, old_logprobs, est, stats, grad_norms, t_prep)
        return {**metrics, **router_step_metrics(router_before, self.router_metrics())}

    def _prepare(self, batch: Experience, t0: float, lr: float) -> _Step:
        """The global batch of a step: each rank's rows (whole groups), the reference's log-probs
        where the batch lacks them and a KL term needs them, the truncation and overlong shaping,
        the step's KL coefficient, and the rows left out of every pass (``_inert_rows``)."""
        comm = self.comm
        shards = [batch.shard_rows(r, comm.world) for r in range(comm.world)]
        rows = shards[comm.rank]
        t_ref = 0.0
        self.model.rows_shared = self.model.rows_total = 0
        if batch.ref_logprobs is None and self.hp.uses_reference:
            local_ref = self.reference_logprobs(batch.select(rows))
            batch = batch.replace(ref_logprobs=self._gather(local_ref, rows, tuple(batch.input_ids.shape)))
            t_ref = time.perf_counter() - t0
        n_truncated = int(batch.truncated.sum())
        batch = self._apply_overlong(self._apply_truncation(batch))
        self.model.train()
        kl_coef = float(self.kl_ctl.value)
        inert, scored = self._inert_rows(batch)
        normalisers = None
        if inert is not None:
            # Rows that cannot move the weights run no pass at all; the ranks share the rest, and
            # every loss keeps the whole batch's normalisers, so the step is the one without skipping.
            mask_all = batch.response_mask
            normalisers = (max(float(mask_all.sum()), 1.0), max(float(mask_all.any(1).sum()), 1.0))
            active = (~inert).nonzero().flatten().tolist()
            trained = batch.select(active)
            shards = [[active[i] for i in trained.shard_rows(r, comm.world)] for r in range(comm.world)]
            rows = shards[comm.rank]
        return _Step(
            batch, shards, rows, batch.select(rows), kl_coef, inert, scored, normalisers, n_truncated, t0, t_ref, lr
        )

    def _old_pass_kind(self, step: _Step) -> tuple[str, bool, bool]:
        """``(kind, on_policy, fresh)``: how this step gets the old policy's log-probs and values,
        decided once per step.

        One update on the whole batch (one epoch, one minibatch) from the weights that sampled it
        is on-policy: the "old" policy is the current one, so its log-probs come from the
        training forward pass itself instead of a second pass over the batch. In one micro-batch
        ("fused") that pass also gives the values and KL the advantages need; over several
        ("streamed") it works when the advantages depend on the scores alone (no critic, no KL
        in the reward). A batch sampled by older weights (async pipelines) always takes the full
        old-policy pass ("separate"): its ratio is not 1."""
        tr = self.tr
        fresh = step.batch.policy_version == self.version
        on_policy = fresh and tr.epochs == 1 and tr.num_minibatches == 1
        if on_policy and tr.micro_batch_size >= max(len(s) for s in step.shards):
            return "fused", on_policy, fresh
        if on_policy and not self.use_critic and step.kl_coef == 0:
            return "streamed", on_policy, fresh
        return "separate", on_policy, fresh

    def _old_policy(self, step: _Step) -> _OldPolicy:
        """The old policy's global log-probs and values, by the pass ``_old_pass_kind`` chose."""
        kind, on_policy, fresh = self._old_pass_kind(step)
        ref_states = self._local_ref_states(step.local)
        run = {"fused": self._fused_old_pass, "streamed": self._streamed_old_pass, "separate": self._separate_old_pass}[
            kind
        ]
        return _OldPolicy(kind, on_policy, fresh, ref_states, *run(step, ref_states))

    def _fused_old_pass(
        self, step: _Step, ref_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        """The training forward pass over this rank's rows, run now (the update backpropagates
        it); its detached log-probs and values are the old ones. A sharded rank without rows runs
        an idle pass beside the others'."""
        rows, shape = step.rows, step.shape
        any_rows = self.aligned(int(bool(rows)))  # agreed before the pass: it is a collective
        fused_out = self._forward(step.local, grad=True, ref_states=ref_states) if rows else None
        idle_out = None
        if self.sharded and any_rows and not rows:
            idle_out = self._pass(*idle_inputs(self.device), None, grad=True)
        lp = fused_out["logprobs"].detach() if fused_out else self._no_rows(step)
        vals = fused_out["values"].detach() if fused_out and self.use_critic else torch.zeros_like(lp)
        return self._gather(lp, rows, shape), self._gather(vals, rows, shape), fused_out, idle_out

    def _streamed_old_pass(
        self, step: _Step, ref_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        """Zeros, filled micro-batch by micro-batch during the update (``_run_update``); until
        then the advantages read them only multiplied by kl_coef = 0."""
        return torch.zeros(step.shape, device=self.device), torch.zeros(step.shape, device=self.device), None, None

    def _separate_old_pass(
        self, step: _Step, ref_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        """A pass without gradient over this rank's rows (``evaluate_old``) before any update."""
        rows, shape = step.rows, step.shape
        empty = self._no_rows(step)
        lp, vals = self.evaluate_old(step.local) if rows else (empty, empty)
        if not rows:
            self.idle_passes(self.aligned(0), grad=False)
        return self._gather(lp, rows, shape), self._gather(vals, rows, shape), None, None

    def _no_rows(self, step: _Step) -> torch.Tensor:
        """A rank's (0, L) per-token tensor when it has no rows."""
        return torch.zeros(0, step.batch.seq_len, device=self.device)

    def _run_update(
        self, step: _Step, old: _OldPolicy, est: Estimate
    ) -> tuple[dict[str, float], list[float], torch.Tensor]:
        """The minibatch epochs over this rank's rows (``_update``); returns their statistics,
        grad norms and the old policy's global log-probs (a streamed pass's, from the update)."""
        rows = step.rows
        trained = sorted(i for shard in step.shards for i in shard)
        with shared_weight_casts(self.tr.bf16, self.device):
            stats, grad_norms, local_old = self._update(
                step.local,
                old.logprobs[rows],
                old.values[rows],
                est.advantages[rows],
                est.returns[rows],
                fused_out=old.fused_out,
                streamed=old.streamed,
                normalisers=step.normalisers,
                idle_out=old.idle_out,
                ref_states=old.ref_states,
                minibatches=self._minibatches(rows, trained, old.on_policy),
            )
        old_logprobs = self._gather(local_old, rows, step.shape) if old.streamed else old.logprobs
        return stats, grad_norms, old_logprobs

    def _step_metrics(
        self,
        step: _Step,
        old: _OldPolicy,
        old_logprobs: torch.Tensor,
        est: Estimate,
        stats: dict[str, float],
        grad_norms: list[float],
        t_prep: float,
    ) -> dict[str, float]:
        """The step's metrics: the update's statistics, the KL to the reference (which moves the
        KL controller), the log-prob gap to the rollout policy, advantages, values and timings."""
        batch, inert, kl_coef = step.batch, step.inert, step.kl_coef
        mask = batch.response_mask
        metrics = dict(stats)
        if batch.ref_logprobs is not None:
            metrics.update(self._reference_kl(old_logprobs, batch.ref_logprobs, mask))
        # The old policy's log-probs exist for the rows that ran a pass.
        ran = mask if inert is None else mask & ~inert[:, None]
        gap = (old_logprobs - batch.rollout_logprobs).abs()
        _, gap_stats = rollout_importance_weights(old_logprobs, batch.rollout_logprobs, ran, "none")
        resp = mask.sum(1).float()
        metrics.update(
            {
                "kl/coef": kl_coef,
                "kl/coef_next": float(self.kl_ctl.value),
                "response/truncated": float(step.n_truncated),
                "learner/ref_s": step.t_ref,
                "learner/trainable_fraction": self.trainable_fraction,
                "learner/lr": step.lr,
                "policy/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                "kl/penalty_per_seq": float((est.kl * mask).sum(1).mean()) * kl_coef,
                "logprob_gap/mean_abs": float(masked_mean(gap, ran)),
                "logprob_gap/max_abs": float(gap[ran].max()) if bool(ran.any()) else 0.0,
                # KL(rollout policy || old policy), k3 from the rollout's tokens: the off-policy gap.
                "logprob_gap/kl_k3": float(gap_stats["kl_k3"]),
                "advantage/mean": float(masked_mean(est.advantages, mask)),
                "response/length_mean": float(resp.mean()),
                "learner/prep_s": t_prep,
                "learner/update_s": time.perf_counter() - step.t0 - t_prep,
                "learner/tokens": float(mask.sum()),
                "learner/trained_tokens": float(ran.sum()),
                "learner/fused_old_pass": float(old.kind == "fused"),
                "learner/streamed_old_pass": float(old.streamed),
                "learner/stale_batch": float(not old.fresh),
                "learner/prefix_shared_frac": self.model.rows_shared / max(self.model.rows_total, 1),
                "learner/sequences": float(batch.batch_size),
                "learner/local_sequences": float(len(step.rows)),
            }
        )
        self._skip_and_value_metrics(metrics, step, old, est, ran)
        return metrics

    def _skip_and_value_metrics(
        self, metrics: dict[str, float], step: _Step, old: _OldPolicy, est: Estimate, ran: torch.Tensor
    ) -> None:
        """Into ``metrics``: the rows the zero-advantage skip left out (and, when none ran, no
        measurements that read as zeros), and the critic's values and their fit."""
        mask, inert = step.batch.response_mask, step.inert
        if inert is not None:
            # Rows left out because their advantage is 0 (rows with no response token, e.g. masked
            # truncations, run no pass either way and are not counted).
            metrics["learner/zero_advantage_rows"] = float((inert & mask.any(1)).sum())
            if not bool(ran.any()):
                # Nothing ran: no policy was measured, so no zeros that read as measurements.
                for key in _MEASURED_ON_RUN_ROWS:
                    metrics.pop(key, None)
        if self.use_critic:
            metrics.update(
                {
                    "value/mean": float(masked_mean(old.values, mask)),
                    "value/returns_mean": float(masked_mean(est.returns, mask)),
                    "value/explained_var": _explained_variance(old.values, est.returns, mask),
                }
            )

    def _reference_kl(
        self, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """The old policy's KL to the reference over the global batch; the KL controller's
        measurement (one of the global batch: every rank's controller moves the same way)."""
        seq_kl = float((kl_penalty(old_logprobs, ref_logprobs, "k1") * mask).sum(1).mean())
        self.kl_ctl.update(seq_kl, n_steps=mask.shape[0])
        return {
            "kl/ref_seq_k1": seq_kl,
            "kl/ref_k1": float(masked_mean(kl_penalty(old_logprobs, ref_logprobs, "k1"), mask)),
            "kl/ref_k3": float(masked_mean(kl_penalty(old_logprobs, ref_logprobs, "k3"), mask)),
        }

    def _minibatches(self, rows: list[int], trained: list[int], on_policy: bool) -> Iterator[torch.Tensor]:
        """This rank's share of every global minibatch of the step, as indices into its own
        ``rows``: each epoch orders the batch's ``trained`` rows (every rank's) by a shuffle seeded
        by (seed, version, epoch) only and cuts ``train.num_minibatches`` minibatches, so N ranks
        train on the minibatches one rank would. On-policy (one epoch, one minibatch): this
        rank's rows in their own order, the order of a fused pass's outputs."""
        if on_policy:
            yield torch.arange(len(rows), device=self.device)
            return
        position = {row: i for i, row in enumerate(rows)}
        trained_rows = torch.tensor(trained, dtype=torch.long, device="cpu")
        for epoch in range(self.tr.epochs):
            gen = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + self.version * 1009 + epoch)
            order = trained_rows[torch.randperm(len(trained), generator=gen, device="cpu")]
            for mini in torch.tensor_split(order, self.tr.num_minibatches):
                mine = [position[row] for row in mini.tolist() if row in position]
                yield torch.tensor(mine, dtype=torch.long, device=self.device)

    def _update(
        self,
        local: Experience,
        old_logprobs: torch.Tensor,
        old_values: torch.Tensor,
        advantages: torch.Tensor,
        returns: torch.Tensor,
        *,
        fused_out: dict[str, torch.Tensor] | None,
        streamed: bool,
        minibatches: Iterator[torch.Tensor],
        normalisers: tuple[float, float] | None = None,
        idle_out: dict[str, torch.Tensor] | None = None,
        ref_states: torch.Tensor | None = None,
    ) -> tuple[dict[str, float], list[float], torch.Tensor]:
        """Minibatch epochs over this rank's rows (``minibatches``: its share of each global
        minibatch); returns global stats, grad norms and (streamed) the old log-probs the training
        passes produced. ``normalisers`` (global tokens, sequences) replace the rows' own counts
        in the losses when rows with no gradient were left out (one minibatch); the statistics
        stay means over the rows that ran."""
        tr = self.tr
        mask = local.response_mask
        totals = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in _STATS}
        grad_norms: list[float] = []
        for mini in minibatches:
            g_tokens, g_seqs, s_tokens = self._minibatch_normalisers(mask[mini], normalisers)
            self.optimizer.zero_grad(set_to_none=True)
            if fused_out is None and len(mini):
                # Micro-batches of similar length, each trimmed to its longest row, with a
                # prompt's samples kept together so that they can share its forward pass.
                mini = micro_batch_order(local.attention_mask.sum(1), local.group_ids, mini)
            micros = [mini] if fused_out is not None else [m for m in torch.split(mini, tr.micro_batch_size) if len(m)]
            idle = self.aligned(len(micros)) - len(micros)  # agreed before any pass: each is a collective
            for micro in micros:
                part = local if fused_out is not None else local.select(micro).trimmed()
                width, mmask = part.seq_len, part.response_mask
                refs = None if ref_states is None else ref_states[micro, :width]
                out = fused_out if fused_out is not None else self._forward(part, grad=True, ref_states=refs)
                if streamed:
                    old_logprobs[micro, :width] = out["logprobs"].detach()
                shares = self._shares(mmask, g_tokens, g_seqs, s_tokens)
                fixed = _Fixed(
                    old_logprobs[micro, :width],
                    old_values[micro, :width],
                    advantages[micro, :width],
                    returns[micro, :width],
                )
                loss = self._micro_loss(out, part, fixed, shares, totals, full_kl=ref_states is not None)
                (loss + self.router_aux_term(shares.tok)).backward()
            self._pad_passes(idle, idle_out)
            if normalisers is not None or not micros:  # a rank may have run nothing: its gradients are 0
                fill_missing_gradients(self.trainable)
            grad_norms.append(self._optimizer_step())
        return self._global_stats(totals), grad_norms, old_logprobs

    def _minibatch_normalisers(
        self, mask: torch.Tensor, normalisers: tuple[float, float] | None
    ) -> tuple[float, float, float]:
        """Normalisers of the *global* minibatch (every rank's share of it, summed; one collective):
        its tokens and sequences in the losses (``normalisers`` when given) and its tokens that ran,
        for the statistics."""
        counts = torch.tensor([float(mask.sum()), float(mask.any(1).sum())], dtype=torch.float64, device=self.device)
        g_tokens, g_seqs = (max(float(c), 1.0) for c in self.comm.all_reduce_sum(counts))
        s_tokens = g_tokens  # statistics: means over the tokens that ran
        if normalisers is not None:
            g_tokens, g_seqs = normalisers
        return g_tokens, g_seqs, s_tokens

    def _shares(self, mmask: torch.Tensor, g_tokens: float, g_seqs: float, s_tokens: float) -> "_Shares":
        """A micro-batch's shares of its minibatch. The policy loss's is by tokens or by sequences
        (loss_agg), so the sum over micro-batches and ranks is the global minibatch aggregate."""
        return _Shares(
            tok=float(mmask.sum()) / g_tokens,
            stat=float(mmask.sum()) / s_tokens,
            agg=float(mmask.sum()) / g_tokens
            if self.hp.loss_agg == "token_mean"
            else float(mmask.any(1).sum()) / g_seqs,
        )

    def _micro_loss(
        self,
        out: dict[str, torch.Tensor],
        part: Experience,
        fixed: "_Fixed",
        shares: "_Shares",
        totals: dict[str, torch.Tensor],
        full_kl: bool,
    ) -> torch.Tensor:
        """One micro-batch's weighted loss (policy, value, entropy bonus and KL terms), its
        statistics added to ``totals``. ``full_kl``: the KL term is the full-vocabulary one the
        forward pass computed against the reference's states."""
        hp, mmask = self.hp, part.response_mask
        is_weights = None
        if self.rollout_correction != "none":
            is_weights, is_stats = rollout_importance_weights(
                fixed.old_logprobs,
                part.rollout_logprobs,
                mmask,
                self.rollout_correction,
                cap=hp.rollout_is_cap,
                low=hp.rollout_is_low,
                high=hp.rollout_is_high,
            )
            totals["rollout_is/weight_mean"] += float(is_stats["weight_mean"]) * shares.stat
            totals["rollout_is/corrected_frac"] += float(is_stats["corrected_frac"]) * shares.stat
        pg_loss, pg_stats = policy_loss(
            hp.policy_loss,
            out["logprobs"],
            fixed.old_logprobs,
            fixed.advantages,
            mmask,
            clip_eps=hp.clip_eps,
            clip_eps_high=hp.clip_eps_high or None,
            loss_agg=hp.loss_agg,
            loss_agg_constant=self.loss_agg_constant,
            weights=is_weights,
        )
        loss = pg_loss * shares.agg
        if self.use_critic:
            vf_loss, vf_stats = value_loss_clipped(
                out["values"], fixed.old_values, fixed.returns, mmask, clip_eps=hp.value_clip_eps
            )
            loss = loss + hp.vf_coef * vf_loss * shares.tok
            totals["loss/value"] += float(vf_loss.detach()) * shares.tok
            totals["value/clip_frac"] += float(vf_stats["vf_clip_frac"]) * shares.tok
        if hp.entropy_coef:
            # Entropy is measured detached; the bonus uses -logprob as its estimator.
            loss = loss + hp.entropy_coef * masked_mean(out["logprobs"], mmask) * shares.tok
        if hp.kl_loss_coef:
            per_token = out["kl_full"] if full_kl else kl_penalty(out["logprobs"], part.ref_logprobs, "k3")
            kl_term = masked_mean(per_token, mmask)
            totals["kl/loss_term"] += float(kl_term.detach()) * shares.stat
            loss = loss + hp.kl_loss_coef * kl_term * shares.tok
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite PPO loss: {float(loss)}")
        totals["loss/policy"] += float(pg_loss.detach()) * shares.agg
        totals["loss/total"] += float(loss.detach())
        totals["policy/entropy"] += float(masked_mean(out["entropy"], mmask)) * shares.stat
        totals["policy/clip_frac"] += float(pg_stats["clip_frac"]) * shares.stat
        totals["policy/approx_kl"] += float(pg_stats["approx_kl"]) * shares.stat
        return loss

    def _global_stats(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        """Every rank's statistics summed, as means per update; the keys of terms this run has
        not (value, KL loss, rollout correction) left out."""
        n_updates = self.tr.epochs * self.tr.num_minibatches
        keys = list(_STATS)
        summed = self.comm.all_reduce_sum(torch.stack([totals[k] for k in keys]))
        stats = {k: float(v) / n_updates for k, v in zip(keys, summed)}
        unused = (
            (["loss/value", "value/clip_frac"] if not self.use_critic else [])
            + (["kl/loss_term"] if not self.hp.kl_loss_coef else [])
            + (["rollout_is/weight_mean", "rollout_is/corrected_frac"] if self.rollout_correction == "none" else [])
        )
        for k in unused:
            stats.pop(k)
        return stats

    # -- checkpoints -----------------------------------------------------------------------------
    def algorithm_state(self) -> dict[str, Any]:
        return {"kl_controller": self.kl_ctl.state_dict()}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_controller"])

    def save_extra(self, folder: Path) -> None:
        """The value head in ``critic/`` (vLLM would trip over it at the top level); a separate
        critic's trained tensors (with LoRA its adapter and head) in ``critic/critic.safetensors``."""
        if not self.use_critic:
            return
        from safetensors.torch import save_file

        state = self.model.critic.trainable_state() if self.separate_critic else self.model.value_head.state_dict()
        state = {k: full_tensor(v).detach().contiguous().cpu() for k, v in state.items()}
        if not self.writes_files:
            return
        (folder / CRITIC_DIR).mkdir(exist_ok=True)
        name = "critic.safetensors" if self.separate_critic else "value_head.safetensors"
        save_file(state, str(folder / CRITIC_DIR / name))

    def restore_extra(self, folder: Path) -> None:
        from safetensors.torch import load_file

        if self.separate_critic:
            path = folder / CRITIC_DIR / "critic.safetensors"
            if not path.is_file():
                raise ValueError(
                    f"{folder} holds no separate critic ({CRITIC_DIR}/critic.safetensors): it was saved "
                    "with ppo.critic=shared"
                )
            saved = load_file(str(path))
            missing = set(self.model.critic.trainable_state()) - set(saved)
            if missing:
                raise ValueError(f"{path} lacks the critic's {sorted(missing)[:3]}")
            if self.sharded:
                load_full_weights(self.model, {f"critic.{k}": v for k, v in saved.items()}, strict=False)
            else:
                self.model.critic.load_state_dict(saved, strict=False)
            return
        critic = folder / CRITIC_DIR / "value_head.safetensors"
        if self.use_critic and critic.is_file():
            if self.sharded:
                load_full_weights(
                    self.model, {f"value_head.{k}": v for k, v in load_file(str(critic)).items()}, strict=False
                )
            else:
                self.model.value_head.load_state_dict(load_file(str(critic)))


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    if int(mask.sum()) < 2:
        return 0.0
    var_r = float(returns[mask].var())
    if var_r == 0:
        return 0.0
    return 1.0 - float((returns - values)[mask].var()) / var_r
