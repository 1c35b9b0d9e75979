"""A fused kernel for the LM head: per-token log-probs (and entropies) from the final hidden
states, computed in vocabulary chunks with a hand-written backward, so that no vocabulary-sized
logits tensor is kept for the backward pass. Same results as ``logprobs_from_logits`` over the
full logits (``tests/unit/test_fused_logprobs.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from learners.objectives.losses import entropy_from_logits


class _FusedHeadLogprobs(torch.autograd.Function):
    """``fused_head_logprobs``' forward and backward (see there)."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, chunk: int, with_entropy: bool
    ):
        # Matmuls run in the inputs' dtype, forward and backward alike (autocast would make the
        # forward bf16 and leave the backward to whatever state it runs under).
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return _FusedHeadLogprobs._forward(ctx, hidden, weight, labels, temperature, chunk, with_entropy)

    @staticmethod
    def _forward(
        ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, chunk: int, with_entropy: bool
    ):
        n = hidden.shape[0]
        out = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        for s in range(0, n, chunk):
            z = (hidden[s : s + chunk] @ weight.t()).float() / temperature
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk] = z.gather(-1, labels[s : s + chunk, None]).squeeze(-1) - lse[s : s + chunk]
            if with_entropy:
                ent[s : s + chunk] = entropy_from_logits(z)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_ent: Tensor):
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            return _FusedHeadLogprobs._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s : s + chunk], grad_out[s : s + chunk].float()
            # d(z_y - logsumexp z)/dz = onehot(y) - softmax(z), and dz/d(hW^T) = 1/T.
            z = (h @ weight.t()).float() / t
            dz = torch.exp(z - lse[s : s + chunk, None]).mul_(-g[:, None])
            dz.scatter_add_(-1, labels[s : s + chunk, None], g[:, None])
            dz = dz.div_(t).to(hidden.dtype)
            if grad_h is not None:
                grad_h[s : s + chunk] = dz @ weight
            if grad_w is not None:
                grad_w += (dz.t() @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def fused_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-probs of ``labels`` under ``softmax(hidden @ weight^T / T)``, computed chunk by chunk in
    the forward *and* the backward pass, never holding more than one ``(chunk, V)`` block of logits.

    The plain path (``logprobs_from_logits(lm_head(h))`` per chunk under autograd) keeps every
    chunk's fp32 logits alive until the backward pass: ``N x V x 4`` bytes, ~200 KB per token at
    V = 49,152. Here the forward keeps only ``logsumexp`` per row; the backward recomputes each
    chunk's logits and applies ``d log p_y / dz = onehot(y) - softmax(z)`` (the softmax
    cross-entropy gradient, e.g. Goodfellow et al. 2016, eq. 6.30) scaled by ``1/T``, one more
    ``N x H x V`` matmul than the plain path in exchange for the memory (the approach of Liger
    Kernel's fused linear cross-entropy and of Wijmans et al. 2024, "Cut your losses").

    Args:
        hidden: ``(N, H)`` states, each predicting one label (any float dtype; matmuls run in it).
        weight: ``(V, H)`` LM-head weight, same dtype as ``hidden`` (cast it first under bf16).
        labels: ``(N,)`` int64 token ids.
        temperature: logits are divided by it (the sampler's temperature).
        chunk: rows per block of logits.
        with_entropy: also return the entropy of each row's distribution (not differentiable).

    Returns:
        ``((N,) float32 log-probs, (N,) float32 entropies or an empty tensor)``.
    """
    return _FusedHeadLogprobs.apply(hidden, weight, labels, float(temperature), int(chunk), bool(with_entropy))
