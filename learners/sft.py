"""Supervised fine-tuning: prompt-masked cross-entropy on demonstrations, full or LoRA.

The loss of a minibatch is the negative log-likelihood of its response tokens (the prompt is
context, not target) divided by the minibatch's global response-token count:

    L(theta) = - sum_{i, t in response_i} log pi_theta(y_t | x_i, y_<t) / sum_i |response_i|

Rows are shuffled by a generator that depends only on the run seed, the version and the epoch,
cut into global minibatches, and each rank takes every ``world``-th row of each, so N learners
take the step one learner takes on the same batch. Stage 0 of the DPO recipes.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import torch

from learners.base import LearnerContext, TrainParams
from learners.experience import Experience
from learners.training.modeling import autocast, shared_weight_casts
from learners.policy import PolicyLearner


class SFTParams(Protocol):
    """The fields of ``cluster.config.SFTConfig`` the learner reads (documented there)."""


class SFTLearner(PolicyLearner):
    name = "sft"
    config_section = "sft"
    shardable = True
    required_fields = ()

    def __init__(self, ctx: LearnerContext, train: TrainParams, hp: SFTParams) -> None:
        super().__init__(ctx, train, with_value_head=False)
        self.hp = hp
        self._init_optimizer(updates_per_step=train.epochs * train.num_minibatches)

    def evaluate(self, batch: Experience) -> dict[str, float]:
        """Held-out per-token NLL and perplexity of the responses, under ``eval/``."""
        batch = self.on_device(batch)
        tokens = batch.response_mask.sum(1)
        rows = torch.nonzero(tokens > 0).flatten()
        mine = rows[self.comm.rank :: self.comm.world]
        self.model.eval()
        nll = torch.zeros((), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for micro in self.rank_passes(torch.split(mine, self.tr.micro_batch_size), grad=False):
                part = batch.select(micro).trimmed()
                with autocast(self.tr.bf16, self.device):
                    out = self.model(
                        part.input_ids, part.attention_mask, part.response_mask, chunk=self.tr.logprob_chunk
                    )
                nll += float(-(out["logprobs"].float() * part.response_mask).sum())
        total = max(float(tokens[rows].sum()), 1.0)
        mean = float(self.comm.all_reduce_sum(nll)) / total
        return {"eval/nll": mean, "eval/perplexity": math.exp(min(mean, 50.0)), "eval/examples": float(len(rows))}

    def train_step(self, batch: Experience) -> dict[str, float]:
        tr, comm = self.tr, self.comm
        t0 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.check_batch(batch)
        batch = self.on_device(batch)
        tokens = batch.response_mask.sum(1)
        rows = torch.nonzero(tokens > 0).flatten()
        if len(rows) == 0:
            return {"learner/empty_batch": 1.0, "learner/sequences": float(batch.batch_size)}
        self.model.train()
        nll_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        grad_norms: list[float] = []
        for mini, mine in self.global_minibatches(rows):
            global_tokens = max(float(tokens[mini].sum()), 1.0)
            self.optimizer.zero_grad(set_to_none=True)
            with shared_weight_casts(tr.bf16, self.device):
                for micro in self.rank_passes(torch.split(mine, tr.micro_batch_size), grad=True):
                    part = batch.select(micro).trimmed()
                    with autocast(tr.bf16, self.device):
                        out = self.model(
                            part.input_ids, part.attention_mask, part.response_mask, chunk=tr.logprob_chunk
                        )
                    nll = -(out["logprobs"] * part.response_mask).sum()
                    loss = nll / global_tokens
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"non-finite SFT loss: {float(loss)}")
                    loss.backward()
                    nll_sum += float(nll.detach())
            grad_norms.append(self._optimizer_step())
        self.version += 1
        total_tokens = float(tokens[rows].sum()) * tr.epochs
        nll_mean = float(comm.all_reduce_sum(nll_sum)) / total_tokens
        return {
            "loss/total": nll_mean,
            "sft/perplexity": math.exp(min(nll_mean, 50.0)),
            "learner/lr": lr,
            "learner/sequences": float(len(rows)),
            "learner/tokens": float(tokens[rows].sum()),
            "learner/trainable_fraction": self.trainable_fraction,
            "learner/update_s": time.perf_counter() - t0,
            "policy/grad_norm": sum(grad_norms) / len(grad_norms),
        }
