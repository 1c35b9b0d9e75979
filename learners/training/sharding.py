"""Sharded learners (``train.sharding: fsdp``): each rank keeps 1/N of the policy's weights, of
its gradients and of its AdamW state (PyTorch's FSDP2, ``torch.distributed.fsdp.fully_shard``,
over gloo on CPUs and NCCL on GPUs), instead of the replicated learners' whole copy each.

The learners' data-parallel maths stay as they are (``learners/training/distributed.py``): each rank trains
its own rows of the global batch, losses are normalised by global counts, gradients are *summed*
over ranks, so N sharded ranks take the one-rank step. What sharding adds:

* each decoder layer is a unit of its own and the policy module (embeddings, final norm, tied LM
  head, value head) is the root unit: a layer's full weights exist only while it computes, and its
  gradients are summed and re-sharded (reduce-scatter) as soon as its backward pass ends;
* every pass over the policy is then a collective (the layer's all-gather), so every rank must run
  the same number of passes even when its share of the batch is smaller: ``aligned_passes``
  gives the count, and a rank with nothing left runs ``idle`` passes whose loss is multiplied by 0;
* weights leave the learner one full tensor at a time (``full_tensor``, every rank taking part,
  so no rank holds more than the tensor being read besides its shards): a checkpoint's model
  folder holds full tensors, as transformers and vLLM load it;
* the optimiser's state is saved by every rank, its own shards only, with
  ``torch.distributed.checkpoint`` (``trainer_state/optimizer/``), which reshards it on load: a
  sharded run resumes with any number of ranks;
* only rank 0 reads the initial model; the other ranks build it empty and receive their shards
  (``load_causal_lm``, ``receive_weights_from_rank0``);
* bf16 learners gather bf16 weights from fp32 shards, and GPU learners may keep their shards in
  host memory (``shard_policy``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from learners.training.distributed import Collective

SHARDINGS: tuple[str, ...] = ("replicated", "fsdp")


def shard_policy(
    root: nn.Module, layers: list[nn.Module], *, param_dtype: torch.dtype | None = None, offload: bool = False
) -> None:
    """FSDP2 units: every module of ``layers``, then ``root`` with what is left (in place).

    Gradients are summed over ranks, not averaged (the learners' losses already carry global
    normalisers), with sum-only collectives: gloo has no pre-multiplied sum.

    ``param_dtype`` (bf16 where the learners compute bf16): the units gather their weights in
    that dtype (half the bytes of fp32) and compute with them; shards, gradients after the
    reduce-scatter (summed in fp32) and the optimiser's state stay fp32. ``offload``: the shards,
    their gradients and the optimiser's state live in host memory (pinned on GPUs); a unit's
    weights go to the device for its all-gather only. On a CPU device both are where they'd go."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policies = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy(),
    }
    for layer in layers:
        fully_shard(layer, **policies)
    fully_shard(root, **policies)
    for module in [*layers, root]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def shard_group_size() -> int:
    """Ranks of the group FSDP shards over (the default process group; 1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def shard_group_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def load_causal_lm(model_path: str, dtype: torch.dtype, *, empty: bool = False) -> nn.Module:
    """A transformers causal LM from its folder, or with ``empty`` its architecture alone: the
    parameters on the meta device (no memory, no file read), the buffers (rotary frequencies)
    computed as usual. Sharded ranks other than 0 start empty and receive rank 0's weights once
    sharded (``receive_weights_from_rank0``): at load one full copy per group of ranks, not one
    per rank (8 ranks of a 7B model on one node: 28 GB of host memory instead of 224 GB)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from learners.training.attention import register

    if not empty:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=register())
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        lm = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path), dtype=dtype, attn_implementation=register()
        )
    lm.tie_weights()  # the empty context re-creates each assigned parameter, a tied head included
    return lm


def receive_weights_from_rank0(root: nn.Module, weights: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """After ``shard_policy``: rank 0's full ``weights`` (``root.state_dict()`` taken before
    sharding; ``{}`` on the other ranks) into every rank's shards, broadcast tensor by tensor
    (a collective). A rank that built ``root`` empty first gives its shards memory on ``device``,
    keeping the buffers it computed itself."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(p.is_meta for p in root.parameters()):
        buffers = {n: b.detach().clone() for n, b in root.named_buffers()}
        root.to_empty(device=device)
        with torch.no_grad():
            for n, b in root.named_buffers():
                b.copy_(buffers[n])
    set_model_state_dict(
        root, dict(weights), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )
    root.reshard()


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank must call it), or ``t`` itself."""
    return t.full_tensor() if is_sharded(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` as a plain tensor sharing its storage (in-place writes reach the
    sharded parameter), or ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


def load_shard_(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copies this rank's part of the whole tensor ``full`` into ``t`` (a shard, or a plain
    tensor). A collective for shards: every rank passes the same ``full``."""
    if is_sharded(t):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full.to(t.device, t.dtype), t.device_mesh, t.placements).to_local()
    with torch.no_grad():
        local(t).copy_(full)


def aligned_passes(comm: Collective, n: int) -> int:
    """The number of passes every rank runs: the largest ``n`` of any rank."""
    return int(comm.all_reduce_max(torch.tensor([float(n)], dtype=torch.float64))[0])


def idle_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A two-token row predicting its second token: the cheapest pass a rank with no rows left runs
    so that its collectives meet the other ranks'. Its outputs enter the loss multiplied by 0."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    att = torch.ones(1, 2, dtype=torch.bool, device=device)
    positions = att.clone()
    positions[0, 0] = False
    return ids, att, positions


def zero_loss(out: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """0 times every differentiable output of a pass: a backward that gives each parameter the
    pass reached a zero gradient, as a rank's real passes do with data."""
    parts = [v.sum() for v in out.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    return torch.stack(parts).sum() * 0.0


@contextlib.contextmanager
def whole(root: nn.Module) -> Iterator[None]:
    """The root unit's weights gathered for code that does not enter through its ``forward``
    (log-prob passes over the LM alone); the layers gather themselves as they compute. A no-op
    for a module that is not sharded. Every rank must enter it."""
    if not hasattr(root, "unshard"):
        yield
        return
    root.unshard()
    try:
        yield
    finally:
        root.reshard()


def save_optimizer_shards(root: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Each rank writes its own shards of the optimiser's state into ``folder``
    (``torch.distributed.checkpoint``: one file per rank and the metadata; a collective). No rank
    gathers the whole state, and any number of ranks can load it (``load_optimizer_shards``).
    Every rank must reach ``folder``: shared storage when learners span nodes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(root, optimizer)}, checkpoint_id=str(folder))


def load_optimizer_shards(root: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """What ``save_optimizer_shards`` wrote, resharded for this number of ranks (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if not (Path(folder) / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} holds no sharded optimiser state (.metadata)")
    state = {"optimizer": get_optimizer_state_dict(root, optimizer)}
    dcp.load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(root, optimizer, state["optimizer"])


def load_full_weights(root: nn.Module, weights: Mapping[str, torch.Tensor], *, strict: bool = True) -> Any:
    """Full tensors (``root``'s naming) into this rank's shards (every rank passes all of them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    result = set_model_state_dict(root, dict(weights), options=StateDictOptions(full_state_dict=True, strict=strict))
    root.reshard()  # the root unit keeps the weights it gathered for a pass without gradients: drop them
    return result
