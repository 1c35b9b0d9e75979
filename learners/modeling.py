"""Policy (+ value head) forward passes that never materialise (B, L, V) log-softmax tensors.

Per-token quantities are aligned with ``input_ids``: position t holds log p(x_t | x_<t) and the
value of the state before token t, i.e. both come from the hidden state at t-1. Only the
positions that are asked for (response tokens) go through the vocabulary-sized head, in
chunks: on SmolLM2 one fp32 copy of 16x192x49152 logits is 600 MB, and prompts are most of
each sequence.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from learners.losses import entropy_from_logits, logprobs_from_logits


def autocast(bf16: bool):
    """bf16 autocast on CPU or GPU; a no-op context when off."""
    if not bf16:
        return contextlib.nullcontext()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


class PolicyWithValueHead(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state (shared trunk).

    Sharing the trunk halves the forward/backward cost against a separate critic model, which
    is what decides the step time on a CPU; the value head has its own learning rate.
    """

    def __init__(self, lm: nn.Module, with_value_head: bool = True) -> None:
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1) if with_value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        chunk: int = 1024,
        with_values: bool = False,
        with_entropy: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Per-token log-probs (and values / entropy) at ``positions_mask``.

        Args:
            input_ids: (B, L) int64.
            attention_mask: (B, L) bool.
            positions_mask: (B, L) bool, where to compute outputs (position 0 is never valid).
        Returns:
            dict with ``logprobs`` (B, L) float32, optionally ``values`` (B, L) float32 and
            ``entropy`` (B, L) float32 (detached), zero outside ``positions_mask``.
        """
        decoder = self.lm.get_decoder()
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask.long()).last_hidden_state
        return heads_at_positions(
            hidden, input_ids, positions_mask, self.lm.get_output_embeddings(),
            self.value_head if with_values else None,
            temperature=temperature, chunk=chunk, with_entropy=with_entropy,
        )


def heads_at_positions(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    positions_mask: torch.Tensor,
    lm_head: nn.Module,
    value_head: nn.Module | None = None,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
) -> dict[str, torch.Tensor]:
    """Applies the LM head (chunked) and value head to hidden states predicting masked tokens.

    hidden: (B, L, H) from the decoder; hidden[:, t-1] predicts input_ids[:, t].
    """
    b, length = input_ids.shape
    target_mask = positions_mask.clone()
    target_mask[:, 0] = False
    rows, cols = target_mask.nonzero(as_tuple=True)
    h = hidden[rows, cols - 1]  # (N, H)
    labels = input_ids[rows, cols]
    lp_parts, ent_parts = [], []
    for start in range(0, h.shape[0], chunk):
        logits = lm_head(h[start : start + chunk]).float()
        if temperature != 1.0:
            logits = logits / temperature
        lp_parts.append(logprobs_from_logits(logits, labels[start : start + chunk]))
        if with_entropy:
            with torch.no_grad():
                ent_parts.append(entropy_from_logits(logits.detach()))
    out: dict[str, torch.Tensor] = {}
    flat = torch.cat(lp_parts) if lp_parts else h.new_zeros(0, dtype=torch.float32)
    logprobs = torch.zeros(b, length, dtype=torch.float32, device=hidden.device)
    out["logprobs"] = logprobs.index_put((rows, cols), flat)
    if with_entropy:
        ent = torch.cat(ent_parts) if ent_parts else flat.new_zeros(0)
        out["entropy"] = torch.zeros_like(logprobs).index_put((rows, cols), ent)
    if value_head is not None:
        v = value_head(h.float() if value_head.weight.dtype == torch.float32 else h).squeeze(-1).float()
        out["values"] = torch.zeros_like(logprobs).index_put((rows, cols), v)
    return out


@torch.no_grad()
def sequence_logprobs(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    micro_batch_size: int = 8,
    chunk: int = 1024,
    bf16: bool = False,
) -> torch.Tensor:
    """(B, L) log-probs of a plain causal LM at ``positions_mask``, in micro-batches (no grad).

    Rows are right-padded; micro-batches take rows of similar length and drop the columns that
    are padding in all of them, so padding costs (almost) no compute."""
    out = torch.zeros_like(input_ids, dtype=torch.float32)
    lengths = attention_mask.sum(1)
    order = torch.argsort(lengths, stable=True)
    for s in range(0, input_ids.shape[0], micro_batch_size):
        idx = order[s : s + micro_batch_size]
        width = max(int(lengths[idx].max()), 1)
        ids = input_ids[idx, :width]
        with autocast(bf16):
            hidden = lm.get_decoder()(input_ids=ids, attention_mask=attention_mask[idx, :width].long()).last_hidden_state
            out[idx, :width] = heads_at_positions(
                hidden, ids, positions_mask[idx, :width], lm.get_output_embeddings(),
                temperature=temperature, chunk=chunk,
            )["logprobs"]
    return out
