"""Policy (+ value head) forward passes that never materialise (B, L, V) log-softmax tensors.

Per-token quantities are aligned with ``input_ids``: position t holds log p(x_t | x_<t) and the
value of the state before token t, i.e. both come from the hidden state at t-1. Only the
positions that are asked for (response tokens) go through the vocabulary-sized head, in
chunks: on SmolLM2 one fp32 copy of 16x192x49152 logits is 600 MB, and prompts are most of
each sequence.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from learners.training.attention import ATTENTION
from learners.training.logprob_kernel import fused_head_logprobs
from learners.objectives.losses import entropy_from_logits, full_kl, logprobs_from_logits


def autocast(bf16: bool, device: torch.device | str = "cpu"):
    """bf16 autocast for the device the model computes on; a no-op context when off."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def shared_weight_casts(bf16: bool, device: torch.device | str = "cpu"):
    """Casts each weight to bf16 once for all the micro-batches inside, not once per micro-batch.

    Autocast caches its cast of a weight (a leaf that needs a gradient) while any autocast region
    is open and drops the cache when the outermost one closes, so each micro-batch's own region
    alone casts every weight anew (0.38 s of a 6.4 s GRPO update of SmolLM2-135M on two CPU cores).
    An outer region with autocast *off* keeps the cache open without putting the losses or the
    backward passes under autocast. The casts must not outlive the weights they were made from:
    ``PolicyLearner._optimizer_step`` drops them after each step. Two things must not run
    inside: code that swaps weights (a target network), and a forward pass without gradients
    (autocast would cache its casts detached, and later passes would train nothing).
    """
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, enabled=False)


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The decoder layers of ``lm``: a transformers causal LM, or a PEFT model around one."""
    return (lm.get_base_model() if hasattr(lm, "get_base_model") else lm).get_decoder().layers


def compile_decoder_layers(lm: nn.Module) -> int:
    """Puts every decoder layer of ``lm`` (a transformers causal LM, or a PEFT model around one)
    under ``torch.compile(dynamic=True)``, in place, and returns how many.

    In place, so the parameters keep their names: checkpoints, weight syncs and the optimiser see
    the same tensors. Dynamic shapes from the start, because a batch's width and lengths change
    every step. The embeddings, the final norm and the log-prob head stay eager: the head is
    chunked over a data-dependent number of response positions.
    """
    layers = decoder_layers(lm)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def add_residual_dropout(lm: nn.Module, p: float) -> int:
    """Dropout with probability ``p`` on every decoder layer's attention and MLP outputs, before
    each is added to the residual stream (the residual dropout of the Transformer, Vaswani et al.
    2017, §5.4; GPT-2's ``resid_pdrop``); active in train mode under autograd only, so every
    no-grad or eval pass (old and reference log-probs, LoRA's adapter-off reference, targets,
    evaluation) sees the whole model. Llama-family models carry no dropout of their own (their ``attention_dropout``
    is read only by attention kernels this project replaces). Returns the number of layers
    hooked; raises ``ValueError`` for a model whose layers have no ``self_attn`` and ``mlp``."""
    if p <= 0:
        return 0
    layers = [layer for layer in decoder_layers(lm) if hasattr(layer, "self_attn") and hasattr(layer, "mlp")]
    if not layers:
        raise ValueError("model.dropout: this model's decoder layers have no self_attn / mlp to put dropout after")

    def drop(module: nn.Module, args: tuple, out: object) -> object:
        if not (module.training and torch.is_grad_enabled()):  # no-grad passes (old, reference) see it whole
            return out
        if isinstance(out, tuple):  # attention returns (output, weights)
            return (nn.functional.dropout(out[0], p, True), *out[1:])
        return nn.functional.dropout(out, p, True)

    for layer in layers:
        layer.self_attn.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)
    return len(layers)


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
        self.rows_shared = 0
        self.rows_total = 0
        # Every pass runs each decoder layer once (sharded weights: each run is a collective that
        # every rank must make alike), so a shared prompt never takes the two-call prompt-cache pass.
        self.one_call_per_layer = False
        # Mixture-of-experts routing (learners/training/routing.py): "none", "record" (routes
        # measured against the learner's own) or "rollout" (replayed); health summed into
        # ``router_stats`` when set, the load-balancing losses kept when ``router_aux``.
        self.routing = "none"
        self.router_stats = None
        self.router_aux = False
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        positions_mask: torch.Tensor | None = None,
        *,
        temperature: float = 1.0,
        chunk: int = 1024,
        with_values: bool = False,
        with_entropy: bool = False,
        group_ids: torch.Tensor | None = None,
        fused: bool = False,
        run: Callable[[], Any] | None = None,
        ref_states: torch.Tensor | None = None,
        ref_head: torch.Tensor | None = None,
        routes: torch.Tensor | None = None,
    ) -> Any:
        """Per-token log-probs (and values / entropy) at ``positions_mask``.

        With ``group_ids`` (B,), rows of one group that share their prefix up to the first
        ``positions_mask`` position (a prompt's samples) run that prefix once
        (``shared_prefix_hidden``); the outputs are the same.

        Args:
            input_ids: (B, L) int64.
            attention_mask: (B, L) bool.
            positions_mask: (B, L) bool, where to compute outputs (position 0 is never valid).
        Returns:
            dict with ``logprobs`` (B, L) float32, optionally ``values`` (B, L) float32 and
            ``entropy`` (B, L) float32 (detached), zero outside ``positions_mask``.

        ``ref_states`` (B, L, H) and ``ref_head`` (V, H): the frozen reference's last hidden states
        over the same rows and its LM head's weight; the output then has ``kl_full`` (B, L), the
        exact KL(policy || reference) over the vocabulary at each position (``full_kl_at_positions``).

        ``run``: instead, a learner's own computation over the modules (Q-values, a reward head),
        returned as it is. Run inside ``forward`` so that sharded weights are gathered around it
        and its gradients reduced after it, as for any pass (FSDP hooks the module's forward).

        ``routes`` (B, L, layers, k): the experts the generator routed each token to, replayed or
        measured by ``self.routing`` (``routed_hidden``).
        """
        if run is not None:
            return run()
        if self.routing != "none":
            hidden = self.routed_hidden(input_ids, attention_mask, routes)
        else:
            hidden = self.hidden(input_ids, attention_mask, positions_mask, group_ids)
        critic = getattr(self, "critic", None)
        out = heads_at_positions(
            hidden,
            input_ids,
            positions_mask,
            self.lm.get_output_embeddings(),
            self.value_head if with_values and critic is None else None,
            temperature=temperature,
            chunk=chunk,
            with_entropy=with_entropy,
            fused=fused,
        )
        if ref_states is not None:
            out["kl_full"] = full_kl_at_positions(
                hidden,
                ref_states,
                input_ids,
                positions_mask,
                self.lm.get_output_embeddings(),
                ref_head,
                temperature=temperature,
                chunk=chunk,
            )
        if with_values and critic is not None:  # a separate critic (learners/training/critic.py) values the states
            out["values"] = critic(input_ids, attention_mask, positions_mask, group_ids)
        return out

    def hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions_mask: torch.Tensor,
        group_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, L, H) last hidden states of the LM's decoder (``decoder_hidden``), counting the rows
        that shared their prefix for the learner's metrics."""
        hidden, shared = decoder_hidden(
            self.lm.get_decoder(),
            input_ids,
            attention_mask,
            positions_mask,
            group_ids,
            one_call=self.one_call_per_layer,
        )
        self.rows_shared += input_ids.shape[0] if shared else 0
        self.rows_total += input_ids.shape[0]
        return hidden

    def routed_hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, routes: torch.Tensor | None
    ) -> torch.Tensor:
        """(B, L, H) hidden states with the MoE routers replaying (or measuring) ``routes``: rows
        as they are laid out, one decoder call. A token's route decides the log-probs of the tokens
        after it, so a row's last token needs none (the engine never computes it), nor does an
        observation of a multi-turn row (``OBSERVED``, -2: routed by the learner by design)."""
        from learners.training.routing import OBSERVED, replay_routes

        counted = attention_mask.bool()
        last = counted.long().cumsum(1) == counted.long().sum(1, keepdim=True)
        if routes is None:
            needed = torch.zeros_like(counted)
        else:
            needed = counted & ~last & ~(routes == OBSERVED).any(-1).any(-1)
        replay = self.routing == "rollout"
        if self.router_stats is not None:
            self.router_stats.aux_losses.clear()  # the last pass's only (router_aux_term)
        with replay_routes(
            self.lm, routes, counted, self.router_stats, needed=needed, replay=replay, aux=self.router_aux
        ):
            hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask.long()).last_hidden_state
        self.rows_total += input_ids.shape[0]
        return hidden


def decoder_hidden(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions_mask: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    *,
    one_call: bool = False,
) -> tuple[torch.Tensor, bool]:
    """(B, L, H) last hidden states of ``decoder`` and whether rows shared their prefix.

    With ``group_ids`` (B,), rows of one group whose tokens agree up to their first
    ``positions_mask`` position run that prefix once (``shared_prefix_hidden``); the states are
    the same. Not under gradient checkpointing (it recomputes each layer from its inputs, which
    the shared pass builds once), nor when nothing can be shared: then every row runs in full.
    ``one_call``: the decoder runs once (packed tree rows or every row in full, never the prompt
    cache's two calls).
    """
    if (
        group_ids is not None
        and positions_mask is not None
        and not getattr(decoder, "is_gradient_checkpointing", False)
    ):
        hidden = shared_prefix_hidden(
            decoder, input_ids, attention_mask, positions_mask, group_ids, prompt_cache=not one_call
        )
        if hidden is not None:
            return hidden, True
    return decoder(input_ids=input_ids, attention_mask=attention_mask.long()).last_hidden_state, False


PACKED_ROW_MAX = 1024
"""Longest packed row (prefix + all its continuations, tokens) that ``shared_prefix_hidden``
runs as one tree-masked row; longer groups go through the prompt-cache pass, whose attention
is not quadratic in the number of samples."""

# Implementations that take a custom (G, 1, T, T) mask.
_PACKED_ATTENTION = ("sdpa", "eager", ATTENTION)


def shared_prefix_hidden(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    max_packed_len: int | None = None,
    prompt_cache: bool = True,
) -> torch.Tensor | None:
    """Decoder hidden states for rows that share prompts, each prompt run once per group.

    GRPO-style batches hold ``n`` samples of every prompt, and prompts are often longer than
    responses: running each prompt once removes ``(n - 1) / n`` of the prompt compute, forward
    and backward. Two equivalent ways, chosen per call:

    - **packed tree** (groups of at most ``max_packed_len`` tokens): one row per group holds the
      prompt followed by every continuation, each continuation at its true positions and
      attending to the prompt and to itself only (a tree mask). One decoder pass, no padding
      between a group's samples.
    - **prompt cache** (longer groups, or attention implementations without custom masks): the
      prompts run once, then every continuation attends to its prompt's cached keys/values
      (gradients flow back through the cache). Its attention cost grows with each row's length,
      not with the square of the whole group's.

    Args:
        input_ids, attention_mask, positions_mask: (B, L), rows right-padded; a row's prefix is
            everything before its first ``positions_mask`` position.
        group_ids: (B,) rows with one id must have identical prefixes (checked).
        max_packed_len: the packed-tree bound in tokens (default ``PACKED_ROW_MAX``).
        prompt_cache: False: None where the packed tree does not apply (the caller runs the rows in
            full), so the decoder runs exactly once.
    Returns:
        (B, L, H) hidden states where ``[:, t-1]`` predicts token ``t`` at every position of
        ``positions_mask`` (other positions are zero), or None when no two rows share a prefix,
        a row has no output position, or the check fails; callers then run rows in full.
    """
    max_packed_len = PACKED_ROW_MAX if max_packed_len is None else max_packed_len
    layout = _prefix_groups(input_ids, positions_mask, group_ids)
    if layout is None:
        return None
    inv, rep, plen = layout
    cont_len = attention_mask.sum(1) - plen
    packed_len = plen[rep] + torch.zeros_like(plen[rep]).index_add(0, inv, cont_len)
    if int(packed_len.max()) <= max_packed_len and decoder.config._attn_implementation in _PACKED_ATTENTION:
        return _packed_tree_hidden(decoder, input_ids, inv, rep, plen, cont_len)
    return _prefix_cache_hidden(decoder, input_ids, inv, rep, plen, cont_len) if prompt_cache else None


def _prefix_groups(input_ids: torch.Tensor, positions_mask: torch.Tensor, group_ids: torch.Tensor):
    """(inv (B,) group index of each row, rep (G,) one row per group, plen (B,) prefix lengths),
    or None when nothing can be shared or a group's rows disagree on their prefix."""
    b = input_ids.shape[0]
    if b < 2 or not bool(positions_mask.any(1).all()) or not bool(positions_mask[:, 0].logical_not().all()):
        return None
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    g = len(uniq)
    if g == b:
        return None
    dev = input_ids.device
    rep = torch.full((g,), b, dtype=torch.long, device=dev).scatter_reduce(
        0, inv, torch.arange(b, device=dev), reduce="amin"
    )
    plen = positions_mask.long().argmax(1)  # first output position = prefix length
    if not torch.equal(plen, plen[rep][inv]):
        return None
    pmax = int(plen.max())
    prefix_cols = torch.arange(pmax, device=dev)[None, :] < plen[:, None]
    if not bool(((input_ids[:, :pmax] == input_ids[rep][inv][:, :pmax]) | ~prefix_cols).all()):
        return None
    return inv, rep, plen


def _continuation_tokens(plen: torch.Tensor, cont_len: torch.Tensor):
    """(rows, steps) of every continuation token: row r's step k is column plen[r] + k."""
    steps = torch.arange(max(int(cont_len.max()), 1), device=plen.device)
    return (steps[None, :] < cont_len[:, None]).nonzero(as_tuple=True)


def _packed_tree_hidden(decoder, input_ids, inv, rep, plen, cont_len):
    b, length = input_ids.shape
    g, dev = len(rep), input_ids.device
    # Column where each row's continuation starts in its group's packed row: after the prompt
    # and the continuations of the group's earlier rows.
    order = torch.argsort(inv, stable=True)
    csum = torch.cumsum(cont_len[order], 0) - cont_len[order]
    first = torch.zeros(g, dtype=torch.long, device=dev).scatter_reduce(
        0, inv[order], csum, reduce="amin", include_self=False
    )
    start = torch.empty_like(plen)
    start[order] = plen[order] + csum - first[inv[order]]
    width = int((start + cont_len).max())
    ids = input_ids.new_zeros(g, width)
    pos = torch.zeros(g, width, dtype=torch.long, device=dev)
    seg = torch.full((g, width), -2, dtype=torch.long, device=dev)  # -2 padding, -1 prompt, r: row r
    pg, pc = (torch.arange(int(plen.max()), device=dev)[None, :] < plen[rep][:, None]).nonzero(as_tuple=True)
    ids[pg, pc], pos[pg, pc], seg[pg, pc] = input_ids[rep[pg], pc], pc, -1
    rows, ks = _continuation_tokens(plen, cont_len)
    gr, col = inv[rows], start[rows] + ks
    ids[gr, col], pos[gr, col], seg[gr, col] = input_ids[rows, plen[rows] + ks], plen[rows] + ks, rows
    # Tree mask: causal, and a token sees the prompt and its own continuation only. Padding
    # queries see themselves (their outputs are dropped) so no softmax row is empty.
    cols = torch.arange(width, device=dev)
    q_seg, k_seg = seg[:, :, None], seg[:, None, :]
    allowed = (cols[:, None] >= cols[None, :]) & (k_seg != -2) & ((k_seg == -1) | (k_seg == q_seg))
    allowed |= torch.eye(width, dtype=torch.bool, device=dev)
    mask = allowed[:, None]
    if decoder.config._attn_implementation == "eager":  # additive float mask
        mask = torch.zeros(mask.shape, device=dev).masked_fill(~mask, torch.finfo(torch.float32).min)
    out = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
    # Back to the (B, L) layout: the prompt's last state predicts each row's first output token.
    arange_b = torch.arange(b, device=dev)
    hidden = out.new_zeros(b, length, out.shape[-1]).index_put((arange_b, plen - 1), out[inv, plen - 1])
    return hidden.index_put((rows, plen[rows] + ks), out[gr, col])


def _prefix_cache_hidden(decoder, input_ids, inv, rep, plen, cont_len):
    b, length = input_ids.shape
    dev = input_ids.device
    pmax = int(plen.max())
    rep_mask = torch.arange(pmax, device=dev)[None, :] < plen[rep][:, None]
    # 1. Each group's prefix once, right-padded (padding keys are masked below).
    first = decoder(input_ids=input_ids[rep, :pmax], attention_mask=rep_mask.long(), use_cache=True)
    cache = first.past_key_values
    cache.batch_select_indices(inv)  # one copy of its group's keys/values per row (differentiable)
    # 2. Every row's continuation against its prefix's cache, at its true positions.
    steps = torch.arange(max(int(cont_len.max()), 1), device=dev)[None, :]
    cont_mask = steps < cont_len[:, None]
    cont_ids = torch.where(cont_mask, input_ids.gather(1, (plen[:, None] + steps).clamp(max=length - 1)), 0)
    second = decoder(
        input_ids=cont_ids,
        attention_mask=torch.cat([rep_mask[inv], cont_mask], 1).long(),
        position_ids=plen[:, None] + steps,
        past_key_values=cache,
        use_cache=True,
    )
    h_prefix, h_cont = first.last_hidden_state, second.last_hidden_state
    # 3. Back to the (B, L) layout: the prefix's last state predicts the first output token.
    arange_b = torch.arange(b, device=dev)
    hidden = h_cont.new_zeros(b, length, h_cont.shape[-1])
    hidden = hidden.index_put((arange_b, plen - 1), h_prefix[inv, plen - 1].to(h_cont.dtype))
    rows, ks = cont_mask.nonzero(as_tuple=True)
    return hidden.index_put((rows, plen[rows] + ks), h_cont[rows, ks])


def _action_states(hidden: torch.Tensor, input_ids: torch.Tensor, positions_mask: torch.Tensor):
    """(rows, cols, states (N, H), tokens (N,)) of the masked positions: hidden[:, t-1] is the
    state in which token t was produced (position 0 has none and is skipped)."""
    target_mask = positions_mask.clone()
    target_mask[:, 0] = False
    rows, cols = target_mask.nonzero(as_tuple=True)
    return rows, cols, hidden[rows, cols - 1], input_ids[rows, cols]


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
    fused: bool = False,
) -> dict[str, torch.Tensor]:
    """Applies the LM head (chunked) and value head to hidden states predicting masked tokens.

    hidden: (B, L, H) from the decoder; hidden[:, t-1] predicts input_ids[:, t].
    ``fused``: the log-probs by ``fused_head_logprobs`` (chunked in the backward pass too), for
    a bias-free LM head.
    """
    b, length = input_ids.shape
    rows, cols, h, labels = _action_states(hidden, input_ids, positions_mask)
    if fused and getattr(lm_head, "bias", None) is None:
        lp_parts, ent_parts = _fused_head(h, lm_head.weight, labels, temperature, chunk, with_entropy)
    else:
        lp_parts, ent_parts = _plain_head(h, lm_head, labels, temperature, chunk, with_entropy)
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


def full_kl_at_positions(
    hidden: torch.Tensor,
    ref_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    positions_mask: torch.Tensor,
    lm_head: nn.Module,
    ref_weight: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> torch.Tensor:
    """(B, L) ``losses.full_kl`` of the policy (``lm_head`` over ``hidden``) from the reference
    (``ref_weight`` over ``ref_hidden``, frozen) at the positions of ``positions_mask``, zero
    elsewhere; hidden[:, t-1] predicts token t in both. One chunk of vocabulary-sized rows at a
    time (never a (B, L, V) tensor); gradient through ``hidden`` and ``lm_head`` only."""
    b, length = input_ids.shape
    rows, cols, h, _ = _action_states(hidden, input_ids, positions_mask)
    h_ref = ref_hidden[rows, cols - 1].detach()
    w_ref = ref_weight.detach()
    parts = []
    for start in range(0, h.shape[0], chunk):
        ref_logits = torch.nn.functional.linear(h_ref[start : start + chunk].to(w_ref.dtype), w_ref)
        parts.append(full_kl(lm_head(h[start : start + chunk]), ref_logits, temperature))
    flat = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)
    return torch.zeros(b, length, dtype=torch.float32, device=hidden.device).index_put((rows, cols), flat)


@torch.no_grad()
def reference_states(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    micro_batch_size: int = 8,
    bf16: bool = False,
) -> torch.Tensor:
    """(B, L, H) a frozen model's last hidden states, no gradient, in micro-batches of similar
    length (zero beyond each row's length): what ``full_kl_at_positions`` reads as ``ref_hidden``."""
    out = torch.zeros(*input_ids.shape, lm.config.hidden_size, device=input_ids.device)
    for idx, width, hidden in frozen_passes(lm, input_ids, attention_mask, micro_batch_size, bf16):
        out = out.to(hidden.dtype) if out.dtype != hidden.dtype else out
        out[idx, :width] = hidden
    return out


def frozen_passes(
    lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, micro_batch_size: int, bf16: bool
) -> Iterator[tuple[torch.Tensor, int, torch.Tensor]]:
    """(rows, width, hidden (rows, width, H)) of a frozen model's decoder over micro-batches of
    similar length, each trimmed to its longest row; the consumer runs under the same autocast."""
    lengths = attention_mask.sum(1)
    for idx in torch.split(micro_batch_order(lengths), micro_batch_size):
        width = max(int(lengths[idx].max()), 1)
        with autocast(bf16, input_ids.device):
            hidden, _ = decoder_hidden(lm.get_decoder(), input_ids[idx, :width], attention_mask[idx, :width])
            yield idx, width, hidden


def _plain_head(
    h: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, temperature: float, chunk: int, with_entropy: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log-probs (and detached entropies) chunk by chunk; autograd keeps each chunk's logits."""
    lp_parts, ent_parts = [], []
    for start in range(0, h.shape[0], chunk):
        logits = lm_head(h[start : start + chunk]).float()
        if temperature != 1.0:
            logits = logits / temperature
        lp_parts.append(logprobs_from_logits(logits, labels[start : start + chunk]))
        if with_entropy:
            with torch.no_grad():
                ent_parts.append(entropy_from_logits(logits.detach()))
    return lp_parts, ent_parts


def _fused_head(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float, chunk: int, with_entropy: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``fused_head_logprobs`` in the dtype the plain LM head would run in (autocast's, if on)."""
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
    lp, ent = fused_head_logprobs(h.to(dtype), weight.to(dtype), labels, temperature, chunk, with_entropy)
    return [lp], [ent] if with_entropy else []


def q_heads_at_positions(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    positions_mask: torch.Tensor,
    lm_head: nn.Module,
    *,
    floor: float = 0.0,
    temperature: float = 1.0,
    chunk: int = 1024,
    terms: tuple[str, ...] = ("sq_dev_sum", "logprobs", "logsumexp"),
) -> dict[str, torch.Tensor]:
    """Q-learning reductions of the LM head (logits = Q(s, .)) at the actions in ``positions_mask``,
    one chunk of vocabulary-sized rows at a time (never a (B, L, V) tensor).

    hidden: (B, L, H); hidden[:, t-1] is the state s_t in which token input_ids[:, t] was taken.
    Returns (B, L) float32 tensors, zero outside the mask, with gradient where ``hidden`` has one:
    ``q`` = Q(s_t, a_t); ``sq_dev_sum`` = sum_a (Q(s_t, a) - floor)^2 (the conservative term's
    input); ``logprobs`` = log softmax(Q(s_t, .) / temperature)[a_t], the Boltzmann policy's
    log-prob (the KL anchor's input); ``logsumexp`` = log sum_a exp Q(s_t, a) (the CQL term's
    input); and, detached, ``q_mean`` = mean_a Q(s_t, a) and ``q_max``. Only the ``terms`` asked
    for are built with gradient (each keeps vocabulary-sized tensors alive until the backward).
    """
    b, length = input_ids.shape
    rows, cols, h, labels = _action_states(hidden, input_ids, positions_mask)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("q", *terms, "q_mean", "q_max")}
    for start in range(0, h.shape[0], chunk):
        logits = lm_head(h[start : start + chunk]).float()
        lab = labels[start : start + chunk]
        parts["q"].append(logits.gather(1, lab[:, None]).squeeze(1))
        if "sq_dev_sum" in terms:  # sum_a (Q - f)^2 = sum Q^2 - 2 f sum Q + V f^2: no shifted copy
            parts["sq_dev_sum"].append(
                (logits * logits).sum(1) - 2 * floor * logits.sum(1) + logits.shape[1] * floor**2
            )
        if "logprobs" in terms:
            parts["logprobs"].append(logprobs_from_logits(logits / temperature if temperature != 1.0 else logits, lab))
        if "logsumexp" in terms:
            parts["logsumexp"].append(torch.logsumexp(logits, dim=1))
        with torch.no_grad():
            parts["q_mean"].append(logits.mean(1))
            parts["q_max"].append(logits.max(1).values)
    out = {}
    for k, v in parts.items():
        flat = torch.cat(v) if v else h.new_zeros(0, dtype=torch.float32)
        out[k] = torch.zeros(b, length, dtype=torch.float32, device=hidden.device).index_put((rows, cols), flat)
    return out


@torch.no_grad()
def max_q_after_positions(
    hidden: torch.Tensor, positions_mask: torch.Tensor, lm_head: nn.Module, *, chunk: int = 1024, soft: bool = False
) -> torch.Tensor:
    """(B, L) ``max_a Q(s_{t+1}, a)``: the maximum logit at the position *of* each masked token t
    (the state after action t), chunked; zero outside ``positions_mask``. No gradient (targets).
    ``soft``: ``log sum_a exp Q(s_{t+1}, a)`` instead (the soft value of a Boltzmann policy)."""
    b, length = positions_mask.shape
    rows, cols = positions_mask.nonzero(as_tuple=True)
    h = hidden[rows, cols]
    reduce = (lambda x: torch.logsumexp(x, dim=1)) if soft else (lambda x: x.max(1).values)
    flat = [reduce(lm_head(h[s : s + chunk]).float()) for s in range(0, h.shape[0], chunk)]
    vals = torch.cat(flat) if flat else h.new_zeros(0, dtype=torch.float32)
    return torch.zeros(b, length, dtype=torch.float32, device=hidden.device).index_put((rows, cols), vals)


@torch.no_grad()
def micro_batch_order(
    lengths: torch.Tensor, group_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``rows`` (default: all) ordered for micro-batching: by length, so that trimmed
    micro-batches carry little padding, and, with ``group_ids``, by their group's longest row
    with a group's rows kept together (so they can share their prompt's forward pass).

    lengths: (B,) tokens per row; group_ids: (B,); returns a permutation of ``rows``.
    """
    rows = torch.arange(len(lengths), device=lengths.device) if rows is None else rows
    key = lengths
    if len(rows) == 0:  # e.g. every sample of a batch was dropped by a failing reward
        return rows
    if group_ids is not None:
        _, index = torch.unique(group_ids, return_inverse=True)
        key = lengths.new_zeros(int(index.max()) + 1).scatter_reduce(0, index, lengths, reduce="amax")[index]
        rows = rows[torch.argsort(group_ids[rows], stable=True)]
    return rows[torch.argsort(key[rows], stable=True)]


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
    group_ids: torch.Tensor | None = None,
    routes: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, L) log-probs of a plain causal LM at ``positions_mask``, in micro-batches (no grad).

    Rows are right-padded; micro-batches take rows of similar length and drop the columns that
    are padding in all of them, so padding costs (almost) no compute. With ``group_ids`` a
    prompt's samples stay in one micro-batch and run the prompt once (``shared_prefix_hidden``).
    ``routes`` (B, L, layers, k): a mixture of experts routes each token by them (rollout routing
    replay, ``learners/training/routing.py``; -1: its own router); rows then run in full."""
    out = torch.zeros_like(input_ids, dtype=torch.float32)
    lengths = attention_mask.sum(1)
    group_ids = None if routes is not None else group_ids
    order = micro_batch_order(lengths, group_ids)
    for s in range(0, input_ids.shape[0], micro_batch_size):
        idx = order[s : s + micro_batch_size]
        width = max(int(lengths[idx].max()), 1)
        ids = input_ids[idx, :width]
        with autocast(bf16, input_ids.device), _replaying(lm, routes, idx, width, attention_mask):
            hidden, _ = decoder_hidden(
                lm.get_decoder(),
                ids,
                attention_mask[idx, :width],
                positions_mask[idx, :width],
                None if group_ids is None else group_ids[idx],
            )
            out[idx, :width] = heads_at_positions(
                hidden,
                ids,
                positions_mask[idx, :width],
                lm.get_output_embeddings(),
                temperature=temperature,
                chunk=chunk,
            )["logprobs"]
    return out


def _replaying(lm: nn.Module, routes: torch.Tensor | None, idx: torch.Tensor, width: int, attention_mask):
    """A micro-batch's routing replay (``routing.replay_routes``), or nothing without routes."""
    if routes is None:
        return contextlib.nullcontext()
    from learners.training.routing import replay_routes

    return replay_routes(lm, routes[idx, :width], attention_mask[idx, :width].bool())


@torch.no_grad()
def reference_logit_terms(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    states_mask: torch.Tensor,
    actions_mask: torch.Tensor,
    *,
    micro_batch_size: int = 8,
    chunk: int = 1024,
    bf16: bool = False,
) -> dict[str, torch.Tensor]:
    """A frozen model's logits where calibrated Q reads them, no gradient, (B, L) float32 each,
    zero elsewhere: ``logsumexp`` = ``log sum_a exp logits(s_p, a)`` at ``states_mask`` (hidden[:,
    p] is the state after token p) and ``taken`` = the logit of token t in the state before it at
    ``actions_mask``. In micro-batches of similar length, the LM head in chunks of rows."""
    out = {k: torch.zeros_like(input_ids, dtype=torch.float32) for k in ("logsumexp", "taken")}
    head = lm.get_output_embeddings()
    for idx, width, hidden in frozen_passes(lm, input_ids, attention_mask, micro_batch_size, bf16):
        # The soft value's reduction and the Q heads' taken logit, over the frozen model.
        out["logsumexp"][idx, :width] = max_q_after_positions(
            hidden, states_mask[idx, :width], head, chunk=chunk, soft=True
        )
        out["taken"][idx, :width] = q_heads_at_positions(
            hidden, input_ids[idx, :width], actions_mask[idx, :width], head, chunk=chunk, terms=()
        )["q"]
    return out


def last_token_hidden(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions_mask: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    *,
    one_call: bool = False,
) -> tuple[torch.Tensor, bool]:
    """(B, H) hidden state of each row's last attended token: where a reward model reads the
    whole (prompt, response) sequence (InstructGPT's scalar head on the final token), and
    whether rows shared their prefix.

    input_ids, attention_mask: (B, L); padding may sit anywhere after a row's last real token.
    positions_mask, group_ids: as ``decoder_hidden`` (the responses, and the pair or group of
    each row): a preference pair's two rows then run their prompt once.
    ``one_call``: as ``decoder_hidden``.
    """
    hidden, shared = decoder_hidden(decoder, input_ids, attention_mask, positions_mask, group_ids, one_call=one_call)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (positions * attention_mask.long()).argmax(1)
    return hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last], shared
