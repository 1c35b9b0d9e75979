"""Reward-model learner: a Bradley–Terry preference model (InstructGPT, Ouyang et al. 2022, sec.
3.5) trained on preference pairs, behind the learner interface.

The reward of a (prompt, response) sequence is a linear head on the transformer's hidden state
at its last token. Batches are those of the DPO learner: two rows per ``group_ids`` value, the
higher ``scores`` row is the chosen response; the loss is ``bradley_terry_loss``, summed over a
minibatch's pairs and divided by its global pair count, so N learners take the one-learner step.

A checkpoint is a sequence-classification model folder (``<Arch>ForSequenceClassification``,
``num_labels=1``, the head saved as ``score.weight``) that ``AutoModelForSequenceClassification``
and vLLM's reward/classify runners load as they are; its training state sits in
``trainer_state/`` as for every learner. The head has no bias (the Bradley–Terry loss cannot see
one), so the transformers model and the learner give the same reward.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from learners.base import LearnerContext, TrainParams, load_model_weights
from learners.dpo import evaluate_pairs, preference_pairs
from learners.experience import Experience
from learners.objectives.preference_losses import bradley_terry_loss
from learners.training.modeling import autocast, last_token_hidden
from learners.policy import PolicyLearner
from learners.training.sharding import idle_inputs, load_full_weights

_STATS = ("loss/total", "rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected")
HEAD_NAME = "score.weight"


class RewardModelParams(Protocol):
    """The fields of ``cluster.config.RewardModelConfig`` the learner reads (documented there)."""

    margin: float
    center_coef: float
    head_init_std: float
    head_lr: float


class RewardModelLearner(PolicyLearner):
    """The policy's transformer as the reward model's trunk, its value head as the reward head."""

    name = "reward_model"
    config_section = "reward_model"
    shardable = True
    required_fields = ("scores",)

    def __init__(self, ctx: LearnerContext, train: TrainParams, hp: RewardModelParams) -> None:
        if ctx.lora is not None and ctx.lora.enabled:
            raise ValueError("reward-model training fine-tunes every weight: set lora.enabled=false")
        super().__init__(ctx, train, with_value_head=True)
        self.hp = hp
        head = self.model.value_head
        # A random head (TRL's std 1/sqrt(H+1) by default): a zero head ties every pair, so the
        # starting accuracy would read 0 instead of chance.
        gen = torch.Generator().manual_seed(ctx.seed)
        std = hp.head_init_std or 1.0 / math.sqrt(head.in_features + 1)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen, device="cpu") * std)
        head.bias.requires_grad_(False)  # stays 0: the saved head has no bias
        self._init_optimizer(
            [{"params": [head.weight], "lr": hp.head_lr or train.lr}],
            updates_per_step=train.epochs * train.num_minibatches,
        )

    def rewards(self, part: Experience) -> torch.Tensor:
        """(B,) rewards of whole sequences (prompt and response). A pair's two rows run their
        shared prompt once (``train.shared_prefix``)."""
        return self._rewards(
            part.input_ids, part.attention_mask, part.response_mask, part.group_ids if self.tr.shared_prefix else None
        )

    def _rewards(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        group_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        def run() -> torch.Tensor:
            with autocast(self.tr.bf16, self.device):
                h, shared = last_token_hidden(
                    self.model.lm.get_decoder(), input_ids, attention_mask, positions, group_ids, one_call=self.sharded
                )
            self.model.rows_shared += input_ids.shape[0] if shared else 0
            self.model.rows_total += input_ids.shape[0]
            return self.model.value_head(h.float()).squeeze(-1)

        return self.model(run=run)  # through the module's forward: sharded weights gather around it

    def idle_outputs(self) -> dict[str, torch.Tensor]:
        """An idle pass reaches what a reward pass reaches: the trunk and the reward head."""
        return {"rewards": self._rewards(*idle_inputs(self.device), None)}

    def train_step(self, batch: Experience) -> dict[str, float]:
        """One pass (``train.epochs`` x ``train.num_minibatches`` updates) over the global batch."""
        tr, comm = self.tr, self.comm
        t0 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.check_batch(batch)
        batch = self.on_device(batch)
        chosen, rejected, malformed = preference_pairs(batch.group_ids, batch.scores)
        if len(chosen) == 0:
            return {"learner/empty_batch": 1.0, "learner/pairs": 0.0, "learner/malformed_pairs": float(malformed)}
        self.model.train()
        self.model.rows_shared = self.model.rows_total = 0
        totals = torch.zeros(len(_STATS), dtype=torch.float64, device=self.device)
        grad_norms = []
        for mini, mine in self.global_minibatches(torch.arange(len(chosen), device=self.device)):
            self.optimizer.zero_grad(set_to_none=True)
            for micro in self.rank_passes(torch.split(mine, max(1, tr.micro_batch_size // 2)), grad=True):
                totals += self._micro_step(batch, chosen[micro], rejected[micro], max(len(mini), 1))
            grad_norms.append(self._optimizer_step())
        self.version += 1
        summed = comm.all_reduce_sum(totals)
        n_updates = tr.epochs * tr.num_minibatches
        metrics = {
            k: float(v) / (n_updates if k == "loss/total" else len(chosen) * tr.epochs) for k, v in zip(_STATS, summed)
        }
        metrics.update(
            {
                "learner/lr": lr,
                "learner/pairs": float(len(chosen)),
                "learner/malformed_pairs": float(malformed),
                "learner/update_s": time.perf_counter() - t0,
                "policy/grad_norm": sum(grad_norms) / len(grad_norms),
                "learner/prefix_shared_frac": self.model.rows_shared / max(self.model.rows_total, 1),
            }
        )
        return metrics

    @torch.no_grad()
    def evaluate(self, batch: Experience) -> dict[str, float]:
        """Loss, pairwise accuracy and margin on held-out pairs, under ``eval/``."""
        self.check_batch(batch)
        batch = self.on_device(batch)
        self.model.eval()
        return evaluate_pairs(
            batch,
            self.comm,
            self.tr.micro_batch_size // 2,
            _STATS,
            lambda c, r, n: self._micro_step(batch, c, r, n, grad=False),
            passes=lambda micros: self.rank_passes(micros, grad=False),
        )

    def _micro_step(
        self, batch: Experience, chosen: torch.Tensor, rejected: torch.Tensor, global_pairs: int, grad: bool = True
    ) -> torch.Tensor:
        """Forward/backward of a few pairs; returns their contribution to ``_STATS``."""
        rows = torch.stack([chosen, rejected], 1).reshape(-1)
        part = batch.select(rows).trimmed()
        r = self.rewards(part).view(-1, 2)
        r_w, r_l = r[:, 0], r[:, 1]
        loss = bradley_terry_loss(r_w, r_l, margin=self.hp.margin, center_coef=self.hp.center_coef).sum() / global_pairs
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite reward-model loss: {float(loss)}")
        if grad:
            loss.backward()
        d = (r_w - r_l).detach()
        return torch.tensor(
            [
                float(loss.detach()),
                float((d > 0).sum()),
                float(d.sum()),
                float(r_w.detach().sum()),
                float(r_l.detach().sum()),
            ],
            dtype=torch.float64,
            device=self.device,
        )

    # -- checkpoints: a sequence-classification model folder -------------------------------------
    @contextlib.contextmanager
    def policy_weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """The reward model's weights in ``<Arch>ForSequenceClassification`` naming."""
        lm = self.model.lm
        prefix = lm.base_model_prefix
        sd = {f"{prefix}.{k}": v for k, v in lm.get_decoder().state_dict().items()}
        sd[HEAD_NAME] = self.model.value_head.weight
        yield sd

    def save(self, folder: str | Path, tokenizer_from: str | None = None) -> Path:
        from safetensors.torch import save_file

        from learners.base import save_learner_state

        folder = Path(folder)
        writes = self.writes_files  # sharded: every rank gathers each tensor, rank 0 writes
        weights = self.policy_state_dict(keep=writes)
        state = self.save_trainer_state(folder)
        if not writes:
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        config = self.model.lm.config.to_dict()
        arch = type(self.model.lm).__name__.replace("ForCausalLM", "ForSequenceClassification")
        config.update(
            {
                "architectures": [arch],
                "num_labels": 1,
                "id2label": {"0": "LABEL_0"},
                "label2id": {"LABEL_0": 0},
                "problem_type": "regression",
            }
        )
        if config.get("pad_token_id") is None:  # transformers pools the last non-pad token: it needs one
            config["pad_token_id"] = config.get("eos_token_id") if isinstance(config.get("eos_token_id"), int) else 0
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            str(folder / "model.safetensors"),
            metadata={"format": "pt"},
        )
        path = save_learner_state(folder, state)
        (path.parent / "learner.json").write_text(json.dumps({"algorithm": self.name, "version": self.version}))
        if tokenizer_from:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(str(folder))
        return folder

    def restore(self, folder: str | Path) -> None:
        weights = load_model_weights(folder)
        prefix = self.model.lm.base_model_prefix + "."
        head = weights.pop(HEAD_NAME, None)
        if head is None:
            raise ValueError(f"{folder} holds no reward head ({HEAD_NAME}): not a reward-model checkpoint")
        if self.sharded:  # into the shards, by the policy module's parameter names
            full = {f"lm.{k}": v for k, v in weights.items()} | {"value_head.weight": head}
            missing, unexpected = load_full_weights(self.model, full, strict=False)
            missing = [m for m in missing if m not in ("lm.lm_head.weight", "value_head.bias")]
        else:
            trunk = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
            missing, unexpected = self.model.lm.get_decoder().load_state_dict(trunk, strict=False)
            with torch.no_grad():
                self.model.value_head.weight.copy_(head)
        if missing or unexpected:
            raise ValueError(f"{folder} does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]})")
        self.load_trainer_state(Path(folder))


def load_reward_model(folder: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """A saved reward model as ``AutoModelForSequenceClassification`` (safetensors only, no remote code)."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(
        str(folder), dtype=dtype, use_safetensors=True, trust_remote_code=False
    )


def sequence_rewards(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool]:
    """(B,) rewards of a loaded sequence-classification reward model, read at each row's last
    attended token exactly as the learner reads them (whatever the padding), and whether rows
    shared their prompt: with ``response_mask`` and ``group_ids`` (B,), rows of one group whose
    tokens agree up to their response run that prompt once (``last_token_hidden``), with the
    same rewards."""
    h, shared = last_token_hidden(model.base_model, input_ids, attention_mask, response_mask, group_ids)
    return model.score(h.to(model.score.weight.dtype)).squeeze(-1).float(), shared
