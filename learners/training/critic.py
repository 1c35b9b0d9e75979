"""A separate critic (``ppo.critic=separate``): a value network of its own beside the policy.

Its decoder is a copy of the policy's initial model or the trunk of a reward model
(``run.algorithm=reward_model``'s checkpoint, a sequence-classification folder), with LoRA of its
own rank when the policy trains LoRA; its value head is the reward model's score head, or
orthogonally initialised (as the PaLM-style RLHF trainer does). The value of response token
``t`` is read from the hidden state before it (the state the action is taken in), at the same
positions as the policy's log-probs, so a critic initialised from a reward model values each
state as that model scores the sequence up to it.

Separate parameters mean the value loss never reaches the policy's weights, and the critic has
its own learning rate and weight decay (``learners/ppo.py`` puts it in its own optimiser group).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from learners.training.modeling import _action_states, decoder_hidden


class Critic(nn.Module):
    """A decoder and a scalar head: per-token values at the policy's log-prob positions."""

    def __init__(self, decoder: nn.Module, head: nn.Linear, pooling: str = "token") -> None:
        super().__init__()
        if pooling not in ("token", "mean"):
            raise ValueError(f"critic pooling must be 'token' or 'mean', got {pooling!r}")
        self.decoder, self.head, self.pooling = decoder, head, pooling
        # One decoder call per pass (sharded learners: every layer's run is a collective).
        self.one_call = False

    def layers(self) -> nn.ModuleList:
        """The decoder's layers (through a PEFT wrapper, with LoRA)."""
        return (self.decoder.get_base_model() if hasattr(self.decoder, "get_base_model") else self.decoder).layers

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions_mask: torch.Tensor,
        group_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, L) float32 values at ``positions_mask`` (0 elsewhere); ``group_ids`` shares prompts
        across a group's rows as the policy's pass does. ``pooling='mean'``: the value of a state
        reads the mean of the hidden states of every attended token so far (causal, so still a
        function of the state only) instead of the last one's."""
        hidden, _ = decoder_hidden(
            self.decoder, input_ids, attention_mask, positions_mask, group_ids, one_call=self.one_call
        )
        if self.pooling == "mean":
            keep = attention_mask.to(hidden.dtype).unsqueeze(-1)
            hidden = (hidden * keep).cumsum(1) / keep.cumsum(1).clamp(min=1)
        rows, cols, h, _ = _action_states(hidden, input_ids, positions_mask)
        values = self.head(h.float()).squeeze(-1).float()  # autocast runs the head in bf16
        return torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device).index_put((rows, cols), values)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: every trained tensor (with LoRA the adapter and the head)."""
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.state_dict().items() if k in names}


def build_critic(
    model_path: str,
    init_from: str = "",
    *,
    lora: Any = None,
    lora_r: int = 0,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    pooling: str = "token",
    empty: bool = False,
) -> Critic:
    """The critic from the policy's initial model (``init_from`` empty) or a reward-model folder.

    ``lora``: the policy's LoRA settings (None: the critic's decoder trains in full); the critic's
    own adapter has rank ``lora_r`` (0: the policy's). ``empty``: the initial model's decoder
    without its weights (``learners.training.sharding.load_causal_lm``), for a sharded rank that receives
    them from rank 0."""

    if init_from:
        from learners.reward_model import load_reward_model

        rm = load_reward_model(init_from)
        decoder, score = getattr(rm, rm.base_model_prefix), rm.score.weight.detach()
    else:
        from learners.training.sharding import load_causal_lm

        lm = load_causal_lm(model_path, torch.float32, empty=empty)
        decoder, score = lm.get_decoder(), None
    decoder.config.use_cache = False
    head = nn.Linear(decoder.config.hidden_size, 1)
    with torch.no_grad():
        nn.init.zeros_(head.bias)
        if score is not None:
            head.weight.copy_(score.reshape(1, -1))
        else:
            gen = torch.Generator().manual_seed(seed + 17)
            head.weight.copy_(_orthogonal((1, decoder.config.hidden_size), gen) / math.sqrt(decoder.config.hidden_size))
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        decoder = get_peft_model(
            decoder,
            LoraConfig(
                r=lora_r or lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                bias="none",
            ),
        )
    if gradient_checkpointing:
        decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return Critic(decoder, head, pooling)


def _orthogonal(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """A seeded orthogonal matrix (rows orthonormal), as ``nn.init.orthogonal_`` draws one."""
    a = torch.randn(shape[1], shape[0], generator=gen)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))
    return q.T.contiguous()
