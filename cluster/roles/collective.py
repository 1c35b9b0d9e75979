"""A weight-broadcast group of learner rank 0 and every generator, outside torch.distributed's
default group.

vLLM's in-process worker and Ray Train's workers each own a default process group already, so
``ray.util.collective`` and ``init_process_group`` refuse a second one there. A process group
object built from its own ``TCPStore`` (what vLLM's ``stateless_init_torch_distributed_process_group``
does) lives beside the default group and touches no global state. Rank 0 (the learner) hosts
the store; generator i is rank i + 1.

Gloo moves the buffer through host memory, on any cluster (also between GPU roles); NCCL moves
it GPU to GPU when the learner and the generators hold GPUs (``rollout.collective_backend``). The
two differ only in the backend object and the device of the buffer; the tests run gloo (no GPU
here).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

GROUP_PREFIX = "rayrlhf-weights"


def open_store(world: int, timeout_s: float = 300.0) -> tuple[object, str, int]:
    """Rank 0's side: a TCPStore server on a free port of this node. Returns (store, host, port);
    the group itself is made by ``join`` once the other ranks are told where to connect."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    store = torch.distributed.TCPStore(
        host, port, world, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return store, host, port


@dataclass
class WeightGroup:
    # The process-group backend (group ranks: 0 the learner, i + 1 generator i).
    group: object
    # Its TCPStore, kept alive as long as the group (rank 0 hosts it).
    store: object
    # Where the broadcast buffer must live: the CPU (gloo) or this rank's GPU (NCCL).
    device: torch.device = torch.device("cpu")


def join(
    host: str,
    port: int,
    rank: int,
    world: int,
    store: object | None = None,
    timeout_s: float = 300.0,
    backend: str = "gloo",
) -> WeightGroup:
    """Every rank: the process group of the broadcast, ``gloo`` or ``nccl`` (blocks until all
    ``world`` ranks joined)."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(host, port, world, is_master=False, timeout=timeout)
    prefix = torch.distributed.PrefixStore(GROUP_PREFIX, store)
    if backend == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        device = torch.device("cuda", torch.cuda.current_device())
        return WeightGroup(ProcessGroupNCCL(prefix, rank, world, options), store, device)
    if backend != "gloo":
        raise ValueError(f"unknown weight-group backend {backend!r} (gloo or nccl)")
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return WeightGroup(ProcessGroupGloo(prefix, rank, world, timeout), store)


def broadcast_buffer(wg: WeightGroup, flat: torch.Tensor, bucket_bytes: int) -> None:
    """Broadcasts a 1-D tensor from rank 0 in buckets of at most ``bucket_bytes`` (one message per
    bucket, not per parameter; receivers pass a tensor of the same size and dtype). It travels
    as bytes: gloo has no 16-bit integer type, the carrier of bf16 buffers. ``flat`` must be on
    ``wg.device``."""
    if flat.device != wg.device:
        raise ValueError(f"the broadcast buffer is on {flat.device}, the group needs {wg.device}")
    flat = flat.view(torch.uint8)
    per = max(1, bucket_bytes)
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    for start in range(0, flat.numel(), per):
        wg.group.broadcast([flat[start : start + per]], opts).wait()
