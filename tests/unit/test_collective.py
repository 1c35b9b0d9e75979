"""The weight-broadcast group on its own (no Ray, no vLLM): three processes, a gloo group built
from its own TCPStore beside any default group, a buffer broadcast in buckets."""

from __future__ import annotations

import numpy as np
import torch
import torch.multiprocessing as mp

from cluster.roles.collective import broadcast_buffer, join
from serving.common import free_port

N = 10_007  # not a multiple of the bucket: the last bucket is short


def _rank(rank: int, world: int, port: int, out: "mp.Queue") -> None:
    # A default process group first, as in a vLLM worker or a Ray Train worker: the broadcast
    # group must live beside it.
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + 1}", rank=rank, world_size=world)
    store = (
        torch.distributed.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False)
        if rank == 0
        else None
    )
    group = join("127.0.0.1", port, rank, world, store=store)
    src = (torch.arange(N, dtype=torch.float32) / 7).to(torch.bfloat16).view(torch.int16)  # bf16 as its bit pattern
    buf = torch.from_numpy(src.numpy().copy()) if rank == 0 else torch.from_numpy(np.zeros(N, dtype=np.int16))
    broadcast_buffer(group, buf, bucket_bytes=1000)
    out.put((rank, bool(torch.equal(buf, src))))
    torch.distributed.destroy_process_group()


def test_broadcast_in_buckets_beside_a_default_group():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 3, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {0: True, 1: True, 2: True}


def test_the_buffer_must_be_on_the_groups_device_and_the_backend_known():
    """An NCCL group takes GPU buffers and a gloo group host ones: a buffer elsewhere is refused
    before anything is sent, as is a backend other than the two."""
    import pytest

    from cluster.roles.collective import WeightGroup

    on_gpu = WeightGroup(group=None, store=None, device=torch.device("meta"))  # stands for a CUDA device
    with pytest.raises(ValueError, match="buffer is on cpu, the group needs meta"):
        broadcast_buffer(on_gpu, torch.zeros(8), bucket_bytes=4)
    with pytest.raises(ValueError, match="unknown weight-group backend 'mpi'"):
        join(
            "127.0.0.1",
            free_port(),
            0,
            1,
            store=torch.distributed.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False),
            backend="mpi",
        )


def test_a_receive_buffer_unpacks_like_the_object_store_buffer():
    """The collective transport's receive buffer (a carrier tensor) yields the same named views
    as the object store's numpy buffer."""
    from cluster.roles.weight_sync import carrier_tensor_dtype, pack, unpack, unpack_flat

    weights = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(5)}
    for dtype in ("bfloat16", "float32"):
        packed = pack(weights, dtype, version=1)
        received = torch.from_numpy(packed.buffer.copy())
        assert received.dtype == carrier_tensor_dtype(dtype)
        flat = dict(unpack_flat(received, dtype, packed.layout))
        for name, t in unpack(packed):
            assert torch.equal(flat[name], t) and flat[name].dtype == t.dtype
