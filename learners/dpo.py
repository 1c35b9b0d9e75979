"""Preference learner: DPO and its family (cDPO, IPO, hinge, robust DPO, SimPO), full or LoRA.

A batch is an ``Experience`` whose groups are preference pairs: two rows with one ``group_ids``
value share the prompt, the row with the higher ``scores`` value is the chosen response, the
other the rejected one. ``ref_logprobs`` (per token, from the Reference actor, computed once per
dataset) give the reference's sequence log-probs; SimPO needs none, and with LoRA the learner
computes them itself with the adapter disabled.

One ``train_step`` on the global batch: the pairs are shuffled by a generator that depends only
on the run seed, the policy version and the epoch, cut into global minibatches, and each rank
takes every ``world``-th pair of each minibatch. The loss of a minibatch is the sum of its pair
losses divided by its global pair count and gradients are summed across ranks, so N learners
take exactly the step one learner takes on the same batch.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch

from learners.base import LearnerContext, TrainParams
from learners.experience import Experience, ExperienceError
from learners.objectives.preference_losses import preference_loss, preference_metrics, preference_rewards
from learners.training.modeling import autocast, shared_weight_casts
from learners.policy import PolicyLearner

_STATS = (
    "loss/total",
    "rewards/accuracy",
    "rewards/margin",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
)


class DPOParams(Protocol):
    """The fields of ``cluster.config.DPOConfig`` the learner reads (documented there)."""

    loss: str
    beta: float
    label_smoothing: float
    simpo_gamma: float

    @property
    def uses_reference(self) -> bool: ...


def preference_pairs(group_ids: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Chosen and rejected row indices ``(P,)`` of each well-formed pair, in order of first
    appearance, and the number of malformed groups (not exactly two rows, or tied scores),
    which are left out.

    group_ids, scores: ``(B,)``.
    """
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        members.setdefault(g, []).append(i)
    chosen, rejected, bad = [], [], 0
    for rows in members.values():
        if len(rows) != 2 or float(scores[rows[0]]) == float(scores[rows[1]]):
            bad += 1
            continue
        a, b = rows
        win, lose = (a, b) if float(scores[a]) > float(scores[b]) else (b, a)
        chosen.append(win)
        rejected.append(lose)
    dev = group_ids.device
    return torch.tensor(chosen, dtype=torch.long, device=dev), torch.tensor(rejected, dtype=torch.long, device=dev), bad


def evaluate_pairs(
    batch: Experience,
    comm: Any,
    micro_pairs: int,
    stats: tuple[str, ...],
    micro_step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    passes: Callable[[Any], Any] = lambda micros: micros,
) -> dict[str, float]:
    """Held-out metrics of a pairwise learner under ``eval/``: each rank runs every ``world``-th
    pair through ``micro_step(chosen, rejected, global_pairs)`` (no gradient), which returns its
    pairs' sums of ``stats``; the loss (first stat) is already a mean, the others become one.
    ``passes``: the learner's ``rank_passes`` where its passes must be aligned across ranks."""
    chosen, rejected, malformed = preference_pairs(batch.group_ids, batch.scores)
    if len(chosen) == 0:
        return {"eval/pairs": 0.0, "eval/malformed_pairs": float(malformed)}
    totals = torch.zeros(len(stats), dtype=torch.float64, device=chosen.device)
    mine = torch.arange(len(chosen), device=chosen.device)[comm.rank :: comm.world]
    for micro in passes(torch.split(mine, max(1, micro_pairs))):
        totals += micro_step(chosen[micro], rejected[micro], len(chosen))
    summed = comm.all_reduce_sum(totals)
    out = {f"eval/{k}": float(v) / (1 if i == 0 else len(chosen)) for i, (k, v) in enumerate(zip(stats, summed))}
    out.update({"eval/pairs": float(len(chosen)), "eval/malformed_pairs": float(malformed)})
    return out


class DPOLearner(PolicyLearner):
    name = "dpo"
    config_section = "dpo"
    shardable = True
    required_fields = ("scores",)

    def __init__(self, ctx: LearnerContext, train: TrainParams, hp: DPOParams) -> None:
        super().__init__(ctx, train, with_value_head=False)
        self.hp = hp
        self._init_optimizer(updates_per_step=train.epochs * train.num_minibatches)

    def check_batch(self, batch: Experience) -> None:
        super().check_batch(batch)
        if self.hp.uses_reference and batch.ref_logprobs is None and not self.reference_in_learner:
            raise ExperienceError(
                f"dpo.loss={self.hp.loss} needs ref_logprobs in every batch "
                "(computed by the Reference actor, or in the learner with LoRA or train.reference=learners)"
            )

    def _sequence_logps(self, part: Experience) -> torch.Tensor:
        """(b,) summed response log-probs of the policy, with gradient."""
        with autocast(self.tr.bf16, self.device):
            out = self.model(
                part.input_ids,
                part.attention_mask,
                part.response_mask,
                chunk=self.tr.logprob_chunk,
                group_ids=part.group_ids if self.tr.shared_prefix else None,
            )
        return (out["logprobs"] * part.response_mask).sum(1)

    def train_step(self, batch: Experience) -> dict[str, float]:
        """One pass (``train.epochs`` x ``train.num_minibatches`` updates) over the global batch."""
        tr, comm = self.tr, self.comm
        t0 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.check_batch(batch)
        batch = self.on_device(batch)
        chosen, rejected, malformed = preference_pairs(batch.group_ids, batch.scores)
        n_pairs = len(chosen)
        if n_pairs == 0:
            return {"learner/empty_batch": 1.0, "learner/pairs": 0.0, "learner/malformed_pairs": float(malformed)}
        lengths = batch.response_mask.sum(1).float()
        ref_seq = self._reference_sums(batch)
        self.model.train()
        self.model.rows_shared = self.model.rows_total = 0
        totals = torch.zeros(len(_STATS), dtype=torch.float64, device=self.device)
        grad_norms: list[float] = []
        local_pairs = 0
        pairs_per_micro = max(1, tr.micro_batch_size // 2)
        for mini, mine in self.global_minibatches(torch.arange(n_pairs, device=self.device)):
            local_pairs += len(mine)
            self.optimizer.zero_grad(set_to_none=True)
            with shared_weight_casts(tr.bf16, self.device):
                for micro in self.rank_passes(torch.split(mine, pairs_per_micro), grad=True):
                    totals += self._micro_step(
                        batch, chosen[micro], rejected[micro], ref_seq, lengths, max(len(mini), 1)
                    )
            grad_norms.append(self._optimizer_step())
        self.version += 1
        summed = comm.all_reduce_sum(totals)
        n_updates = tr.epochs * tr.num_minibatches
        # Loss: mean over updates of each minibatch's mean; the others: mean over pairs and epochs.
        metrics = {
            k: float(v) / (n_updates if k == "loss/total" else n_pairs * tr.epochs) for k, v in zip(_STATS, summed)
        }
        metrics.update(
            {
                "learner/lr": lr,
                "learner/pairs": float(n_pairs),
                "learner/malformed_pairs": float(malformed),
                "learner/local_pairs": float(local_pairs),
                "learner/trainable_fraction": self.trainable_fraction,
                "learner/prefix_shared_frac": self.model.rows_shared / max(self.model.rows_total, 1),
                "learner/update_s": time.perf_counter() - t0,
                "policy/grad_norm": sum(grad_norms) / len(grad_norms),
                "response/length_mean": float(lengths[torch.cat([chosen, rejected])].mean()),
            }
        )
        return metrics

    def _reference_sums(self, batch: Experience) -> torch.Tensor | None:
        """(B,) reference log-probs of each row's response, or None when the loss needs none."""
        if not self.hp.uses_reference:
            return None
        ref = batch.ref_logprobs
        if ref is None:  # LoRA: the base model with the adapter disabled
            ref = self.base_logprobs(batch.input_ids, batch.attention_mask, batch.response_mask, batch.group_ids)
        return (ref * batch.response_mask).sum(1)

    @torch.no_grad()
    def evaluate(self, batch: Experience) -> dict[str, float]:
        """Loss, implicit-reward accuracy and margin on held-out pairs, under ``eval/``."""
        self.check_batch(batch)
        batch = self.on_device(batch)
        ref_seq = self._reference_sums(batch)
        lengths = batch.response_mask.sum(1).float()
        self.model.eval()
        return evaluate_pairs(
            batch,
            self.comm,
            self.tr.micro_batch_size // 2,
            _STATS,
            lambda c, r, n: self._micro_step(batch, c, r, ref_seq, lengths, n, grad=False),
            passes=lambda micros: self.rank_passes(micros, grad=False),
        )

    def _micro_step(
        self,
        batch: Experience,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        ref_seq: torch.Tensor | None,
        lengths: torch.Tensor,
        global_pairs: int,
        grad: bool = True,
    ) -> torch.Tensor:
        """Forward/backward of a few pairs (each pair's rows side by side, so they share their
        prompt's forward pass); returns their contribution to ``_STATS``."""
        hp = self.hp
        rows = torch.stack([chosen, rejected], 1).reshape(-1)
        part = batch.select(rows).trimmed()
        logps = self._sequence_logps(part).view(-1, 2)
        pi_w, pi_l = logps[:, 0], logps[:, 1]
        ref_w = ref_seq[chosen] if ref_seq is not None else None
        ref_l = ref_seq[rejected] if ref_seq is not None else None
        len_w, len_l = lengths[chosen], lengths[rejected]
        losses = preference_loss(
            pi_w,
            pi_l,
            ref_w,
            ref_l,
            kind=hp.loss,
            beta=hp.beta,
            label_smoothing=hp.label_smoothing,
            chosen_lengths=len_w,
            rejected_lengths=len_l,
            simpo_gamma=hp.simpo_gamma,
        )
        loss = losses.sum() / global_pairs
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite {hp.loss} loss: {float(loss)}")
        if grad:
            loss.backward()
        r_w, r_l = preference_rewards(
            pi_w, pi_l, ref_w, ref_l, beta=hp.beta, chosen_lengths=len_w, rejected_lengths=len_l
        )
        m = preference_metrics(r_w, r_l, pi_w, pi_l)
        return torch.tensor(
            [float(loss.detach()), *(float(m[k]) for k in _STATS[1:])], dtype=torch.float64, device=self.device
        )
