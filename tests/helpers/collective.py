"""Data-parallel ranks simulated in one process: threads that meet at a barrier to sum tensors.

Runs the learners' real reduction code paths (global counts, gathered per-row tensors, summed
gradients) without a process group; ``TorchCollective`` runs the same calls over gloo in the
Ray tests.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from learners.training.distributed import Collective


class _Group:
    def __init__(self, world: int, timeout_s: float) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout_s)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world


class ThreadCollective(Collective):
    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, group.world

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        g = self.group
        g.calls[self.rank] += 1
        g.slots[self.rank] = t.detach().clone()
        g.barrier.wait()
        total = g.slots[0].clone()
        for other in g.slots[1:]:  # the same order on every rank: bit-identical results
            total += other
        g.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        t.copy_(total)
        return t


def run_ranks(world: int, fn: Callable[[int, Collective], Any], timeout_s: float = 120.0) -> list[Any]:
    """Runs ``fn(rank, comm)`` on ``world`` threads; returns their results in rank order.
    A rank that raises (or a rank left waiting: a hang) fails the call instead of blocking it."""
    group = _Group(world, timeout_s)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadCollective(group, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a rank did not finish")
    if len(set(group.calls)) != 1:
        raise AssertionError(f"ranks made different numbers of collective calls: {group.calls}")
    return results
