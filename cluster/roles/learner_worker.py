"""The rank side of the learners: the function every Ray Train worker runs for the whole run
(``learner_loop``), taking the driver's items from the channel, training, and answering with
metrics and references to packed weights. The driver side is ``cluster/roles/learner_group.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import ray

from cluster.roles.learner_spec import LearnerSpec

log = logging.getLogger("rayrlhf.learner")

_REPORTED = (
    "loss/policy",
    "loss/value",
    "loss/total",
    "kl/ref_k1",
    "policy/clip_frac",
    "logprob_gap/mean_abs",
    "rewards/accuracy",
    "rewards/margin",
)
# Ray Train 2.60's switch for its preemption watcher (``ray.train.v2._internal.constants``).
# Environment variables rank 0 reports in its ``ready`` message.
_REPORTED_ENV = ("OMP_NUM_THREADS", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


def learner_loop(config: dict[str, Any]) -> None:
    """The Ray Train worker function (runs on every rank; again from the top after a restart).

    Protocol: rank 0 reports ``ready``; the ranks then ignore every item until the driver's
    ``begin`` (its epoch, and the checkpoint to restore after a restart), and after it every item
    of another epoch: an item put before a restart is never taken for one meant after it. Every
    reply carries the epoch, so the driver never takes a reply or a second ``ready`` for the
    answer to the item it waits on."""
    from cluster.roles.workers import peak_rss_gb
    from learners.training.distributed import default_collective

    spec: LearnerSpec = config["spec"]
    channel = config["channel"]
    comm = default_collective()
    rank = comm.rank
    learner = build_learner(spec, comm)
    if spec.resume_from:
        learner.restore(spec.resume_from)
    nodes = _all_nodes(comm.world)
    if rank == 0:
        ray.get(
            channel.report.remote(
                {
                    "ready": True,
                    "world": comm.world,
                    "trainable_fraction": learner.trainable_fraction,
                    "version": learner.version,
                    "node": nodes[0],
                    "nodes": nodes,
                    # What the process started with (the run's log shows whether the malloc settings held).
                    "env": {k: os.environ.get(k) for k in _REPORTED_ENV},
                }
            )
        )
    epoch = None
    while True:
        item = ray.get(channel.get.remote(rank))
        if item.get("stop"):
            break
        if "begin" in item:
            epoch = item["begin"]
            if item.get("restore"):
                learner.restore(item["restore"])
            if rank == 0:
                ray.get(channel.report.remote({"epoch": epoch, "begun": True, "version": learner.version}))
            continue
        if epoch is None or item.get("epoch") != epoch:
            continue  # put before the restart this worker group is
        try:
            reply = _handle(item, learner, spec, comm, peak_rss_gb)
        except Exception as e:  # surface the error to the driver instead of hanging it
            log.exception("learner step %s failed", item.get("step"))
            if rank == 0:
                ray.get(channel.report.remote({"epoch": epoch, "step": item.get("step"), "error": repr(e)}))
            raise
        if reply is not None and rank == 0:
            ray.get(channel.report.remote({"epoch": epoch, **reply}))
        if reply is not None and "metrics" in reply and not item.get("evaluate") and item.get("report", True):
            # A compact subset: Ray Train logs every report, the full set goes to the run's JSONL.
            # The driver marks which steps report (``report_gap_s``), the same for every rank.
            ray.train.report({k: round(reply["metrics"][k], 6) for k in _REPORTED if k in reply["metrics"]})


def build_learner(spec: LearnerSpec, comm: Any) -> Any:
    """This rank's learner, on its thread count and device, with ``comm`` between the ranks."""
    import torch

    from learners.base import load_learner_class

    # Ray sets OMP_NUM_THREADS to the reserved CPUs; learners run in their own phase and may use the node.
    torch.set_num_threads(spec.threads or os.cpu_count() or 1)
    ctx = dataclasses.replace(spec.context, comm=comm, device=learner_device(spec))
    return load_learner_class(spec.learner_target).build(ctx, spec.train, spec.algo)


def trainable_flat(learner: Any) -> Any:
    """An unsharded learner's trainable weights as one flat float64 vector."""
    import torch

    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in learner.trainable])


def learner_device(spec: LearnerSpec) -> str:
    """Where this worker's learner computes: the GPU Ray Train gave it, or the CPU."""
    if not spec.gpus_per_learner:
        return "cpu"
    from ray.train.torch import get_device

    return str(get_device())


def _handle(item: dict, learner: Any, spec: LearnerSpec, comm: Any, peak_rss_gb: Any) -> dict | None:
    """One item of the driver: a training step, a held-out evaluation, a checkpoint or the current
    weights. Returns rank 0's reply (every rank computes; only rank 0's is sent)."""
    import torch

    from cluster.roles.realtime import realtime_threads
    from learners.experience import Experience

    step = item.get("step")
    # Rank 0 answers. Reading a sharded learner's weights (pack, probe, save) is a collective, so
    # there every rank reads them with it.
    reads = comm.rank == 0 or getattr(learner, "sharded", False)
    if "weights_group" in item:
        return _weights_group(item, learner, spec, comm) if reads else None
    if item.get("weights_only"):  # a restarted generator needs the weights the others hold
        if not reads:
            return None
        packed, _ = _pack_weights(learner, spec, comm)
        probe = _probe(learner, spec)
        return {
            "step": step,
            "weights": [ray.put(packed)] if packed is not None else [],
            "version": learner.version,
            **probe,
        }
    if item.get("digest"):
        return _weights_digest(learner, comm)
    if item.get("save_only"):  # a checkpoint outside a step (early stopping)
        if reads:
            learner.save(item["save_dir"], tokenizer_from=spec.tokenizer_path)
        return {"step": step, "saved": item["save_dir"], "version": learner.version}
    parts = ray.get(item["exp_refs"])
    batch = Experience.concat(parts, pad_token_id=spec.pad_token_id)
    if item.get("evaluate"):  # held-out metrics only: no update, no weights
        return {"step": step, "metrics": learner.evaluate(batch), "version": learner.version}
    # Every rank gets the global batch and takes its own rows inside the learner.
    with realtime_threads(spec.realtime) as realtime:
        metrics = learner.train_step(batch)
    if spec.realtime:
        metrics["learner/realtime"] = float(realtime)
    metrics["memory/learner_peak_gb"] = float(comm.all_reduce_max(torch.tensor([peak_rss_gb()], dtype=torch.float64)))
    reply: dict[str, Any] = {"step": step, "metrics": metrics, "version": learner.version}
    if reads:
        if item.get("sync", True):
            packed, metrics["sync/pack_s"] = _pack_weights(learner, spec, comm)
            reply["weights"] = [ray.put(packed)] if packed is not None else []
            reply.update(_probe(learner, spec))
            metrics["sync/bytes"] = float(packed.nbytes) if packed is not None else 0.0
        if item.get("save_dir"):
            learner.save(item["save_dir"], tokenizer_from=spec.tokenizer_path)
            reply["saved"] = item["save_dir"]
    return reply


def _weights_digest(learner: Any, comm: Any) -> dict | None:
    """How far apart the ranks' trainable weights are (0.0: identical, as data-parallel ranks
    must be after every step), and rank 0's weights as one flat fp32 vector."""
    import torch

    from learners.training.sharding import is_sharded

    if any(is_sharded(p) for p in learner.trainable):  # shards differ by design: compare the whole
        flat = torch.cat([p.full_tensor().detach().reshape(-1).to(torch.float64) for p in learner.trainable])
        return None if comm.rank else {"rank_spread": 0.0, "trainable": [ray.put(flat.float().cpu())]}
    flat = trainable_flat(learner)
    high = comm.all_reduce_max(flat.clone())
    low = -comm.all_reduce_max(-flat)
    if comm.rank != 0:
        return None
    return {"rank_spread": float((high - low).max()), "trainable": [ray.put(flat.float().cpu())]}


def _pack_weights(learner: Any, spec: LearnerSpec, comm: Any) -> tuple[Any, float]:
    """The policy as one flat buffer in the generators' dtype, and the seconds it took. A sharded
    learner's other ranks only take part in gathering each tensor (None: rank 0 packs)."""
    from cluster.roles.weight_sync import pack

    t0 = time.perf_counter()
    if comm.rank != 0:
        learner.policy_state_dict(keep=False, adapter=spec.adapter_sync)
        return None, time.perf_counter() - t0
    with learner.sync_weights(spec.adapter_sync) as weights:
        # Every caller hands the buffer on (ray.put copies it; the broadcast is synchronous)
        # before the next pack, so this worker reuses one buffer.
        packed = pack(weights, _sync_dtype(spec), version=learner.version, out=_PACK_BUFFER.get("buffer"))
    _PACK_BUFFER["buffer"] = packed.buffer
    return packed, time.perf_counter() - t0


def _sync_dtype(spec: LearnerSpec) -> str:
    """The dtype weights travel in: LoRA factors always in fp32 (a few MB; the generator merges
    them into its base weights exactly as the learner does)."""
    return "float32" if spec.adapter_sync else spec.sync_dtype


# The last pack's buffer in this learner worker, reused by the next.
_PACK_BUFFER: dict[str, Any] = {}


def _probe(learner: Any, spec: LearnerSpec) -> dict:
    """The verified-sync probe's log-probs under the weights just packed (none without a probe)."""
    return {"probe": learner.probe_logprobs(spec.probe_ids)} if spec.probe_ids else {}


# This worker's end of the weight-broadcast group (rank 0 only): the store, then the group.
_WEIGHT_GROUP: dict[str, Any] = {}


def _weights_group(item: dict, learner: Any, spec: LearnerSpec, comm: Any) -> dict | None:
    """The collective transport's learner side: ``open`` (a store on a free port; the layout of
    the weights), ``join`` (the group, once the generators are joining), ``broadcast`` (pack and
    send the current weights, in buckets)."""
    import torch

    from cluster.roles import collective
    from cluster.roles.weight_sync import layout_of

    op = item["weights_group"]
    if comm.rank != 0:  # a sharded learner's other ranks: their part of reading the weights
        if op == "broadcast":
            _pack_weights(learner, spec, comm)
            _probe(learner, spec)
        return None
    if op == "open":
        store, host, port = collective.open_store(item["world"])
        _WEIGHT_GROUP.clear()
        _WEIGHT_GROUP.update(store=store, host=host, port=port, world=item["world"])
        with learner.sync_weights(spec.adapter_sync) as weights:
            layout, total = layout_of(weights)
        return {"host": host, "port": port, "layout": layout, "total": total, "dtype": _sync_dtype(spec)}
    if op == "join":
        g = _WEIGHT_GROUP
        g["group"] = collective.join(
            g["host"], g["port"], 0, g["world"], store=g["store"], backend=item.get("backend", "gloo")
        )
        return {"joined": True}
    if op == "broadcast":
        packed, t_pack = _pack_weights(learner, spec, comm)
        t0 = time.perf_counter()
        group = _WEIGHT_GROUP["group"]
        # Packed in host memory; NCCL sends from the GPU (one host-to-device copy).
        collective.broadcast_buffer(group, torch.from_numpy(packed.buffer).to(group.device), item["bucket_bytes"])
        return {
            "version": learner.version,
            "bytes": float(packed.nbytes),
            "pack_s": t_pack,
            "broadcast_s": time.perf_counter() - t0,
            **_probe(learner, spec),
        }
    raise ValueError(f"unknown weights_group operation {op!r}")


def _all_nodes(world: int) -> list[str]:
    """The Ray node of every learner rank, in rank order (where a colocated generator goes)."""
    import torch.distributed as dist

    node = ray.get_runtime_context().get_node_id()
    if world == 1 or not dist.is_initialized():
        return [node]
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node)
    return nodes
