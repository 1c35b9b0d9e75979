"""Token-level Q-learning: the language model's logits are Q(s, .) over the vocabulary.

Each response token is an action ``a_t`` taken in state ``s_t`` (the prompt and the tokens before
it); the logit the model gives that token is ``Q(s_t, a_t)``, so acting greedily or by a
Boltzmann distribution over Q is exactly greedy or temperature sampling from the model in vLLM.
The model learns by Bellman backups, Q-Transformer (Chebotar et al. 2023) carried from robot
action dimensions to tokens:

* targets from a target network that is an exponential moving average of the online one
  (``learners.training.optim.ema_update_``), one-step or n-step, optionally bounded below by the
  Monte-Carlo return (``learners.objectives.advantages.q_learning_targets``);
* a squared TD error on the taken tokens plus the conservative regulariser that pushes the Q of
  every token not taken toward a floor (``learners.objectives.td_losses.td_loss`` / ``conservative_penalty``),
  or, as an option, CQL's logsumexp term (``cql_penalty``), all reduced chunk by chunk over the
  vocabulary (``learners.training.modeling.q_heads_at_positions``);
* optionally a k3 KL anchor of the Boltzmann policy to the reference model, as in PPO;
* optionally Q measured against the reference model (``calibration=reference``): soft
  Q-learning with the initial model as prior. A language model's logits are a Q function only up
  to a per-state shift the softmax ignores (Rafailov et al. 2024, "From r to Q*", sec. 4), and a
  pretrained model's level is whatever pretraining left (chosen tokens at logits of 20-40); read
  as value, it makes "go on" worth tens of reward units and "stop" worth the reward, and the
  logits' prior is lost once every sampled token is pulled to one target. Calibrated,
  ``Q(s, a) = logits(s, a) - logits_ref(s, a)`` and the policy is ``pi_ref exp(Q) / Z``, the
  optimum of KL-regularised rewards (Haarnoja et al. 2017; Fox et al. 2016), which is exactly
  ``softmax(logits)``: vLLM samples it unchanged. The backup reads the soft value
  ``V(s) = log sum_a pi_ref(a|s) exp Q(s, a) = logsumexp logits(s) - logsumexp logits_ref(s)``.
  At the start Q = V = 0 everywhere: only rewards move it, and ``reward_scale`` is the inverse of
  the KL coefficient.

One ``train_step`` is ``train.epochs`` x ``train.num_minibatches`` updates on the global batch
(sequences sampled from the replay buffer); each loss is normalised by the global action count of
its minibatch and gradients are summed across ranks, so N learners take one learner's step. The
target network follows after every update. With LoRA the target is an EMA of the adapter only
(of its A and B factors, each averaged on its own: the target's update B'A' is then close to, not
exactly, the average of the online updates BA).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from learners.objectives.advantages import (
    bootstrap_positions,
    episode_mask,
    q_learning_targets,
    reads_bootstrap,
    token_rewards_from_scores,
)
from learners.base import LearnerContext, TrainParams
from learners.experience import Experience, ExperienceError
from learners.objectives.losses import kl_penalty
from learners.objectives.td_losses import conservative_penalty, cql_penalty, reference_valued, td_loss, value_graded
from learners.training.modeling import autocast, max_q_after_positions, q_heads_at_positions
from learners.training.optim import ema_update_
from learners.policy import PolicyLearner
from learners.objectives.reward_shaping import centered_returns, groups_with_signal
from learners.training.sharding import full_tensor, load_shard_, local

TARGET_DIR = "target"
TARGET_FILE = "target.safetensors"


class QLearnParams(Protocol):
    """The fields of ``cluster.config.QLearnConfig`` the learner reads (documented there)."""

    gamma: float
    n_step: int
    mc_lower_bound: bool
    conservative_weight: float
    conservative: str
    q_floor: float
    calibration: str
    reward_scale: float
    reward_baseline: str
    value_grad: float
    state_value: str
    skip_uniform_groups: bool
    target_decay: float
    target_start_step: int
    target_update_every: int
    kl_coef: float
    bootstrap_truncated: bool

    @property
    def uses_reference(self) -> bool: ...


# Sums over micro-batches (all-reduced, then divided by the action count): losses, Q statistics.
_SUMS = (
    "loss/td",
    "loss/conservative",
    "loss/kl",
    "q/taken",
    "q/target",
    "q/unseen_mean",
    "q/max",
    "q/abs_td_error",
    "q/mc_bound_active",
    "kl/ref_k3",
)


class QLearner(PolicyLearner):
    name = "qlearn"
    config_section = "qlearn"
    shardable = True

    def __init__(self, ctx: LearnerContext, train: TrainParams, hp: QLearnParams) -> None:
        super().__init__(ctx, train, with_value_head=False)
        self.hp = hp
        self.temperature = ctx.temperature or 1.0
        self._init_optimizer(updates_per_step=train.epochs * train.num_minibatches)
        cfg = self.model.lm.config
        eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
        self.vocab_size = int(self.model.lm.get_output_embeddings().weight.shape[0])
        # The target network: a copy of every trainable tensor (LoRA: the adapters), swapped in
        # for the target's forward pass; frozen weights are shared with the online network. None
        # with state_value=reference, whose bootstraps read the reference's value (0).
        keeps_target = hp.state_value == "model"
        self.target_names = [n for n, p in self.model.named_parameters() if p.requires_grad] if keeps_target else []
        self.target_params = [p.detach().clone() for p in self.trainable] if keeps_target else []
        self.updates = 0
        self.target_updates = 0
        # Whether this step's targets read the target network (``reads_bootstrap``): decided on the
        # global batch, so every rank runs the same passes (sharded ranks must).
        self.reads_target = True
        if hp.calibration != "none" and hp.conservative == "floor" and hp.conservative_weight:
            raise ValueError(
                "qlearn.calibration=reference needs conservative=logsumexp or conservative_weight=0 "
                "(the floor term would need the reference's logit of every token)"
            )
        if hp.state_value == "reference" and (hp.calibration == "none" or hp.value_grad != 0):
            raise ValueError("qlearn.state_value=reference needs calibration=reference and value_grad=0")

    # -- batch preparation -----------------------------------------------------------------------
    def check_batch(self, batch: Experience) -> None:
        if batch.scores is None and batch.token_rewards is None:
            raise ExperienceError("the qlearn learner needs scores or token_rewards in every batch")
        if self.hp.uses_reference and batch.ref_logprobs is None and not self.reference_in_learner:
            raise ExperienceError(
                "qlearn.kl_coef > 0 needs ref_logprobs in every batch "
                "(computed by the Reference actor, or in the learner with LoRA or train.reference=learners)"
            )

    def episodes(self, batch: Experience) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(actions mask, rewards, done) of the global batch: actions stop at the first EOS; a
        sequence's last action ends its episode (its reward was given for what was generated),
        unless ``bootstrap_truncated`` and it was cut at a length limit without EOS; rewards are
        the per-token ones (offline data) or the score at the last action, times reward_scale."""
        mask, ended = episode_mask(batch.input_ids, batch.response_mask, self.eos_token_ids)
        done = ended | ~batch.truncated.bool() if self.hp.bootstrap_truncated else torch.ones_like(ended)
        if batch.token_rewards is not None:
            zero = batch.token_rewards.new_zeros(())
            rewards = torch.where(mask, batch.token_rewards, zero)
            # A logged sequence that went on past its first EOS: what it earned after the cut is
            # credited to the episode's last action instead of being lost.
            beyond = torch.where(batch.response_mask & ~mask, batch.token_rewards, zero).sum(1)
            rewards = rewards + token_rewards_from_scores(beyond, mask)
        else:
            rewards = token_rewards_from_scores(batch.scores, mask)
        return mask, rewards * self.hp.reward_scale, done

    def backup_rewards(self, rewards: torch.Tensor, mask: torch.Tensor, batch_groups: torch.Tensor) -> torch.Tensor:
        """The rewards the backups read: ``episodes``' rewards, centered over the batch
        (``reward_baseline=batch_mean``) or over the rows of each group id (``group_mean``)."""
        if self.hp.reward_baseline == "none":
            return rewards
        groups = batch_groups if self.hp.reward_baseline == "group_mean" else None
        return centered_returns(rewards, mask, groups)

    # -- networks --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def target_network(self) -> Iterator[None]:
        """The target weights in place of the online ones for the duration of the context.

        Replicated: the parameters' data swapped (no copy). Sharded: each rank's shards copied in
        and back (FSDP gathers from the shards' own storage), the root unit's gathered weights
        dropped on the way in and out (after a pass without gradients it keeps them)."""
        if not self.sharded:
            online = [p.data for p in self.trainable]
            try:
                for p, t in zip(self.trainable, self.target_params):
                    p.data = t
                yield
            finally:
                for p, o in zip(self.trainable, online):
                    p.data = o
            return
        with torch.no_grad():
            shards = [local(p) for p in self.trainable]
            online = [s.clone() for s in shards]
            self.model.reshard()
            for s, t in zip(shards, self.target_params):
                s.copy_(local(t))
        try:
            yield
        finally:
            with torch.no_grad():
                self.model.reshard()
                for s, o in zip(shards, online):
                    s.copy_(o)

    def idle_passes(self, n: int, *, grad: bool) -> None:
        """A Q update's passes are two (the target network's, then the online one): an idle rank
        runs both. (The build's first pass comes before the target network exists.)"""
        for _ in range(n):
            if getattr(self, "target_params", None) is not None and self.reads_target:
                with torch.no_grad(), self.target_network():
                    self.idle_outputs()
            super().idle_passes(1, grad=grad)

    def _hidden(self, part: Experience) -> torch.Tensor:
        """The last hidden states of the online or the target network (the one in place); a
        mixture of experts routes by the record's routes (``train.routing_replay``)."""
        if self.model.routing != "none":
            return self.model.routed_hidden(part.input_ids, part.attention_mask, part.routes)
        return self.model.hidden(
            part.input_ids, part.attention_mask, part.response_mask, part.group_ids if self.tr.shared_prefix else None
        )

    def _update_target(self) -> None:
        """After optimiser update ``self.updates``: a copy until ``target_start_step``, then an EMA
        step every ``target_update_every`` updates."""
        hp = self.hp
        if not self.target_params:
            return
        if self.updates <= hp.target_start_step:
            decay = 0.0
        elif (self.updates - hp.target_start_step) % hp.target_update_every == 0:
            decay = hp.target_decay
        else:
            return
        ema_update_([local(t) for t in self.target_params], [local(p.detach()) for p in self.trainable], decay)
        self.target_updates += 1

    def _with_reference(self, batch: Experience) -> Experience:
        """``batch`` with the reference's log-probs where the KL anchor needs them and the batch
        brought none (LoRA: the base model with the adapter disabled, every row at once)."""
        if not self.hp.uses_reference or batch.ref_logprobs is not None:
            return batch
        ref = self.base_logprobs(
            batch.input_ids,
            batch.attention_mask,
            batch.response_mask,
            batch.group_ids,
            temperature=self.temperature,
            routes=batch.routes if self.model.routing == "rollout" else None,
        )
        return batch.replace(ref_logprobs=ref)

    def _calibration(self, batch: Experience, mask: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """``calibration=reference``: the frozen initial model's logit of each action
        (``taken``) and log-normaliser of every state the backups and statistics read
        (``logsumexp``: the state of each action, p = t - 1, and each bootstrap state, p = t);
        None uncalibrated. Computed for ``rows`` only (the rows this rank trains on; 0 elsewhere),
        so N ranks share the reference passes instead of each running them all."""
        if self.hp.calibration == "none":
            return None
        before = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
        states = before | bootstrap_positions(mask)
        terms = self.base_logit_terms(batch.input_ids[rows], batch.attention_mask[rows], states[rows], mask[rows])
        return {
            k: torch.zeros((batch.batch_size, *v.shape[1:]), dtype=v.dtype, device=v.device).index_copy_(0, rows, v)
            for k, v in terms.items()
        }

    # -- the update ------------------------------------------------------------------------------
    def _prepare(self, batch: Experience) -> tuple[Experience, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the batch on this device, its actions mask, rewards, done), checked; decides for this
        batch's passes whether the targets read the target network (``reads_target``)."""
        self.check_batch(batch)
        batch = self.on_device(batch)
        mask, rewards, done = self.episodes(batch)
        self.reads_target = self.hp.state_value == "model" and reads_bootstrap(mask, done, self.hp.n_step)
        return batch, mask, rewards, done

    def _targets(
        self, part: Experience, r: torch.Tensor, done: torch.Tensor, after: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """(targets of ``part``'s actions, how many of them the Monte-Carlo bound lifted); ``after``:
        the reference's log-normaliser at each bootstrap state (0 uncalibrated)."""
        hp, m = self.hp, part.response_mask
        if self.reads_target:
            next_max = self._bootstrap_values(part, after)
        else:  # every window ends its episode (Monte-Carlo targets), or V is the reference's 0: no pass
            next_max = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
        targets = q_learning_targets(
            r, next_max, m, done, gamma=hp.gamma, n_step=hp.n_step, mc_lower_bound=hp.mc_lower_bound
        )
        raised = 0.0
        if hp.mc_lower_bound:
            plain = q_learning_targets(r, next_max, m, done, gamma=hp.gamma, n_step=hp.n_step)
            raised = float(((targets > plain) & m).sum())
        return targets, raised

    def _bootstrap_values(self, part: Experience, after: torch.Tensor) -> torch.Tensor:
        """The target network's (soft) max Q after each of ``part``'s actions, without dropout."""
        head = self.model.lm.get_output_embeddings()
        was_training = self.model.training
        self.model.eval()  # targets without dropout noise
        try:
            with torch.no_grad(), self.target_network(), autocast(self.tr.bf16, self.device):
                boot = bootstrap_positions(part.response_mask)
                return (
                    self.model(
                        run=lambda: max_q_after_positions(
                            self._hidden(part),
                            boot,
                            head,
                            chunk=self.tr.logprob_chunk,
                            soft=self.hp.calibration != "none",
                        )
                    )
                    - after * boot
                )
        finally:
            self.model.train(was_training)

    def _micro(
        self,
        batch: Experience,
        idx: torch.Tensor,
        mask: torch.Tensor,
        rewards: torch.Tensor,
        done: torch.Tensor,
        n_actions: int,
        grad: bool,
        ref: dict | None = None,
    ) -> torch.Tensor:
        """Forward (online and target) and backward of rows ``idx``; returns their ``_SUMS``.
        ``ref``: the calibration's reference terms (``_calibration``), or None."""
        hp = self.hp
        part = batch.select(idx).replace(response_mask=mask[idx]).trimmed()
        m, r = part.response_mask, rewards[idx, : part.seq_len]
        zero = torch.zeros_like(r)
        ref = (
            {k: v[idx, : part.seq_len] for k, v in ref.items()}
            if ref is not None
            else {"logsumexp": zero, "taken": zero}
        )
        targets, raised = self._targets(part, r, done[idx], ref["logsumexp"])
        floor = hp.q_floor * hp.reward_scale
        out = self._q_heads(part, m, floor, grad)
        mf = m.float()
        q = out["q"] - ref["taken"]  # calibrated: minus the reference's logit (0 without calibration)
        if hp.state_value == "reference":  # V(s) the reference's: the log-ratio, its gradient the log-prob's
            q = reference_valued(q, out["logsumexp"], _action_states(ref["logsumexp"]))
        else:
            q = value_graded(q, out.get("logsumexp"), hp.value_grad)
        td = (td_loss(q, targets) * mf).sum() / n_actions
        if hp.conservative == "logsumexp":
            penalty = cql_penalty(out["logsumexp"], out["q"])
        else:
            penalty = conservative_penalty(out["sq_dev_sum"], out["q"], floor, self.vocab_size)
        cons = (penalty * mf).sum() / n_actions
        kl = torch.zeros((), device=self.device)
        if hp.uses_reference:
            kl = (kl_penalty(out["logprobs"], part.ref_logprobs, "k3") * mf).sum() / n_actions
        loss = td + hp.conservative_weight * cons + hp.kl_coef * kl
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite Q-learning loss: td {float(td)}, conservative {float(cons)}, kl {float(kl)}"
            )
        if grad:
            loss.backward()
        return self._sums(out, q, targets, ref["logsumexp"], m, (td, cons, kl, raised), n_actions)

    def _q_heads(self, part: Experience, m: torch.Tensor, floor: float, grad: bool) -> dict[str, torch.Tensor]:
        """The online model's Q of each taken action and the terms the losses need of the vocabulary."""
        terms = (
            *(("logsumexp",) if self.hp.conservative == "logsumexp" or self.hp.value_grad < 1 else ()),
            *(("sq_dev_sum",) if self.hp.conservative == "floor" else ()),
            *(("logprobs",) if self.hp.uses_reference else ()),
        )
        head = self.model.lm.get_output_embeddings()
        with torch.set_grad_enabled(grad), autocast(self.tr.bf16, self.device):
            out = self.model(
                run=lambda: q_heads_at_positions(
                    self._hidden(part),
                    part.input_ids,
                    m,
                    head,
                    floor=floor,
                    temperature=self.temperature,
                    chunk=self.tr.logprob_chunk,
                    terms=terms,
                )
            )
        return out

    @torch.no_grad()
    def _sums(
        self,
        out: dict,
        q: torch.Tensor,
        targets: torch.Tensor,
        after: torch.Tensor,
        m: torch.Tensor,
        counts: tuple,
        n_actions: int,
    ) -> torch.Tensor:
        """One micro-batch's ``_SUMS``: losses times the action count, Q statistics summed over actions
        (``after`` shifted one token gives the reference's log-normaliser of each action's state);
        ``counts``: the TD, conservative and KL losses and the actions whose target the Monte-Carlo
        bound lifted."""
        mf = m.float()
        td, cons, kl, raised = (float(x) for x in counts)
        before = _action_states(after)
        q = q.detach()
        unseen = (out["q_mean"] * self.vocab_size - out["q"]) / (self.vocab_size - 1) - before * mf
        n = float(n_actions)
        return torch.tensor(
            [
                td * n,
                cons * n,
                kl * n,
                float((q * mf).sum()),
                float((targets * mf).sum()),
                float((unseen * mf).sum()),
                float(((out["q_max"] - before) * mf).sum()),
                float(((q - targets).abs() * mf).sum()),
                raised,
                kl * n,
            ],
            dtype=torch.float64,
            device=self.device,
        )

    def train_step(self, batch: Experience) -> dict[str, float]:
        """``train.epochs`` x ``train.num_minibatches`` Q updates on the global batch."""
        tr, comm = self.tr, self.comm
        t0 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        batch, mask, rewards, done = self._prepare(batch)
        backups = self.backup_rewards(rewards, mask, batch.group_ids)
        batch, (mask, rewards, done, backups), uniform = self._signal_rows(batch, mask, rewards, done, backups)
        if not bool(mask.any()):
            return {"learner/empty_batch": 1.0, "learner/sequences": float(batch.batch_size), **uniform}
        batch = self._with_reference(batch)
        plan = list(self.global_minibatches(torch.arange(batch.batch_size, device=self.device)))
        mine_all = torch.unique(torch.cat([mine for _, mine in plan]))
        ref = self._calibration(batch, mask, mine_all)
        self.model.train()
        self.model.rows_shared = self.model.rows_total = 0
        totals = torch.zeros(len(_SUMS), dtype=torch.float64, device=self.device)
        grad_norms: list[float] = []
        actions = 0
        for mini, mine in plan:
            n_actions = max(int(mask[mini].sum()), 1)
            actions += n_actions
            self.optimizer.zero_grad(set_to_none=True)
            for micro in self.rank_passes(torch.split(mine, tr.micro_batch_size), grad=True):
                totals += self._micro(batch, micro, mask, backups, done, n_actions, grad=True, ref=ref)
            grad_norms.append(self._optimizer_step())
            self.updates += 1
            self._update_target()
        self.version += 1
        summed = comm.all_reduce_sum(totals)
        metrics = {k: float(v) / max(actions, 1) for k, v in zip(_SUMS, summed)}
        metrics["loss/total"] = (
            metrics["loss/td"]
            + self.hp.conservative_weight * metrics["loss/conservative"]
            + self.hp.kl_coef * metrics["loss/kl"]
        )
        resp = mask.sum(1).float()
        metrics.update(
            {
                "learner/lr": lr,
                "learner/updates": float(self.updates),
                "learner/target_updates": float(self.target_updates),
                "learner/target_pass": float(self.reads_target),
                "learner/trainable_fraction": self.trainable_fraction,
                "learner/prefix_shared_frac": self.model.rows_shared / max(self.model.rows_total, 1),
                "learner/tokens": float(mask.sum()),
                "learner/sequences": float(batch.batch_size),
                "learner/update_s": time.perf_counter() - t0,
                "learner/stale_versions": float(self.version - 1 - batch.policy_version),
                "policy/grad_norm": sum(grad_norms) / len(grad_norms),
                "rewards/sequence_mean": float((rewards.sum(1) / self.hp.reward_scale).mean()),
                "response/length_mean": float(resp.mean()),
                "response/done_frac": float(done.float().mean()),
                **uniform,
                **self.router_metrics(),  # the online and the target network's passes (MoE)
            }
        )
        return metrics

    def _signal_rows(
        self, batch: Experience, mask: torch.Tensor, rewards: torch.Tensor, done: torch.Tensor, backups: torch.Tensor
    ) -> tuple[Experience, tuple[torch.Tensor, ...], dict[str, float]]:
        """``skip_uniform_groups``: the batch and its per-row tensors restricted to the groups
        whose centered rewards are not all 0 (``groups_with_signal``; whole groups, so the kept rows'
        centering is unchanged), and the count of rows left out; everything as it is otherwise."""
        tensors = (mask, rewards, done, backups)
        if not self.hp.skip_uniform_groups:
            return batch, tensors, {}
        # Every rank must keep the same rows (sharded passes); a GPU's unordered sums could leave
        # one rank a centered reward another rounds to 0, so a group any rank keeps is kept.
        keep = self.comm.all_reduce_max(groups_with_signal(backups, mask, batch.group_ids).float()) > 0
        left_out = {"learner/uniform_group_rows": float((~keep).sum())}
        if bool(keep.all()):
            return batch, tensors, left_out
        idx = keep.nonzero(as_tuple=True)[0]
        return batch.select(idx), tuple(t[idx] for t in tensors), left_out

    @torch.no_grad()
    def evaluate(self, batch: Experience) -> dict[str, float]:
        """TD loss and Q statistics of held-out transitions (no update), under ``eval/``."""
        batch, mask, rewards, done = self._prepare(batch)
        batch = self._with_reference(batch)
        n = max(int(mask.sum()), 1)
        mine = torch.arange(batch.batch_size, device=self.device)[self.comm.rank :: self.comm.world]
        ref, backups = self._calibration(batch, mask, mine), self.backup_rewards(rewards, mask, batch.group_ids)
        self.model.eval()
        totals = torch.zeros(len(_SUMS), dtype=torch.float64, device=self.device)
        for micro in self.rank_passes(torch.split(mine, self.tr.micro_batch_size), grad=False):
            totals += self._micro(batch, micro, mask, backups, done, n, grad=False, ref=ref)
        summed = self.comm.all_reduce_sum(totals)
        return {f"eval/{k}": float(v) / n for k, v in zip(_SUMS, summed)} | {"eval/tokens": float(mask.sum())}

    # -- checkpoints -----------------------------------------------------------------------------
    def algorithm_state(self) -> dict[str, Any]:
        return {"updates": self.updates, "target_updates": self.target_updates}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        self.updates = int(state.get("updates", 0))
        self.target_updates = int(state.get("target_updates", 0))

    def save_extra(self, folder: Path) -> None:
        from safetensors.torch import save_file

        if not self.target_params:
            return
        target = {n: full_tensor(t).contiguous().cpu() for n, t in zip(self.target_names, self.target_params)}
        if not self.writes_files:  # sharded: every rank gathered, rank 0 writes
            return
        (folder / TARGET_DIR).mkdir(parents=True, exist_ok=True)
        save_file(target, str(folder / TARGET_DIR / TARGET_FILE))

    def restore_extra(self, folder: Path) -> None:
        from safetensors.torch import load_file

        if not self.target_params:
            return
        path = folder / TARGET_DIR / TARGET_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{folder} holds no target network ({TARGET_DIR}/{TARGET_FILE})")
        saved = load_file(str(path))
        missing = [n for n in self.target_names if n not in saved]
        if missing:
            raise ValueError(f"target network in {folder} does not fit this learner (missing {missing[:3]})")
        for n, t in zip(self.target_names, self.target_params):
            load_shard_(t, saved[n])


def _action_states(after: torch.Tensor) -> torch.Tensor:
    """A per-state term read at bootstrap positions (after each action, ``p = t``) moved to each
    action's own state (``p = t - 1``)."""
    return torch.cat([torch.zeros_like(after[:, :1]), after[:, :-1]], dim=1)
