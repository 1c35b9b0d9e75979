"""PPO learner: policy + critic update on one Experience batch (Ouyang et al. 2022 recipe).

Plain torch: runs inside a Ray Train worker (``cluster/learner_group.py``) or in a test.
One ``train_step`` is: recompute old log-probs and values with the current weights, fold
the KL to the reference into per-token rewards, GAE, then clipped policy/value updates over
minibatch epochs. Works on one data-parallel shard; when torch.distributed is initialised
the model is wrapped in DDP and every rank takes the same number of optimiser steps.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from learners.advantages import gae_advantages, kl_shaped_rewards
from learners.experience import Experience
from learners.losses import (
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss_clipped,
    value_loss_clipped,
)
from learners.modeling import PolicyWithValueHead, autocast


class PPOHyperParams(Protocol):
    """The fields of ``cluster.config.PPOConfig`` the learner reads (documented there)."""

    lr: float
    critic_lr: float
    weight_decay: float
    epochs: int
    minibatch_size: int
    micro_batch_size: int
    clip_eps: float
    value_clip_eps: float
    vf_coef: float
    entropy_coef: float
    kl_coef: float
    kl_estimator: str
    kl_loss_coef: float
    gamma: float
    lam: float
    whiten_advantages: bool
    max_grad_norm: float
    bf16: bool
    logprob_chunk: int


def _dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class PPOLearner:
    def __init__(
        self,
        model_path: str,
        hp: PPOHyperParams,
        *,
        temperature: float = 1.0,
        score_clip: float | None = None,
        seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.hp = hp
        self.temperature = temperature
        self.score_clip = score_clip
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        lm.config.use_cache = False
        self.model = PolicyWithValueHead(lm)
        self.rank, self.world = _dist_info()
        self.module: nn.Module = self.model
        if self.world > 1:
            self.module = nn.parallel.DistributedDataParallel(self.model)
        policy_params = [p for n, p in self.model.named_parameters() if not n.startswith("value_head.")]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": policy_params, "lr": hp.lr},
                {"params": list(self.model.value_head.parameters()), "lr": hp.critic_lr},
            ],
            weight_decay=hp.weight_decay,
        )
        self.version = 0

    # -- forward helpers -------------------------------------------------------------------------
    def _forward(self, exp: Experience, *, grad: bool, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        module = module or self.module
        with torch.set_grad_enabled(grad), autocast(self.hp.bf16):
            return module(
                exp.input_ids, exp.attention_mask, exp.response_mask,
                temperature=self.temperature, chunk=self.hp.logprob_chunk,
                with_values=True, with_entropy=True,
            )

    @torch.no_grad()
    def evaluate_old(self, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) log-probs and values of the current weights, before any update."""
        lps, vals = [], []
        for s in range(0, exp.batch_size, self.hp.micro_batch_size):
            out = self._forward(exp.select(list(range(s, min(s + self.hp.micro_batch_size, exp.batch_size)))), grad=False, module=self.model)
            lps.append(out["logprobs"])
            vals.append(out["values"])
        return torch.cat(lps), torch.cat(vals)

    # -- the update ------------------------------------------------------------------------------
    def train_step(self, exp: Experience) -> dict[str, float]:
        """One PPO iteration on this rank's shard; returns scalar metrics."""
        hp = self.hp
        t0 = time.perf_counter()
        if exp.ref_logprobs is None or exp.scores is None:
            raise ValueError("PPO needs ref_logprobs and scores in the experience record")
        self.model.train()
        mask = exp.response_mask
        b = exp.batch_size
        mb = min(hp.minibatch_size, b)
        # On-policy single update (one epoch, one minibatch, one micro-batch): the "old" policy is
        # the current one, so its log-probs and values come from the training forward pass itself
        # instead of a second pass over the batch (a quarter of the learner's time on CPU).
        fused = hp.epochs == 1 and mb == b and hp.micro_batch_size >= b
        fused_out: dict[str, torch.Tensor] | None = None
        if fused:
            fused_out = self._forward(exp, grad=True)
            old_logprobs = fused_out["logprobs"].detach()
            old_values = fused_out["values"].detach()
        else:
            old_logprobs, old_values = self.evaluate_old(exp)
        gap = (old_logprobs - exp.rollout_logprobs).abs()
        rewards, kl = kl_shaped_rewards(
            exp.scores, old_logprobs, exp.ref_logprobs, mask, hp.kl_coef,
            kl_kind=hp.kl_estimator, score_clip=self.score_clip,
        )
        advantages, returns = gae_advantages(rewards, old_values, mask, gamma=hp.gamma, lam=hp.lam)
        if hp.whiten_advantages and int(mask.sum()) > 1:
            advantages = masked_whiten(advantages, mask) * mask
        exp = exp.replace(values=old_values)
        t_prep = time.perf_counter() - t0

        stats: dict[str, list[float]] = {}

        def add(name: str, value: torch.Tensor | float, weight: float = 1.0) -> None:
            stats.setdefault(name, []).append(float(value.detach() if isinstance(value, torch.Tensor) else value) * weight)

        n_mini = math.ceil(b / mb)
        gen = torch.Generator().manual_seed(self.version)
        grad_norms = []
        for _epoch in range(hp.epochs):
            order = torch.arange(b) if fused else torch.randperm(b, generator=gen)
            for m in range(n_mini):
                mini = order[m * mb : (m + 1) * mb]
                mini_tokens = max(int(mask[mini].sum()), 1)
                self.optimizer.zero_grad(set_to_none=True)
                micro_chunks = [mini[i : i + hp.micro_batch_size] for i in range(0, len(mini), hp.micro_batch_size)]
                for k, micro in enumerate(micro_chunks):
                    part = exp.select(micro)
                    mmask = part.response_mask
                    # Token-mean over the whole minibatch, whatever the micro-batch split.
                    weight = float(mmask.sum()) / mini_tokens
                    sync = self.world == 1 or k == len(micro_chunks) - 1
                    ctx = self.module.no_sync() if not sync and hasattr(self.module, "no_sync") else _null()
                    with ctx:
                        out = fused_out if fused_out is not None else self._forward(part, grad=True)
                        pg_loss, pg_stats = policy_loss_clipped(
                            out["logprobs"], old_logprobs[micro], advantages[micro], mmask, clip_eps=hp.clip_eps
                        )
                        vf_loss, vf_stats = value_loss_clipped(
                            out["values"], old_values[micro], returns[micro], mmask, clip_eps=hp.value_clip_eps
                        )
                        entropy = masked_mean(out["entropy"], mmask)
                        loss = pg_loss + hp.vf_coef * vf_loss
                        if hp.entropy_coef:
                            # Entropy is measured detached; the bonus uses -logprob as its estimator.
                            loss = loss + hp.entropy_coef * masked_mean(out["logprobs"], mmask)
                        if hp.kl_loss_coef:
                            kl_term = masked_mean(kl_penalty(out["logprobs"], part.ref_logprobs, "k3"), mmask)
                            loss = loss + hp.kl_loss_coef * kl_term
                        if not torch.isfinite(loss):
                            raise FloatingPointError(f"non-finite PPO loss at minibatch {m}: {float(loss)}")
                        (loss * weight).backward()
                    add("loss/policy", pg_loss, weight)
                    add("loss/value", vf_loss, weight)
                    add("loss/total", loss, weight)
                    add("policy/entropy", entropy, weight)
                    add("policy/clip_frac", pg_stats["clip_frac"], weight)
                    add("policy/approx_kl", pg_stats["approx_kl"], weight)
                    add("value/clip_frac", vf_stats["vf_clip_frac"], weight)
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), hp.max_grad_norm)
                grad_norms.append(float(gn))
                self.optimizer.step()
        self.version += 1
        n_updates = hp.epochs * n_mini
        metrics = {k: sum(v) / n_updates for k, v in stats.items()}
        resp = mask.sum(1).float()
        metrics.update(
            {
                "policy/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                "kl/ref_k1": float(masked_mean(kl_penalty(old_logprobs, exp.ref_logprobs, "k1"), mask)),
                "kl/ref_k3": float(masked_mean(kl_penalty(old_logprobs, exp.ref_logprobs, "k3"), mask)),
                "kl/penalty_per_seq": float((kl * mask).sum(1).mean()) * hp.kl_coef,
                "logprob_gap/mean_abs": float(masked_mean(gap, mask)),
                "logprob_gap/max_abs": float(gap[mask].max()) if bool(mask.any()) else 0.0,
                "value/mean": float(masked_mean(old_values, mask)),
                "value/returns_mean": float(masked_mean(returns, mask)),
                "value/explained_var": _explained_variance(old_values, returns, mask),
                "advantage/mean": float(masked_mean(advantages, mask)),
                "response/length_mean": float(resp.mean()) if len(resp) else 0.0,
                "learner/prep_s": t_prep,
                "learner/update_s": time.perf_counter() - t0 - t_prep,
                "learner/tokens": float(mask.sum()),
                "learner/fused_old_pass": float(fused),
                "learner/sequences": float(b),
            }
        )
        return metrics

    # -- weights out -----------------------------------------------------------------------------
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Policy weights in transformers (checkpoint) naming, without the value head or tied copies."""
        lm = self.model.lm
        sd = lm.state_dict()
        if getattr(lm.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return sd

    def save(self, folder: str | Path, tokenizer_from: str | None = None) -> Path:
        """transformers-loadable safetensors folder (+ the value head beside it)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.lm.save_pretrained(str(folder), safe_serialization=True)
        save_file({k: v.detach().contiguous() for k, v in self.model.value_head.state_dict().items()}, str(folder / "value_head.safetensors"))
        if tokenizer_from:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(str(folder))
        return folder


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    if int(mask.sum()) < 2:
        return 0.0
    var_r = float(returns[mask].var())
    if var_r == 0:
        return 0.0
    return 1.0 - float((returns - values)[mask].var()) / var_r


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a: Any) -> None:
        return None
