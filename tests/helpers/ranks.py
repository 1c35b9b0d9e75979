"""Data-parallel ranks as real processes in a real ``torch.distributed`` gloo group, as Ray Train's
workers run them: for what threads cannot simulate (FSDP2's sharded parameters and collectives).

``run_processes(world, fn, *args)`` starts ``world`` processes, each joining one group and calling
``fn(rank, world, *args)`` (a module-level function); returns the ranks' results in rank order.
A rank that raises fails the call with its traceback; ranks that hang are killed at the timeout.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

from serving.common import free_port
from tests.helpers.timeouts import scaled


def _rank_main(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_processes(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> list[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _rank_main, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        timeout_s = scaled(timeout_s)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks of {fn.__name__} still running after {timeout_s:.0f} s")
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world)]
