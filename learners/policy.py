"""What every learner that trains a causal-LM policy shares: loading it (full or LoRA), the
optimiser step over data-parallel ranks, weights for the generators, and the checkpoint folder.

Algorithms (``learners/ppo.py``, ``learners/dpo.py``, ...) subclass ``PolicyLearner`` and add
their loss, their extra modules (``extra_param_groups``) and their own state
(``algorithm_state``); the checkpoint layout is described in ``learners/base.py``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator

import torch

from learners.base import (
    ADAPTER_DIR,
    TRAINER_STATE_DIR,
    Learner,
    LearnerContext,
    TrainParams,
    load_learner_state,
    load_model_weights,
    save_learner_state,
)
from learners.training.distributed import Collective
from learners.experience import Experience
from learners.training.lora_sync import model_name
from learners.training.modeling import (
    PolicyWithValueHead,
    add_residual_dropout,
    compile_decoder_layers,
    decoder_layers,
    sequence_logprobs,
    reference_logit_terms,
    reference_states,
)
from learners.training.optim import make_scheduler
from learners.training.precision import resolve_bf16
from learners.training.sharding import (
    aligned_passes,
    full_tensor,
    idle_inputs,
    load_causal_lm,
    load_full_weights,
    load_optimizer_shards,
    receive_weights_from_rank0,
    save_optimizer_shards,
    shard_group_rank,
    shard_group_size,
    shard_policy,
    whole,
    zero_loss,
)

log = logging.getLogger(__name__)

# Under trainer_state/: a sharded learner's optimiser state, each rank's shards (learners/training/sharding.py).
OPTIMIZER_SHARDS_DIR = "optimizer"

# Device types with PyTorch's fused AdamW kernel.
_FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def _with_resolved_bf16(train: TrainParams, device: str) -> TrainParams:
    """``train`` with ``bf16: auto`` decided for this learner's device (a copy; explicit values kept)."""
    if isinstance(train.bf16, bool):
        return train
    resolved = copy.copy(train)
    resolved.bf16 = resolve_bf16(train.bf16, device)
    log.info(
        "train.bf16=%s on %s: %s",
        train.bf16,
        device,
        "bf16 autocast" if resolved.bf16 else "fp32 (no native bf16 on this device)",
    )
    return resolved


class PolicyLearner(Learner):
    """A causal LM policy (``self.model.lm``) with an AdamW optimiser and an LR schedule."""

    #: Whether the learner runs with ``train.sharding: fsdp``: every pass through ``self.model``'s
    #: forward or aligned with ``rank_passes`` / ``aligned``, weights read through ``policy_weights``.
    shardable: ClassVar[bool] = False

    def __init__(self, ctx: LearnerContext, train: TrainParams, *, with_value_head: bool) -> None:
        torch.manual_seed(ctx.seed)
        self.ctx, self.tr = ctx, _with_resolved_bf16(train, ctx.device)
        self.comm = ctx.comm or Collective()
        # Sharded (learners/training/sharding.py): each rank holds 1/N of the weights, gradients and
        # optimiser state, and every pass, weight read and save is a collective of all ranks.
        self.sharded = getattr(train, "sharding", "replicated") == "fsdp"
        # Sharded ranks other than 0 build the model without its weights, rank 0 sends them.
        self.from_rank0 = self.sharded and shard_group_size() > 1
        lm = load_causal_lm(ctx.model_path, torch.float32, empty=self.from_rank0 and shard_group_rank() != 0)
        if self.from_rank0:
            torch.manual_seed(ctx.seed)  # the ranks' random streams alike whichever way they loaded
        lm.config.use_cache = False
        add_residual_dropout(lm, ctx.dropout)
        lora = ctx.lora
        self.lora = bool(lora is not None and lora.enabled)
        if self.lora:
            from peft import LoraConfig, get_peft_model

            lm = get_peft_model(
                lm,
                LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules),
                    target_parameters=list(getattr(lora, "target_parameters", None) or []) or None,
                    task_type="CAUSAL_LM",
                    bias="none",
                ),
            )
        if train.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if train.compile:
            compile_decoder_layers(lm)
        self.device = torch.device(ctx.device)
        self.model = PolicyWithValueHead(lm, with_value_head=with_value_head)
        if not any(p.is_meta for p in self.model.parameters()):  # empty ones get their device when sharded
            self.model.to(self.device)
        # Sharded: each layer's run is a collective every rank must make alike, whatever its rows.
        self.model.one_call_per_layer = self.sharded
        self._set_up_routing(train)
        self.version = 0
        # Called with the trainable parameters once their gradients are global, before clipping
        # and the optimiser step (tests compare gradients here).
        self.on_gradients = None
        # train.reference=learners without LoRA: a frozen copy of the initial model, built at its
        # first use (``base_logprobs``).
        self._reference_model = None
        # Its LM head's weight, whole, for the exact KL over the vocabulary (``base_head_weight``).
        self._base_head = None

    def _set_up_routing(self, train: TrainParams) -> None:
        """MoE routing replay and router health (``train.routing_replay``, ``router_aux_loss``)."""
        from learners.training.routing import RouterStats, routers

        mode = getattr(train, "routing_replay", "none")
        moe = bool(routers(self.model.lm))
        if mode != "none" and not moe:
            raise ValueError(
                f"train.routing_replay={mode} needs a mixture-of-experts model; {self.ctx.model_path} has no router"
            )
        if mode != "none" and train.gradient_checkpointing:
            raise ValueError(
                "train.routing_replay does not combine with train.gradient_checkpointing (recomputed routers)"
            )
        self.model.routing = mode
        self.model.router_stats = RouterStats() if mode != "none" else None
        self.model.router_aux = bool(getattr(train, "router_aux_loss", False)) and mode != "none"

    def router_aux_term(self, share: float) -> torch.Tensor | float:
        """With ``train.router_aux_loss``: the last pass's load-balancing loss (mean over the MoE
        layers) times the model's ``router_aux_loss_coef`` and this micro-batch's ``share`` of the
        minibatch; else 0."""
        stats = self.model.router_stats
        if not self.model.router_aux or stats is None or not stats.aux_losses:
            return 0.0
        coef = float(getattr(self.model.lm.config, "router_aux_loss_coef", 0.0) or 0.0)
        return coef * share * torch.stack(stats.aux_losses).mean()

    def router_metrics(self) -> dict[str, float]:
        """This step's router health over every rank's rows (``RouterStats.metrics``), then a
        fresh count. Every rank calls it at the same point (a collective with several)."""
        from learners.training.routing import RouterStats, routers

        stats = self.model.router_stats
        if stats is None:
            return {}
        self.model.router_stats = RouterStats()
        if self.comm.world > 1:  # every rank's rows: the same numbers as one learner over the batch
            found = routers(self.model.lm)
            stats = stats.summed(self.comm.all_reduce_sum, len(found), int(found[0].weight.shape[0]))
        return stats.metrics()

    @contextlib.contextmanager
    def uncounted_routing(self):
        """Within the block the router health counts nothing: a sharded rank's idle passes."""
        stats, self.model.router_stats = self.model.router_stats, None
        try:
            yield
        finally:
            self.model.router_stats = stats

    @property
    def reference_in_learner(self) -> bool:
        """Whether the learner computes reference log-probs itself (LoRA: its adapter disabled;
        ``train.reference=learners``: its own frozen copy)."""
        return self.lora or getattr(self.tr, "reference", "actor") == "learners"

    def _frozen_reference(self) -> PolicyWithValueHead:
        """The initial model, frozen, beside the policy; sharded like it (every rank builds it)."""
        if self._reference_model is None:
            # Frozen: no fp32 master copy needed; with bf16 compute its weights are bf16 (half the
            # memory), as the Reference actor's are.
            dtype = torch.bfloat16 if self.tr.bf16 is True else torch.float32
            empty = self.from_rank0 and shard_group_rank() != 0
            lm = load_causal_lm(self.ctx.model_path, dtype, empty=empty)
            lm.config.use_cache = False
            lm.requires_grad_(False)
            ref = PolicyWithValueHead(lm.eval(), with_value_head=False)
            if not empty:
                ref.to(self.device)
            ref.one_call_per_layer = self.sharded
            if self.sharded:
                self._shard_module(ref, list(decoder_layers(lm)))
            self._reference_model = ref
        return self._reference_model

    def _init_optimizer(self, extra_param_groups: list[dict[str, Any]] = (), updates_per_step: int = 1) -> None:
        """AdamW over the policy's trainable parameters (LoRA: the adapters) plus any extra groups
        (e.g. a value head with its own learning rate), and the configured LR schedule."""
        tr = self.tr
        if self.sharded:  # before the optimiser: sharding replaces the parameters
            extra_param_groups = self._shard(extra_param_groups)
        extra_ids = {id(p) for g in extra_param_groups for p in g["params"]}
        lm_params = list(self.model.lm.parameters())
        policy_params = [p for p in lm_params if p.requires_grad and id(p) not in extra_ids]
        self.trainable_fraction = sum(p.numel() for p in policy_params) / sum(p.numel() for p in lm_params)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [{"params": policy_params, "lr": tr.lr}, *extra_param_groups],
            weight_decay=tr.weight_decay,
            betas=tuple(tr.adam_betas),
            # The same update as one fused kernel over all parameters. On CPU tensors PyTorch
            # otherwise loops tensor by tensor: for SmolLM2-135M 0.16-0.21 s against 0.06-0.07 s a
            # step (0.41-0.49 s against 0.04 s without cluster.keep_freed_memory).
            fused=self.device.type in _FUSED_ADAMW_DEVICES or None,
        )
        self.scheduler = make_scheduler(
            self.optimizer,
            schedule=tr.lr_schedule,
            warmup_steps=tr.warmup_steps,
            total_steps=self.ctx.total_steps * updates_per_step,
            min_ratio=tr.min_lr_ratio,
        )

    def _shard(self, extra_param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Shards the policy in place; the extra groups' parameters by name, as they are after it."""
        if not self.shardable:
            raise ValueError(f"train.sharding=fsdp is not built for the {self.name} learner yet")
        if self.lora:
            from learners.training.lora_sync import unsupported_adapters

            unsupported = unsupported_adapters(self.model.lm)
            if getattr(self.ctx.lora, "target_parameters", None):
                raise ValueError(
                    "train.sharding=fsdp with lora.target_parameters (LoRA on fused expert tensors) is not built yet: "
                    "adapt the attention (lora.target_modules) or train replicated"
                )
            if unsupported:  # _merged_shards merges s B A shard by shard: linear adapters only
                raise ValueError(
                    f"train.sharding=fsdp with LoRA adapts linear layers only, not {unsupported[:3]} "
                    "(lora.target_modules)"
                )
        names = {id(p): n for n, p in self.model.named_parameters()}
        wanted = [[names[id(p)] for p in g["params"]] for g in extra_param_groups]
        layers = list(decoder_layers(self.model.lm))
        critic = getattr(self.model, "critic", None)
        if critic is not None:  # a separate critic's layers are units too; its embeddings join the root's
            critic.one_call = True
            layers += list(critic.layers())
        self._shard_module(self.model, layers)
        # FSDP sets its units up on the first pass through the root, which must be a training pass
        # (one without gradients leaves the root's backward unhooked) and must come before any
        # pass that enters the LM directly (the reference with LoRA off, the sync probe).
        self.idle_passes(1, grad=True)
        self.model.zero_grad(set_to_none=True)
        params = dict(self.model.named_parameters())
        return [{**g, "params": [params[n] for n in ns]} for g, ns in zip(extra_param_groups, wanted)]

    def _shard_module(self, root: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
        """``shard_policy`` with this learner's precision and offload: weights gathered in bf16
        where it computes bf16 (the fp32 shards stay the master copy), host-memory shards with
        ``train.cpu_offload``; then, over several ranks, rank 0's weights into everyone's shards
        (the other ranks built ``root`` empty: ``load_causal_lm``)."""
        weights = root.state_dict() if self.from_rank0 and shard_group_rank() == 0 else {}
        shard_policy(
            root,
            layers,
            param_dtype=torch.bfloat16 if self.tr.bf16 is True else None,
            offload=bool(getattr(self.tr, "cpu_offload", False)),
        )
        if self.from_rank0:
            receive_weights_from_rank0(root, weights, self.device)

    def aligned(self, n: int) -> int:
        """How many passes this rank runs when it has ``n`` of its own: ``n``, or with sharded
        weights the most any rank has (the rest are ``idle_pass``es)."""
        return aligned_passes(self.comm, n) if self.sharded else n

    def rank_passes(self, micros: Iterable[torch.Tensor], *, grad: bool) -> Iterator[torch.Tensor]:
        """This rank's non-empty micro-batches (index tensors), then, with sharded weights, the
        idle passes that bring it to the most any rank runs (each pass is a collective there)."""
        micros = [m for m in micros if len(m)]
        idle = self.aligned(len(micros)) - len(micros)  # agreed before any pass
        yield from micros
        self.idle_passes(idle, grad=grad)

    def idle_outputs(self) -> dict[str, torch.Tensor]:
        """The outputs of a pass over a two-token row, reaching what a training pass reaches."""
        with self.uncounted_routing():
            return self.model(*idle_inputs(self.device), chunk=self.tr.logprob_chunk)

    def idle_passes(self, n: int, *, grad: bool) -> None:
        """``n`` passes whose loss is 0 (``learners/training/sharding.py``)."""
        for _ in range(n):
            with torch.set_grad_enabled(grad):
                out = self.idle_outputs()
                if grad:
                    zero_loss(out).backward()

    @property
    def writes_files(self) -> bool:
        """Whether this rank writes checkpoints (sharded learners save on every rank, rank 0 writes)."""
        return not self.sharded or self.comm.rank == 0

    def on_device(self, batch: Experience) -> Experience:
        """``batch`` on the learner's device (records travel and arrive on the CPU)."""
        return batch.to(self.device)

    def global_minibatches(self, items: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(global minibatch, this rank's share) for every update of a step: each epoch shuffles
        ``items`` with a generator of (seed, version, epoch) only, cuts ``train.num_minibatches``
        global minibatches and gives each rank every ``world``-th item, so any number of ranks
        takes the one-rank step."""
        for epoch in range(self.tr.epochs):
            gen = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + self.version * 1009 + epoch)
            order = items[torch.randperm(len(items), generator=gen, device="cpu").to(items.device)]
            for mini in torch.tensor_split(order, self.tr.num_minibatches):
                yield mini, mini[self.comm.rank :: self.comm.world]

    def _optimizer_step(self) -> float:
        """Sums the local gradients across ranks (each rank's loss is already normalised by the
        global count), clips, steps the optimiser and the schedule; returns the gradient norm."""
        if not self.sharded:  # sharded gradients were summed shard by shard in the backward pass
            self.comm.sum_gradients(self.trainable)
        if self.on_gradients is not None:
            self.on_gradients(self.trainable)
        # Networks trained side by side (a separate critic) are clipped each on its own norm, so one
        # network's large gradients never shrink the other's step; the first group's norm is reported.
        groups = getattr(self, "clip_groups", None) or [self.trainable]
        norms = [
            torch.nn.utils.clip_grad_norm_([p for p in g if p.grad is not None], self.tr.max_grad_norm) for g in groups
        ]
        norm = norms[0]
        self.optimizer.step()
        # bf16 casts of the old weights (learners.training.modeling.shared_weight_casts) are stale now.
        torch.clear_autocast_cache()
        self.scheduler.step()
        return float(norm)

    @torch.no_grad()
    def base_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        group_ids: torch.Tensor | None,
        temperature: float = 1.0,
        routes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, L) log-probs of the frozen initial model: the LoRA policy with its adapter disabled
        (no second copy of the weights), or with ``train.reference=learners`` the learner's own
        frozen copy. Sharded ranks run aligned passes. ``routes``: replayed (MoE, as the policy's
        passes replay them)."""

        def logprobs(lm, ids, att, pos, groups, routes=None):
            return sequence_logprobs(
                lm,
                ids,
                att,
                pos,
                temperature=temperature,
                micro_batch_size=self.tr.micro_batch_size,
                chunk=self.tr.logprob_chunk,
                bf16=self.tr.bf16,
                # Sharded: every row in full, so each pass is one decoder call on every rank.
                group_ids=groups if self.tr.shared_prefix and not self.sharded else None,
                routes=routes,
            )

        return self._base_passes(logprobs, input_ids, attention_mask, positions, group_ids, routes=routes)

    @torch.no_grad()
    def base_logit_terms(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, states: torch.Tensor, actions: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The frozen initial model's log-normaliser at ``states`` and its logit of each taken
        token at ``actions`` (``modeling.reference_logit_terms``), from the same model as
        ``base_logprobs``."""

        def terms(lm, ids, att, pos, groups, acts):
            return reference_logit_terms(
                lm,
                ids,
                att,
                pos,
                acts,
                micro_batch_size=self.tr.micro_batch_size,
                chunk=self.tr.logprob_chunk,
                bf16=self.tr.bf16,
            )

        return self._base_passes(terms, input_ids, attention_mask, states, None, actions)

    @torch.no_grad()
    def base_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, L, H) the frozen initial model's last hidden states (``modeling.reference_states``),
        from the same model as ``base_logprobs``: with its LM head weight (``base_head_weight``)
        they give its whole next-token distribution wherever the policy's is needed."""

        def states(lm, ids, att, pos, groups):
            return reference_states(lm, ids, att, micro_batch_size=self.tr.micro_batch_size, bf16=self.tr.bf16)

        return self._base_passes(states, input_ids, attention_mask, attention_mask, None)

    @torch.no_grad()
    def base_head_weight(self) -> torch.Tensor:
        """(V, H) the frozen initial model's LM head weight, whole: the LoRA policy's base head (it
        never trains), or the frozen copy's. Sharded ranks gather it once (a collective) and keep
        their copy; unsharded, it is the frozen tensor itself."""
        if self._base_head is None:
            if not self.reference_in_learner:
                raise RuntimeError("the reference's LM head in the learner: needs LoRA or train.reference=learners")
            root = self.model if self.lora else self._frozen_reference()
            off = self.model.lm.disable_adapter() if self.lora else contextlib.nullcontext()
            with off, whole(root):
                weight = root.lm.get_output_embeddings().weight.detach()
                self._base_head = weight.clone() if self.sharded else weight
        return self._base_head

    def _base_passes(
        self,
        fn,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        group_ids: torch.Tensor | None,
        *masks: torch.Tensor,
        routes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``fn(lm, ids, att, positions, group_ids, *masks)`` on the frozen initial model, one pass
        per micro-batch; sharded ranks then run idle passes up to the most any rank runs (on a
        two-token row, its positions standing in for every mask). ``routes``: passed to ``fn``
        (as ``routes=``) for the rows, never for the idle passes, which route by themselves."""
        if not self.reference_in_learner:
            raise RuntimeError(
                "reference log-probs in the learner: needs LoRA or train.reference=learners "
                "(else a Reference actor serves them)"
            )
        if self.lora:
            root, off = self.model, self.model.lm.disable_adapter()
        else:
            root, off = self._frozen_reference(), contextlib.nullcontext()
        passes = -(-input_ids.shape[0] // self.tr.micro_batch_size)
        idle = self.aligned(passes) - passes
        with off, whole(root):
            extra = {} if routes is None else {"routes": routes}
            out = fn(root.lm, input_ids, attention_mask, positions, group_ids, *masks, **extra)  # no rows: empty
            for _ in range(idle):
                ids, att, pos = idle_inputs(self.device)
                fn(root.lm, ids, att, pos, None, *(pos for _ in masks))
        return out

    # -- weights out -----------------------------------------------------------------------------
    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The policy's log-prob of each token of ``token_ids`` after the first (eval mode, no
        temperature): what a generator holding the same weights answers to the same probe."""
        lm = self.model.lm
        was_training = lm.training
        lm.eval()
        try:
            ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
            positions = torch.ones_like(ids, dtype=torch.bool)
            positions[0, 0] = False
            with whole(self.model):
                lp = sequence_logprobs(lm, ids, torch.ones_like(positions), positions, chunk=self.tr.logprob_chunk)
        finally:
            lm.train(was_training)
        return lp[0, 1:].tolist()

    @contextlib.contextmanager
    def policy_weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """Policy weights in transformers checkpoint naming (``_training_weights``, fused experts
        split per expert: ``learners/training/expert_layout.py``); consume them inside."""
        from learners.training.expert_layout import checkpoint_layout

        with self._training_weights() as sd:
            yield checkpoint_layout(sd)

    @contextlib.contextmanager
    def _training_weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """Policy weights in transformers naming (fused experts as trained), without extra heads or a tied
        lm_head copy. With LoRA the adapters are merged into the base weights for the duration of
        the context (vLLM gets plain dense weights) and unmerged after: consume them inside.
        Sharded learners yield their shards: every rank reads each tensor with ``full_tensor``."""
        lm = self.model.lm
        tied = bool(getattr(lm.config, "tie_word_embeddings", False))
        if not self.lora:
            sd = lm.state_dict()
            if tied:
                sd.pop("lm_head.weight", None)
            yield sd
            return
        if self.sharded:
            yield self._merged_shards(tied)
            return
        lm.merge_adapter()
        try:
            sd = {}
            for k, v in lm.get_base_model().state_dict().items():
                if "lora_" in k:
                    continue
                name = model_name(k)
                if tied and name == "lm_head.weight":
                    continue
                sd[name] = v
            yield sd
        finally:
            lm.unmerge_adapter()

    @contextlib.contextmanager
    def sync_weights(self, adapter: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """What a weight sync sends the generators: ``policy_weights()``, or with LoRA and
        ``adapter`` only the adapters' factors, which the generators merge into their base weights
        (``learners/training/lora_sync.py``). Sharded: shards, read with ``full_tensor`` on every rank."""
        if adapter and self.lora:
            from learners.training.lora_sync import adapter_factors, unsupported_adapters

            unsupported = unsupported_adapters(self.model.lm)
            if not unsupported:
                yield adapter_factors(self.model.lm)
                return
            if not getattr(self, "_warned_merged_sync", False):  # once per learner
                log.warning(
                    "lora.sync=adapter: the adapters of %s are not plain linear LoRA; syncing merged weights instead",
                    unsupported[:3],
                )
                self._warned_merged_sync = True
        with self.policy_weights() as sd:
            yield sd

    def _merged_shards(self, tied: bool) -> dict[str, torch.Tensor]:
        """Sharded LoRA: every weight in checkpoint naming, the adapted ones merged shard by shard
        (``W + s B A`` on this rank's rows of W and B; A, r x in, is gathered whole). The base
        weights stay unmerged: nothing is undone after."""
        from peft.tuners.lora import LoraLayer
        from torch.distributed.tensor import DTensor

        base = self.model.lm.get_base_model()
        adapter = self.model.lm.active_adapter
        merged = {}
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and adapter in module.lora_A:
                w = module.base_layer.weight
                a = full_tensor(module.lora_A[adapter].weight)
                b = module.lora_B[adapter].weight
                local = w.to_local() + (b.to_local() @ a) * module.scaling[adapter]
                merged[f"{name}.weight"] = DTensor.from_local(
                    local, w.device_mesh, w.placements, shape=w.shape, stride=w.stride()
                )
        sd = {}
        for k, v in base.state_dict().items():
            name = model_name(k)
            if "lora_" in k or (tied and name == "lm_head.weight"):
                continue
            sd[name] = merged.get(name, v)
        return sd

    def policy_state_dict(self, keep: bool = True, adapter: bool = False) -> dict[str, torch.Tensor]:
        """A detached copy of ``sync_weights(adapter)`` (by default ``policy_weights()``), on the
        CPU (sharded: gathered on every rank). ``keep=False``: a sharded rank's part in the gathers
        only, holding none of it ({})."""
        with self.sync_weights(adapter) as sd:
            if not keep:
                for v in sd.values():
                    full_tensor(v)
                return {}
            return {k: full_tensor(v).detach().to("cpu", copy=True) for k, v in sd.items()}

    # -- checkpoints -----------------------------------------------------------------------------
    def algorithm_state(self) -> dict[str, Any]:
        """The algorithm's own resumable state (controllers, counters); JSON-able summary too."""
        return {}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        del state

    def save_extra(self, folder: Path) -> None:
        """Writes extra modules (e.g. ``critic/``) into their subfolder of a checkpoint."""

    def restore_extra(self, folder: Path) -> None:
        """Loads what ``save_extra`` wrote."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.name,
            "version": self.version,
            # Sharded: in files of its own, each rank's shards (``save_trainer_state``).
            "optimizer": None if self.sharded else self.optimizer.state_dict(),
            "sharded": self.sharded,
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            **({"cuda_rng": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}),
            "lora": self.lora,
            **self.algorithm_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("algorithm", self.name) != self.name:
            raise ValueError(f"checkpoint was written by the {state['algorithm']} learner, not {self.name}")
        if bool(state.get("lora")) != self.lora:
            raise ValueError(f"checkpoint was trained with lora={state.get('lora')}, this learner has lora={self.lora}")
        if bool(state.get("sharded")) != self.sharded:
            raise ValueError(
                f"checkpoint was trained with train.sharding={'fsdp' if state.get('sharded') else 'replicated'}"
                f", this learner has train.sharding={'fsdp' if self.sharded else 'replicated'}"
            )
        self.version = int(state["version"])
        if not self.sharded:  # (sharded: ``load_trainer_state`` loaded the shards)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.load_algorithm_state(state)

    def save_trainer_state(self, folder: Path) -> dict[str, Any]:
        """``state_dict()``, and with sharded weights every rank's optimiser shards written into
        ``trainer_state/optimizer/`` (a collective: every rank calls it, at the same point)."""
        state = self.state_dict()
        if self.sharded:
            save_optimizer_shards(self.model, self.optimizer, folder / TRAINER_STATE_DIR / OPTIMIZER_SHARDS_DIR)
        return state

    def load_trainer_state(self, folder: Path) -> None:
        """What ``save_trainer_state`` saved (the shards on any number of ranks)."""
        state = load_learner_state(folder)
        if self.sharded and state.get("sharded"):
            load_optimizer_shards(self.model, self.optimizer, folder / TRAINER_STATE_DIR / OPTIMIZER_SHARDS_DIR)
        self.load_state_dict(state)

    def save(self, folder: str | Path, tokenizer_from: str | None = None) -> Path:
        """A model folder (LoRA merged) that transformers and vLLM load as it is; the adapter in
        ``adapter/``, extra modules in their subfolders, the training state in ``trainer_state/``."""
        folder = Path(folder)
        writes = self.writes_files
        if writes:
            folder.mkdir(parents=True, exist_ok=True)
        base = self.model.lm.get_base_model() if self.lora else self.model.lm
        weights = self.policy_state_dict(keep=writes)
        # The adapter's own tensors (sharded: gathered; None: peft reads its model's own).
        adapter = (
            {k: full_tensor(v) for k, v in self.model.lm.state_dict().items() if "lora_" in k}
            if self.lora and self.sharded
            else None
        )
        state = self.save_trainer_state(folder)
        self.save_extra(folder)  # sharded: gathers on every rank, writes on rank 0
        if not writes:
            return folder
        base.save_pretrained(str(folder), state_dict=weights, safe_serialization=True)
        if self.lora:
            self.model.lm.save_pretrained(str(folder / ADAPTER_DIR), state_dict=adapter)
        path = save_learner_state(folder, state)
        summary = {"algorithm": self.name, "version": self.version, "lora": self.lora}
        summary.update({k: v for k, v in self.algorithm_state().items() if _jsonable(v)})
        (path.parent / "learner.json").write_text(json.dumps(summary, indent=1))
        if tokenizer_from:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(str(folder))
        return folder

    def restore(self, folder: str | Path) -> None:
        from safetensors.torch import load_file

        folder = Path(folder)
        if self.lora:
            from peft import set_peft_model_state_dict

            adapter = load_file(str(folder / ADAPTER_DIR / "adapter_model.safetensors"))
            if self.sharded:
                self._restore_sharded_adapter(folder, adapter)
            else:
                result = set_peft_model_state_dict(self.model.lm, adapter)
                if getattr(result, "unexpected_keys", None):
                    raise ValueError(f"adapter in {folder} does not fit this model: {result.unexpected_keys[:3]}")
        elif self.sharded:
            weights = {f"lm.{k}": v for k, v in self._checkpoint_weights(folder).items()}
            missing, unexpected = load_full_weights(self.model, weights, strict=False)
            self._check_fit(folder, [m.removeprefix("lm.") for m in missing if m.startswith("lm.")], unexpected)
        else:
            missing, unexpected = self.model.lm.load_state_dict(self._checkpoint_weights(folder), strict=False)
            self._check_fit(folder, missing, unexpected)
            self.model.lm.tie_weights()
        self.restore_extra(folder)
        self.load_trainer_state(folder)

    def _checkpoint_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        """The folder's weights in this model's layout (fused experts stacked back)."""
        from learners.training.expert_layout import training_layout

        return training_layout(load_model_weights(folder), self.model.lm.state_dict().keys())

    def _restore_sharded_adapter(self, folder: Path, adapter: dict[str, torch.Tensor]) -> None:
        """A saved adapter (peft's naming: no adapter name) into this rank's shards."""
        import re

        name = self.model.lm.active_adapter
        weights = {"lm." + re.sub(r"\.(lora_[AB])\.", rf".\1.{name}.", k): v for k, v in adapter.items()}
        _, unexpected = load_full_weights(self.model, weights, strict=False)
        if unexpected:
            raise ValueError(f"adapter in {folder} does not fit this model: {unexpected[:3]}")

    @staticmethod
    def _check_fit(folder: Path, missing: list[str], unexpected: list[str]) -> None:
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"{folder} does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]})")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False
