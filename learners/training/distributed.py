"""The one collective a data-parallel learner needs: a sum over ranks.

Every learner sees the whole (global) batch and trains on its own rows of it. Everything that
mixes rows across ranks is then a sum: per-row quantities of the other ranks' rows (each rank
fills its rows of a zero tensor, the sum is the global tensor), token and sequence counts for
the loss normalisers, and gradients. ``Collective`` is the single-process case; ``TorchCollective``
runs it over ``torch.distributed`` (gloo on CPU, NCCL on GPU); the tests simulate two ranks in
one process with threads. Gradients are all-reduced here rather than by DDP hooks, so ranks may
run different numbers of micro-batches (or none, with an empty shard) and parameters that get no
gradient need no special treatment.
"""

from __future__ import annotations

import torch


def fill_missing_gradients(params: list[torch.nn.Parameter]) -> None:
    """Gives each parameter without a gradient a zero one: the optimiser then steps it (moments,
    weight decay) as it would after a backward that added 0 to it."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


class Collective:
    """One process: every reduction is the identity."""

    rank: int = 0
    world: int = 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over ranks (every rank gets the result); may work in place."""
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``t`` over ranks; may work in place."""
        return t

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replaces each parameter's gradient by its sum over ranks (missing gradients count as 0).
        One flat buffer, one reduction: per-tensor calls cost a round trip each."""
        if self.world == 1:
            return
        fill_missing_gradients(params)
        flat = torch.cat([p.grad.reshape(-1).to(torch.float32) for p in params])
        flat = self.all_reduce_sum(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


class TorchCollective(Collective):
    """Ranks of the default ``torch.distributed`` process group (Ray Train sets it up).

    NCCL reduces CUDA tensors only, so a tensor on another device (a CPU counter on a GPU
    learner) is reduced through a copy on the group's device and written back in place."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        nccl = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, self.dist.ReduceOp.SUM)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, self.dist.ReduceOp.MAX)

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.world == 1:
            return t
        if t.device == self.device:
            self.dist.all_reduce(t, op=op)
            return t
        staged = t.to(self.device)
        self.dist.all_reduce(staged, op=op)
        return t.copy_(staged)


def default_collective() -> Collective:
    """TorchCollective when a process group exists, else the single-process one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return TorchCollective()
    return Collective()
