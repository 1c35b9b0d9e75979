"""Policy-gradient learner: PPO with a critic (Ouyang et al. 2022 recipe) or critic-free
group/batch baselines (GRPO, Dr. GRPO, RLOO, REINFORCE++), full fine-tuning or LoRA.

Plain torch: runs inside a Ray Train worker (``cluster/learner_group.py``) or in a test.
One ``train_step`` is: recompute old log-probs and values with the current weights, fold
the KL to the reference into per-token rewards, GAE, then clipped policy/value updates over
minibatch epochs. Works on one data-parallel shard; when torch.distributed is initialised
the model is wrapped in DDP and every rank takes the same number of optimiser steps.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch
from torch import nn

from learners.advantages import (
    gae_advantages,
    group_baseline_advantages,
    kl_shaped_rewards,
    reinforce_pp_advantages,
)
from learners.experience import Experience
from learners.losses import (
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss_clipped,
    value_loss_clipped,
)
from learners.kl_control import make_kl_controller
from learners.modeling import PolicyWithValueHead, autocast, micro_batch_order, sequence_logprobs


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
    advantage_estimator: str
    loss_agg: str
    loss_agg_constant: float
    kl_controller: str
    kl_target: float
    kl_horizon: int
    gradient_checkpointing: bool
    shared_prefix: bool

    @property
    def uses_reference(self) -> bool: ...


class LoRAParams(Protocol):
    """The fields of ``cluster.config.LoRAConfig`` the learner reads."""

    enabled: bool
    r: int
    alpha: float
    dropout: float
    target_modules: list


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
        lora: LoRAParams | None = None,
        truncation: str = "keep",
        truncation_penalty: float = 0.0,
        max_new_tokens: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.hp = hp
        self.temperature = temperature
        self.score_clip = score_clip
        self.truncation = truncation
        self.truncation_penalty = truncation_penalty
        self.use_critic = hp.advantage_estimator == "gae"
        self.loss_agg_constant = hp.loss_agg_constant or float(max_new_tokens) or None
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        lm.config.use_cache = False
        self.lora = bool(lora is not None and lora.enabled)
        if self.lora:
            from peft import LoraConfig, get_peft_model

            lm = get_peft_model(
                lm,
                LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(lora.target_modules), task_type="CAUSAL_LM", bias="none"),
            )
        if hp.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.kl_ctl = make_kl_controller(hp.kl_controller, hp.kl_coef, hp.kl_target, hp.kl_horizon)
        self.model = PolicyWithValueHead(lm)
        if not self.use_critic:
            # Critic-free estimators never touch the value head; DDP requires every trainable
            # parameter to receive a gradient, so freeze it.
            self.model.value_head.requires_grad_(False)
        self.rank, self.world = _dist_info()
        self.module: nn.Module = self.model
        if self.world > 1:
            self.module = nn.parallel.DistributedDataParallel(self.model)
        # With LoRA, peft has frozen the base weights: only adapters (and the value head) train.
        policy_params = [
            p for n, p in self.model.named_parameters() if not n.startswith("value_head.") and p.requires_grad
        ]
        self.trainable_fraction = sum(p.numel() for p in policy_params) / sum(
            p.numel() for n, p in self.model.named_parameters() if not n.startswith("value_head.")
        )
        self.optimizer = torch.optim.AdamW(
            [
                {"params": policy_params, "lr": hp.lr},
                {"params": [p for p in self.model.value_head.parameters() if p.requires_grad], "lr": hp.critic_lr},
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
                with_values=self.use_critic, with_entropy=True,
                group_ids=exp.group_ids if self.hp.shared_prefix else None,
            )

    @torch.no_grad()
    def evaluate_old(self, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) log-probs and values of the current weights, before any update."""
        lps = torch.zeros(exp.batch_size, exp.seq_len)
        vals = torch.zeros_like(lps)
        # Length-sorted, trimmed micro-batches (see train_step); results go back to their rows.
        order = micro_batch_order(exp.attention_mask.sum(1), exp.group_ids)
        for s in range(0, exp.batch_size, self.hp.micro_batch_size):
            idx = order[s : s + self.hp.micro_batch_size]
            part = exp.select(idx).trimmed()
            out = self._forward(part, grad=False, module=self.model)
            lps[idx, : part.seq_len] = out["logprobs"]
            if self.use_critic:
                vals[idx, : part.seq_len] = out["values"]
        return lps, vals

    @torch.no_grad()
    def reference_logprobs(self, exp: Experience) -> torch.Tensor:
        """(B, L) log-probs of the frozen base model: the LoRA policy with its adapter disabled,
        so the reference costs no second copy of the weights."""
        if not self.lora:
            raise RuntimeError("reference_logprobs() in the learner needs LoRA (else a Reference actor serves it)")
        with self.model.lm.disable_adapter():
            return sequence_logprobs(
                self.model.lm, exp.input_ids, exp.attention_mask, exp.response_mask,
                temperature=self.temperature, micro_batch_size=self.hp.micro_batch_size,
                chunk=self.hp.logprob_chunk, bf16=self.hp.bf16,
                group_ids=exp.group_ids if self.hp.shared_prefix else None,
            )

    def _apply_truncation(self, exp: Experience) -> Experience:
        """Responses cut at the length limit: kept, penalised, or left out of the loss."""
        if self.truncation == "keep" or not bool(exp.truncated.any()):
            return exp
        if self.truncation == "penalize":
            return exp.replace(scores=exp.scores + self.truncation_penalty * exp.truncated.float())
        rm = exp.response_mask & ~exp.truncated[:, None]
        return exp.replace(response_mask=rm)

    # -- the update ------------------------------------------------------------------------------
    def train_step(self, exp: Experience) -> dict[str, float]:
        """One PPO iteration on this rank's shard; returns scalar metrics."""
        hp = self.hp
        t0 = time.perf_counter()
        if exp.scores is None:
            raise ValueError("the learner needs scores in the experience record")
        if exp.batch_size == 0 or not bool(exp.response_mask.any()):
            # Every sample was dropped upstream (failed rewards, over-long prompts): nothing to learn.
            return {"learner/empty_batch": 1.0, "learner/sequences": float(exp.batch_size)}
        t_ref = 0.0
        self.model.rows_shared = self.model.rows_total = 0
        if exp.ref_logprobs is None and hp.uses_reference:
            exp = exp.replace(ref_logprobs=self.reference_logprobs(exp))
            t_ref = time.perf_counter() - t0
        n_truncated = int(exp.truncated.sum())
        exp = self._apply_truncation(exp)
        self.model.train()
        mask = exp.response_mask
        kl_coef = float(self.kl_ctl.value)
        b = exp.batch_size
        mb = min(hp.minibatch_size, b)
        # One update on the whole batch (one epoch, one minibatch) is on-policy: the "old" policy
        # is the current one, so its log-probs come from the training forward pass itself instead
        # of a second pass over the batch (a quarter to a third of the learner's time on CPU).
        # In one micro-batch ("fused") that pass also gives the values and KL the advantages need;
        # over several micro-batches ("streamed") it works when the advantages depend on the
        # scores alone (no critic, no KL in the reward), and each micro-batch's own forward then
        # serves as both the old and the new policy.
        on_policy = hp.epochs == 1 and mb == b
        fused = on_policy and hp.micro_batch_size >= b
        streamed = on_policy and not fused and not self.use_critic and kl_coef == 0
        fused_out: dict[str, torch.Tensor] | None = None
        if fused:
            fused_out = self._forward(exp, grad=True)
            old_logprobs = fused_out["logprobs"].detach()
            old_values = fused_out["values"].detach() if self.use_critic else torch.zeros_like(old_logprobs)
        elif streamed:
            # Filled in micro-batch by micro-batch below; until then the advantages read them only
            # multiplied by kl_coef = 0.
            old_logprobs = torch.zeros_like(exp.rollout_logprobs)
            old_values = torch.zeros_like(old_logprobs)
        else:
            old_logprobs, old_values = self.evaluate_old(exp)
        # No KL term (beta = 0, no KL loss): no reference pass ran, and the penalty below is an exact 0.
        has_ref = exp.ref_logprobs is not None
        ref_logprobs = exp.ref_logprobs if has_ref else old_logprobs
        estimator = hp.advantage_estimator
        returns = torch.zeros_like(old_logprobs)
        if estimator in ("gae", "reinforce_pp"):
            rewards, kl = kl_shaped_rewards(
                exp.scores, old_logprobs, ref_logprobs, mask, kl_coef,
                kl_kind=hp.kl_estimator, score_clip=self.score_clip,
            )
            if estimator == "gae":
                advantages, returns = gae_advantages(rewards, old_values, mask, gamma=hp.gamma, lam=hp.lam)
                if hp.whiten_advantages and int(mask.sum()) > 1:
                    advantages = masked_whiten(advantages, mask) * mask
            else:
                advantages = reinforce_pp_advantages(rewards, mask, gamma=hp.gamma)
        else:
            # Group baselines work on sequence rewards: the KL penalty enters as its sequence sum.
            kl = kl_penalty(old_logprobs, ref_logprobs, hp.kl_estimator) * mask
            scores = exp.scores if self.score_clip is None else exp.scores.clamp(-self.score_clip, self.score_clip)
            seq_rewards = scores - kl_coef * kl.sum(1)
            advantages = group_baseline_advantages(seq_rewards, exp.group_ids, mask, estimator=estimator)
        exp = exp.replace(values=old_values)
        t_prep = time.perf_counter() - t0

        stats: dict[str, list[float]] = {}

        def add(name: str, value: torch.Tensor | float, weight: float = 1.0) -> None:
            stats.setdefault(name, []).append(float(value.detach() if isinstance(value, torch.Tensor) else value) * weight)

        n_mini = math.ceil(b / mb)
        gen = torch.Generator().manual_seed(self.version)
        grad_norms = []
        for _epoch in range(hp.epochs):
            order = torch.arange(b) if on_policy else torch.randperm(b, generator=gen)
            for m in range(n_mini):
                mini = order[m * mb : (m + 1) * mb]
                mini_tokens = max(int(mask[mini].sum()), 1)
                mini_seqs = max(int(mask[mini].any(1).sum()), 1)
                self.optimizer.zero_grad(set_to_none=True)
                if fused_out is None:
                    # Micro-batches of similar length, each trimmed to its longest row (responses
                    # vary a lot in length, and padding costs as much compute as tokens), with a
                    # prompt's samples kept together so that they can share its forward pass.
                    mini = micro_batch_order(exp.attention_mask.sum(1), exp.group_ids, mini)
                micro_chunks = [mini[i : i + hp.micro_batch_size] for i in range(0, len(mini), hp.micro_batch_size)]
                for k, micro in enumerate(micro_chunks):
                    part = exp if fused_out is not None else exp.select(micro).trimmed()
                    width = part.seq_len
                    mmask = part.response_mask
                    # Each micro-batch's share of the minibatch loss, so that the aggregate is
                    # the same whatever the micro-batch split (gradient accumulation).
                    if hp.loss_agg == "token_mean":
                        weight = float(mmask.sum()) / mini_tokens
                    else:
                        weight = float(mmask.any(1).sum()) / mini_seqs
                    sync = self.world == 1 or k == len(micro_chunks) - 1
                    ctx = self.module.no_sync() if not sync and hasattr(self.module, "no_sync") else contextlib.nullcontext()
                    with ctx:
                        out = fused_out if fused_out is not None else self._forward(part, grad=True)
                        if streamed:
                            old_logprobs[micro, :width] = out["logprobs"].detach()
                        pg_loss, pg_stats = policy_loss_clipped(
                            out["logprobs"], old_logprobs[micro, :width], advantages[micro, :width], mmask,
                            clip_eps=hp.clip_eps,
                            loss_agg=hp.loss_agg, loss_agg_constant=self.loss_agg_constant,
                        )
                        entropy = masked_mean(out["entropy"], mmask)
                        loss = pg_loss
                        if self.use_critic:
                            vf_loss, vf_stats = value_loss_clipped(
                                out["values"], old_values[micro, :width], returns[micro, :width], mmask,
                                clip_eps=hp.value_clip_eps,
                            )
                            loss = loss + hp.vf_coef * vf_loss
                            add("loss/value", vf_loss, weight)
                            add("value/clip_frac", vf_stats["vf_clip_frac"], weight)
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
                    add("loss/total", loss, weight)
                    add("policy/entropy", entropy, weight)
                    add("policy/clip_frac", pg_stats["clip_frac"], weight)
                    add("policy/approx_kl", pg_stats["approx_kl"], weight)
                gn = torch.nn.utils.clip_grad_norm_(
                    [p for p in self.model.parameters() if p.grad is not None], hp.max_grad_norm
                )
                grad_norms.append(float(gn))
                self.optimizer.step()
        self.version += 1
        gap = (old_logprobs - exp.rollout_logprobs).abs()
        n_updates = hp.epochs * n_mini
        metrics = {k: sum(v) / n_updates for k, v in stats.items()}
        resp = mask.sum(1).float()
        seq_kl = float((kl_penalty(old_logprobs, ref_logprobs, "k1") * mask).sum(1).mean()) if b else 0.0
        if has_ref:
            self.kl_ctl.update(seq_kl, n_steps=b)
        if has_ref:
            metrics.update({
                "kl/ref_seq_k1": seq_kl,
                "kl/ref_k1": float(masked_mean(kl_penalty(old_logprobs, ref_logprobs, "k1"), mask)),
                "kl/ref_k3": float(masked_mean(kl_penalty(old_logprobs, ref_logprobs, "k3"), mask)),
            })
        metrics.update(
            {
                "kl/coef": kl_coef,
                "kl/coef_next": float(self.kl_ctl.value),
                "response/truncated": float(n_truncated),
                "learner/ref_s": t_ref,
                "learner/trainable_fraction": self.trainable_fraction,
                "policy/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                "kl/penalty_per_seq": float((kl * mask).sum(1).mean()) * kl_coef if b else 0.0,
                "logprob_gap/mean_abs": float(masked_mean(gap, mask)),
                "logprob_gap/max_abs": float(gap[mask].max()) if bool(mask.any()) else 0.0,
                **({
                    "value/mean": float(masked_mean(old_values, mask)),
                    "value/returns_mean": float(masked_mean(returns, mask)),
                    "value/explained_var": _explained_variance(old_values, returns, mask),
                } if self.use_critic else {}),
                "advantage/mean": float(masked_mean(advantages, mask)),
                "response/length_mean": float(resp.mean()) if len(resp) else 0.0,
                "learner/prep_s": t_prep,
                "learner/update_s": time.perf_counter() - t0 - t_prep,
                "learner/tokens": float(mask.sum()),
                "learner/fused_old_pass": float(fused),
                "learner/streamed_old_pass": float(streamed),
                "learner/prefix_shared_frac": self.model.rows_shared / max(self.model.rows_total, 1),
                "learner/sequences": float(b),
            }
        )
        return metrics

    # -- weights out -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def policy_weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """Policy weights in transformers (checkpoint) naming, without the value head or a tied
        lm_head copy. With LoRA the adapters are merged into the base weights for the duration of
        the context (vLLM gets plain dense weights) and unmerged after: consume them inside."""
        lm = self.model.lm
        tied = bool(getattr(lm.config, "tie_word_embeddings", False))
        if not self.lora:
            sd = lm.state_dict()
            if tied:
                sd.pop("lm_head.weight", None)
            yield sd
            return
        lm.merge_adapter()
        try:
            sd = {}
            for k, v in lm.get_base_model().state_dict().items():
                if "lora_" in k:
                    continue
                name = k.replace(".base_layer.", ".")
                if tied and name == "lm_head.weight":
                    continue
                sd[name] = v
            yield sd
        finally:
            lm.unmerge_adapter()

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of ``policy_weights()``."""
        with self.policy_weights() as sd:
            return {k: v.detach().clone() for k, v in sd.items()}

    def trainer_state(self) -> dict[str, Any]:
        return {"version": self.version, "kl_controller": self.kl_ctl.state_dict(), "lora": self.lora}

    def save(self, folder: str | Path, tokenizer_from: str | None = None) -> Path:
        """transformers-loadable safetensors folder (LoRA merged), plus the value head, the LoRA
        adapter (``adapter/``) and the trainer state (KL controller) beside it."""
        import json

        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        base = self.model.lm.get_base_model() if self.lora else self.model.lm
        with self.policy_weights() as sd:
            base.save_pretrained(str(folder), state_dict={k: v.detach().clone() for k, v in sd.items()},
                                 safe_serialization=True)
        if self.lora:
            self.model.lm.save_pretrained(str(folder / "adapter"))
        save_file({k: v.detach().contiguous() for k, v in self.model.value_head.state_dict().items()}, str(folder / "value_head.safetensors"))
        (folder / "trainer_state.json").write_text(json.dumps(self.trainer_state(), indent=1))
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
