"""Learners as one long-lived Ray Train ``TorchTrainer`` job fed through a channel actor.

Starting a Ray Train worker group costs 12-20 s on a small machine; paying it per step would
dominate a PPO iteration. So ``fit()`` runs once, in a background thread of the driver, and
its training loop lives for the whole run: it takes experience ObjectRefs from the channel,
trains, and answers with metrics and a reference to the packed new weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cluster.config import Config
from learners.base import LearnerContext

log = logging.getLogger("rayrlhf.learner")


@ray.remote(num_cpus=0)
class LearnerChannel:
    """Driver -> every rank (one inbox each) and rank 0 -> driver (one outbox)."""

    def __init__(self, world: int) -> None:
        self.inboxes = [asyncio.Queue() for _ in range(world)]
        self.outbox: asyncio.Queue = asyncio.Queue()

    async def put(self, item: dict) -> None:
        for q in self.inboxes:
            await q.put(item)

    async def get(self, rank: int) -> dict:
        return await self.inboxes[rank].get()

    async def report(self, item: dict) -> None:
        await self.outbox.put(item)

    async def result(self) -> dict:
        return await self.outbox.get()


_REPORTED = ("loss/policy", "loss/value", "loss/total", "kl/ref_k1", "policy/clip_frac", "logprob_gap/mean_abs",
             "rewards/accuracy", "rewards/margin")
# Ray Train 2.60's switch for its preemption watcher (``ray.train.v2._internal.constants``).
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Environment variables rank 0 reports in its ``ready`` message.
_REPORTED_ENV = ("OMP_NUM_THREADS", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


@dataclass
class LearnerSpec:
    """Everything the learner workers need, and nothing else."""

    # Registered learner name (``learners.base.LEARNERS``).
    algorithm: str
    # The shared ``train`` section and the algorithm's own section.
    train: Any
    algo: Any
    # Where and how learners start (model path, seed, schedule length, temperature, LoRA).
    context: LearnerContext
    # Checkpoint folder to continue from (weights and training state), or None.
    resume_from: str | None
    # Tokenizer of the run (copied into checkpoints) and its padding id.
    tokenizer_path: str
    pad_token_id: int
    # dtype of the weights sent to the generators.
    sync_dtype: str
    # Data-parallel workers, CPUs reserved by each, torch threads of each (0: every core).
    num_learners: int = 1
    cpus_per_learner: float = 1.0
    threads: int = 0
    # GPUs of each worker: 0 (CPU, gloo) or 1 (its CUDA device, NCCL).
    gpus_per_learner: int = 0
    # CPU workers start with ``KEEP_FREED_MEMORY_ENV`` (cluster/actor_groups.py): glibc reuses
    # freed tensors' memory instead of faulting in fresh pages each micro-batch.
    keep_freed_memory: bool = True
    # Extra Ray resources of each worker (placement on the nodes that offer them).
    resources: dict = dataclasses.field(default_factory=dict)
    # Ray placement-group strategy of the workers' bundles.
    placement_strategy: str = "PACK"
    # Each update under real-time scheduling (``cluster/realtime.py``), where permitted.
    realtime: bool = False
    # Restarts of the worker group Ray Train may make after a worker dies (``FailureConfig``).
    max_failures: int = 0
    # Token ids of the verified-sync probe: rank 0 answers every weight sync with the policy's
    # log-probs of them (empty: no probe).
    probe_ids: list[int] = dataclasses.field(default_factory=list)


def learner_spec(cfg: Config, model_path: str, pad_token_id: int, resume_from: str | None = None,
                 probe_ids: list[int] | None = None) -> LearnerSpec:
    """The learner's slice of the run's config."""
    algo = getattr(cfg, cfg.run.algorithm)
    if cfg.run.algorithm == "ppo" and algo.rollout_correction == "auto":
        # Asynchronous batches come from older weights: correct for them by default.
        algo = algo.model_copy(update={"rollout_correction": "truncate" if cfg.rollout.max_staleness > 0 else "none"})
    return LearnerSpec(
        algorithm=cfg.run.algorithm, train=cfg.train, algo=algo,
        context=LearnerContext(
            model_path=model_path, seed=cfg.run.seed, total_steps=cfg.run.steps,
            temperature=cfg.rollout.temperature or 1.0, max_new_tokens=cfg.model.max_new_tokens,
            lora=cfg.lora if cfg.lora.enabled else None,
        ),
        resume_from=resume_from, tokenizer_path=model_path, pad_token_id=pad_token_id,
        sync_dtype=cfg.model.generator_dtype, num_learners=cfg.cluster.num_learners,
        cpus_per_learner=cfg.cluster.cpus_per_learner, threads=cfg.cluster.threads,
        gpus_per_learner=cfg.cluster.gpus_per_learner, keep_freed_memory=cfg.cluster.keep_freed_memory,
        realtime=cfg.cluster.realtime_learners,
        max_failures=cfg.cluster.learner_max_failures, probe_ids=list(probe_ids or []),
        resources=dict(cfg.cluster.learner_resources), placement_strategy=cfg.cluster.learner_placement_strategy,
    )


def learner_loop(config: dict[str, Any]) -> None:
    """The Ray Train worker function (runs on every rank; again from the top after a restart).

    Protocol: rank 0 reports ``ready``; the ranks then ignore every item until the driver's
    ``begin`` (its epoch, and the checkpoint to restore after a restart), and after it every item
    of another epoch: an item put before a restart is never taken for one meant after it. Every
    reply carries the epoch, so the driver never takes a reply or a second ``ready`` for the
    answer to the item it waits on."""
    import torch

    from cluster.actor_groups import peak_rss_gb
    from learners.base import get_learner
    from learners.distributed import default_collective

    spec: LearnerSpec = config["spec"]
    channel = config["channel"]
    comm = default_collective()
    rank = comm.rank
    # Ray sets OMP_NUM_THREADS to the reserved CPUs; learners run in their own phase and may use the node.
    torch.set_num_threads(spec.threads or os.cpu_count() or 1)
    ctx = dataclasses.replace(spec.context, comm=comm, device=learner_device(spec))
    learner = get_learner(spec.algorithm).build(ctx, spec.train, spec.algo)
    if spec.resume_from:
        learner.restore(spec.resume_from)
    nodes = _all_nodes(comm.world)
    if rank == 0:
        ray.get(channel.report.remote({
            "ready": True, "world": comm.world, "trainable_fraction": learner.trainable_fraction,
            "version": learner.version, "node": nodes[0], "nodes": nodes,
            # What the process started with (the run's log shows whether the malloc settings held).
            "env": {k: os.environ.get(k) for k in _REPORTED_ENV},
        }))
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


def learner_device(spec: LearnerSpec) -> str:
    """Where this worker's learner computes: the GPU Ray Train gave it, or the CPU."""
    if not spec.gpus_per_learner:
        return "cpu"
    from ray.train.torch import get_device

    return str(get_device())


def worker_scaling(spec: LearnerSpec) -> dict[str, Any]:
    """Ray Train's ``ScalingConfig`` arguments, the process-group backend of the workers (GPU
    workers reduce with NCCL, CPU workers with gloo: the same learner code either way) and the
    environment variables the workers start with."""
    from cluster.actor_groups import KEEP_FREED_MEMORY_ENV

    gpus = {"GPU": float(spec.gpus_per_learner)} if spec.gpus_per_learner else {}
    return {
        "scaling": {"num_workers": spec.num_learners, "use_gpu": bool(spec.gpus_per_learner),
                    "resources_per_worker": {"CPU": spec.cpus_per_learner, **spec.resources, **gpus},
                    "placement_strategy": spec.placement_strategy},
        "backend": "nccl" if spec.gpus_per_learner else "gloo",
        "env_vars": dict(KEEP_FREED_MEMORY_ENV) if spec.keep_freed_memory and not spec.gpus_per_learner else {},
    }


def report_gap_s() -> float:
    """Least time between two steps whose metrics the learners report to Ray Train. Its controller
    takes one report per worker each health check (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by
    default) from a queue of one, so a report sooner than that blocks the worker until the next
    check, and the next step waits for it: measured 0.9-1.9 s per step on a tiny model's
    sub-second steps. Reports at most this often never block. (Ray Train's report is its logs;
    the run's metrics all go to the run's JSONL and Ray metrics.)"""
    return 1.25 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0"))


def _handle(item: dict, learner: Any, spec: LearnerSpec, comm: Any, peak_rss_gb: Any) -> dict | None:
    """One item of the driver: a training step, a held-out evaluation, a checkpoint or the current
    weights. Returns rank 0's reply (every rank computes; only rank 0's is sent)."""
    import torch

    from cluster.realtime import realtime_threads
    from learners.experience import Experience

    step = item.get("step")
    if "weights_group" in item:
        return _weights_group(item, learner, spec, comm)
    if item.get("weights_only"):  # a restarted generator needs the weights the others hold
        if comm.rank != 0:
            return None
        packed, _ = _pack_weights(learner, spec)
        return {"step": step, "weights": [ray.put(packed)], "version": learner.version, **_probe(learner, spec)}
    if item.get("digest"):
        return _weights_digest(learner, comm)
    if item.get("save_only"):  # a checkpoint outside a step (early stopping)
        if comm.rank == 0:
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
    if comm.rank == 0:
        if item.get("sync", True):
            packed, metrics["sync/pack_s"] = _pack_weights(learner, spec)
            reply["weights"] = [ray.put(packed)]
            reply.update(_probe(learner, spec))
            metrics["sync/bytes"] = float(packed.nbytes)
        if item.get("save_dir"):
            learner.save(item["save_dir"], tokenizer_from=spec.tokenizer_path)
            reply["saved"] = item["save_dir"]
    return reply


def _weights_digest(learner: Any, comm: Any) -> dict | None:
    """How far apart the ranks' trainable weights are (0.0: identical, as data-parallel ranks
    must be after every step), and rank 0's weights as one flat fp32 vector."""
    import torch

    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in learner.trainable])
    high = comm.all_reduce_max(flat.clone())
    low = -comm.all_reduce_max(-flat)
    if comm.rank != 0:
        return None
    return {"rank_spread": float((high - low).max()), "trainable": [ray.put(flat.float().cpu())]}


def _pack_weights(learner: Any, spec: LearnerSpec) -> tuple[Any, float]:
    """The policy as one flat buffer in the generators' dtype, and the seconds it took."""
    from cluster.weight_sync import pack

    t0 = time.perf_counter()
    with learner.policy_weights() as weights:
        # Every caller hands the buffer on (ray.put copies it; the broadcast is synchronous)
        # before the next pack, so this worker reuses one buffer.
        packed = pack(weights, spec.sync_dtype, version=learner.version, out=_PACK_BUFFER.get("buffer"))
    _PACK_BUFFER["buffer"] = packed.buffer
    return packed, time.perf_counter() - t0


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

    from cluster import collective
    from cluster.weight_sync import layout_of

    if comm.rank != 0:
        return None
    op = item["weights_group"]
    if op == "open":
        store, host, port = collective.open_store(item["world"])
        _WEIGHT_GROUP.clear()
        _WEIGHT_GROUP.update(store=store, host=host, port=port, world=item["world"])
        with learner.policy_weights() as weights:
            layout, total = layout_of(weights)
        return {"host": host, "port": port, "layout": layout, "total": total, "dtype": spec.sync_dtype}
    if op == "join":
        g = _WEIGHT_GROUP
        g["group"] = collective.join(g["host"], g["port"], 0, g["world"], store=g["store"],
                                     backend=item.get("backend", "gloo"))
        return {"joined": True}
    if op == "broadcast":
        packed, t_pack = _pack_weights(learner, spec)
        t0 = time.perf_counter()
        group = _WEIGHT_GROUP["group"]
        # Packed in host memory; NCCL sends from the GPU (one host-to-device copy).
        collective.broadcast_buffer(group, torch.from_numpy(packed.buffer).to(group.device), item["bucket_bytes"])
        return {"version": learner.version, "bytes": float(packed.nbytes), "pack_s": t_pack,
                "broadcast_s": time.perf_counter() - t0, **_probe(learner, spec)}
    raise ValueError(f"unknown weights_group operation {op!r}")


class _Restarted(Exception):
    """The learner workers started again (Ray Train restarted the group after a failure)."""


def _all_nodes(world: int) -> list[str]:
    """The Ray node of every learner rank, in rank order (where a colocated generator goes)."""
    import torch.distributed as dist

    node = ray.get_runtime_context().get_node_id()
    if world == 1 or not dist.is_initialized():
        return [node]
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node)
    return nodes


class LearnerGroup:
    """Driver-side handle: start once, ``learn(step, exp_refs)`` per iteration, ``stop()``.

    Surviving a lost learner: Ray Train restarts the worker group (``FailureConfig``) and runs the
    worker function again from the top. The group then restores the last checkpoint this run
    wrote (or the state it started from), replays the training items sent since (their
    experience is still in the object store) without weight syncs, and sends the interrupted
    item again: the learners end in the state an uninterrupted run would have reached, and every
    batch is in the weights once."""

    def __init__(self, spec: LearnerSpec, storage_dir: Path) -> None:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        self.spec = spec
        self.max_failures = max_failures = spec.max_failures
        # Ray Train's preemption watcher (an extra actor per worker group, polling every node every
        # 5 s) tells workers that a node is about to go; this loop does not act on that (a lost
        # worker restarts the group from the last checkpoint either way). The driver's value
        # reaches Train's controller; a user's own setting wins.
        os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
        self.channel = LearnerChannel.remote(spec.num_learners)
        workers = worker_scaling(spec)
        self.trainer = TorchTrainer(
            learner_loop,
            train_loop_config={"spec": spec, "channel": self.channel},
            scaling_config=ScalingConfig(**workers["scaling"]),
            torch_config=TorchConfig(backend=workers["backend"]),
            # A fresh name per start: Ray Train would otherwise treat a resumed run's learners as a
            # restart of the old Train run. The run's own checkpoints are what a resume reads.
            run_config=RunConfig(name=f"learner-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
                                 storage_path=str(Path(storage_dir).resolve()),
                                 failure_config=FailureConfig(max_failures=max_failures),
                                 worker_runtime_env={"env_vars": workers["env_vars"]}),
        )
        self.error: BaseException | None = None
        self.epoch = 0
        # What a restarted group restores (None: the state it builds from) and the training items
        # sent after it, replayed in order.
        self.checkpoint: str | None = spec.resume_from
        self.history: list[dict] = []
        self.restarts = 0
        self._ready: dict | None = None  # rank 0's ready report, once received
        self._last_report = 0.0  # when the last step that reported to Ray Train replied
        # (step the driver was at, items replayed) per restart, for the run's ledger and log.
        self.restart_log: list[dict] = []
        self.thread = threading.Thread(target=self._fit, name="rayrlhf-learner", daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as e:  # kept for the driver, which re-raises it with context
            self.error = e

    def _next(self, deadline: float) -> dict:
        ref = self.channel.result.remote()
        while True:
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                return ray.get(ref)
            if not self.thread.is_alive():
                raise RuntimeError(f"learner group stopped: {self.error!r}")
            if time.time() > deadline:
                raise TimeoutError(f"no answer from the learners after {deadline - self._t_wait:.0f}s")

    def _reply(self, timeout_s: float) -> dict:
        """The current epoch's next reply; a new ``ready`` means the group restarted."""
        self._t_wait = time.time()
        deadline = self._t_wait + timeout_s
        while True:
            item = self._next(deadline)
            if item.get("ready"):
                raise _Restarted()
            if item.get("epoch") != self.epoch:
                continue  # from before a restart
            if "error" in item:
                if self.restarts < self.max_failures:
                    log.warning("learner failed at step %s (%s); waiting for Ray Train to restart it",
                                item.get("step"), item["error"])
                    continue
                raise RuntimeError(f"learner failed at step {item.get('step')}: {item['error']}")
            return item

    def _begin(self, restore: str | None, timeout_s: float = 600) -> dict:
        self.epoch += 1
        self.channel.put.remote({"begin": self.epoch, "restore": restore})
        return self._reply(timeout_s)

    def _send(self, item: dict, timeout_s: float) -> dict:
        self.channel.put.remote({**item, "epoch": self.epoch})
        return self._reply(timeout_s)

    def _call(self, item: dict, timeout_s: float, replayable: bool = False) -> dict:
        """Sends one item and returns its reply, recovering from any number of restarts (up to
        ``max_failures``) on the way. ``replayable``: a training item, replayed after a restart."""
        while True:
            try:
                reply = self._send(item, timeout_s)
                break
            except _Restarted:
                self._recover(item.get("step"), timeout_s)
        if replayable:
            self.history.append(item)
        if reply.get("saved"):
            self.checkpoint, self.history = reply["saved"], []
        return reply

    def _recover(self, step: Any, timeout_s: float) -> None:
        """After a restart: restore, then replay the training items since the last checkpoint."""
        self.restarts += 1
        if self.restarts > self.max_failures:
            raise RuntimeError(f"the learner workers restarted {self.restarts} times (cluster.learner_max_failures="
                               f"{self.max_failures})")
        print(f"[rayrlhf] learner workers restarted at step {step} (restart {self.restarts} of at most "
              f"{self.max_failures}): restoring {self.checkpoint or 'the starting weights'} and replaying "
              f"{len(self.history)} step(s) since", flush=True)
        try:
            restore = self.checkpoint if self.checkpoint != self.spec.resume_from else None
            self._begin(restore)
            for past in self.history:
                self._send({**past, "sync": False, "save_dir": None, "report": False}, timeout_s)
        except _Restarted:  # it failed again while recovering: start over
            return self._recover(step, timeout_s)
        self.restart_log.append({"step": step, "replayed": [p.get("step") for p in self.history],
                                 "restored": self.checkpoint})

    def wait_ready(self, timeout_s: float = 600) -> dict:
        """Rank 0's ready report (``nodes``: every rank's Ray node); a second call returns it again."""
        if self._ready is not None:
            return self._ready
        while True:
            info = self._next(time.time() + timeout_s)
            if info.get("ready"):
                break
        begun = self._begin(None, timeout_s)
        self._ready = {**info, "version": begun["version"]}
        return self._ready

    def learn(self, step: int, exp_refs: list, save_dir: str | None = None, sync: bool = True,
              timeout_s: float = 3600) -> dict:
        """One update; ``sync=False`` skips packing weights for generators (offline recipes)."""
        # The worker reports right after its reply, so the time since the last reporting reply is
        # a lower bound of the gap between the two reports.
        report = time.time() - self._last_report >= report_gap_s()
        reply = self._call({"step": step, "exp_refs": list(exp_refs), "save_dir": save_dir, "sync": sync,
                            "report": report}, timeout_s, replayable=True)
        if report:
            self._last_report = time.time()
        return reply

    def save(self, step: int, save_dir: str, timeout_s: float = 600) -> dict:
        """Writes a checkpoint of the learners' current state (no update)."""
        return self._call({"step": step, "save_dir": save_dir, "save_only": True}, timeout_s)

    def evaluate(self, step: int, exp_refs: list, timeout_s: float = 3600) -> dict[str, float]:
        """The learners' held-out metrics on a batch (``Learner.evaluate``), no update."""
        return self._call({"step": step, "exp_refs": list(exp_refs), "evaluate": True}, timeout_s)["metrics"]

    def weights_digest(self, timeout_s: float = 600) -> dict:
        """``rank_spread`` (the largest difference between two ranks' trainable weights) and
        ``trainable`` (rank 0's, one flat vector, by reference)."""
        return self._call({"digest": True}, timeout_s)

    def weights_group(self, op: str, timeout_s: float = 600, **kw: Any) -> dict:
        """The collective transport's learner side (``_weights_group``): open, join, broadcast."""
        return self._call({"weights_group": op, **kw}, timeout_s)

    def current_weights(self, timeout_s: float = 600) -> dict:
        """The learners' current weights, packed (for a generator that restarted): ``{"weights": [ref], "version"}``."""
        return self._call({"weights_only": True}, timeout_s)

    def stop(self, timeout_s: float = 60) -> None:
        try:
            ray.get(self.channel.put.remote({"stop": True}), timeout=10)
        except Exception:  # the channel may already be gone after a failure
            pass
        self.thread.join(timeout=timeout_s)
