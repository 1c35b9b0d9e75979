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


def learner_spec(cfg: Config, model_path: str, pad_token_id: int, resume_from: str | None = None) -> LearnerSpec:
    """The learner's slice of the run's config."""
    return LearnerSpec(
        algorithm=cfg.run.algorithm, train=cfg.train, algo=getattr(cfg, cfg.run.algorithm),
        context=LearnerContext(
            model_path=model_path, seed=cfg.run.seed, total_steps=cfg.run.steps,
            temperature=cfg.rollout.temperature or 1.0, max_new_tokens=cfg.model.max_new_tokens,
            lora=cfg.lora if cfg.lora.enabled else None,
        ),
        resume_from=resume_from, tokenizer_path=model_path, pad_token_id=pad_token_id,
        sync_dtype=cfg.model.generator_dtype, num_learners=cfg.cluster.num_learners,
        cpus_per_learner=cfg.cluster.cpus_per_learner, threads=cfg.cluster.threads,
    )


def learner_loop(config: dict[str, Any]) -> None:
    """The Ray Train worker function (runs on every rank)."""
    import torch

    from cluster.actor_groups import peak_rss_gb
    from cluster.weight_sync import pack
    from learners.base import get_learner
    from learners.distributed import default_collective
    from learners.experience import Experience

    spec: LearnerSpec = config["spec"]
    channel = config["channel"]
    comm = default_collective()
    rank = comm.rank
    # Ray sets OMP_NUM_THREADS to the reserved CPUs; learners run in their own phase and may use the node.
    torch.set_num_threads(spec.threads or os.cpu_count() or 1)
    ctx = dataclasses.replace(spec.context, comm=comm)
    learner = get_learner(spec.algorithm).build(ctx, spec.train, spec.algo)
    if spec.resume_from:
        learner.restore(spec.resume_from)
    if rank == 0:
        ray.get(channel.report.remote({
            "ready": True, "world": comm.world, "trainable_fraction": learner.trainable_fraction,
            "version": learner.version,
        }))
    while True:
        item = ray.get(channel.get.remote(rank))
        if item.get("stop"):
            break
        step = item["step"]
        if item.get("save_only"):  # a checkpoint outside a step (early stopping)
            if rank == 0:
                learner.save(item["save_dir"], tokenizer_from=spec.tokenizer_path)
                ray.get(channel.report.remote({"step": step, "saved": item["save_dir"], "version": learner.version}))
            continue
        try:
            parts = ray.get(item["exp_refs"])
            batch = Experience.concat(parts, pad_token_id=spec.pad_token_id)
            if item.get("evaluate"):
                # Held-out metrics only: no update, no weights.
                reply: dict[str, Any] = {"step": step, "metrics": learner.evaluate(batch), "version": learner.version}
                if rank == 0:
                    ray.get(channel.report.remote(reply))
                continue
            # Every rank gets the global batch and takes its own rows inside the learner.
            metrics = learner.train_step(batch)
            peak = torch.tensor([peak_rss_gb()], dtype=torch.float64)
            if comm.world > 1:
                torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            metrics["memory/learner_peak_gb"] = float(peak)
            reply = {"step": step, "metrics": metrics, "version": learner.version}
            if rank == 0:
                if item.get("sync", True):
                    t0 = time.perf_counter()
                    with learner.policy_weights() as weights:
                        packed = pack(weights, spec.sync_dtype, version=learner.version)
                    reply["weights"] = [ray.put(packed)]
                    reply["metrics"]["sync/pack_s"] = time.perf_counter() - t0
                    reply["metrics"]["sync/bytes"] = float(packed.nbytes)
                if item.get("save_dir"):
                    learner.save(item["save_dir"], tokenizer_from=spec.tokenizer_path)
                    reply["saved"] = item["save_dir"]
        except Exception as e:  # surface the error to the driver instead of hanging it
            log.exception("learner step %s failed", step)
            if rank == 0:
                ray.get(channel.report.remote({"step": step, "error": repr(e)}))
            raise
        if rank == 0:
            ray.get(channel.report.remote(reply))
        # A compact subset: Ray Train logs every report, the full set goes to the run's JSONL.
        ray.train.report({k: round(metrics[k], 6) for k in _REPORTED if k in metrics})


class LearnerGroup:
    """Driver-side handle: start once, ``learn(step, exp_refs)`` per iteration, ``stop()``."""

    def __init__(self, spec: LearnerSpec, storage_dir: Path) -> None:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        self.spec = spec
        n = spec.num_learners
        self.channel = LearnerChannel.remote(n)
        self.trainer = TorchTrainer(
            learner_loop,
            train_loop_config={"spec": spec, "channel": self.channel},
            scaling_config=ScalingConfig(
                num_workers=n, use_gpu=False, resources_per_worker={"CPU": spec.cpus_per_learner}
            ),
            torch_config=TorchConfig(backend="gloo"),
            # A fresh name per start: Ray Train would otherwise treat a resumed run's learners as a
            # restart of the old Train run. The run's own checkpoints are what a resume reads.
            run_config=RunConfig(name=f"learner-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
                                 storage_path=str(Path(storage_dir).resolve())),
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fit, name="rayrlhf-learner", daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as e:  # kept for the driver, which re-raises it with context
            self.error = e

    def _result(self, timeout_s: float) -> dict:
        ref = self.channel.result.remote()
        deadline = time.time() + timeout_s
        while True:
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                item = ray.get(ref)
                if "error" in item:
                    raise RuntimeError(f"learner failed at step {item.get('step')}: {item['error']}")
                return item
            if not self.thread.is_alive():
                raise RuntimeError(f"learner group stopped: {self.error!r}")
            if time.time() > deadline:
                raise TimeoutError(f"no answer from the learners after {timeout_s:.0f}s")

    def wait_ready(self, timeout_s: float = 600) -> dict:
        return self._result(timeout_s)

    def learn(self, step: int, exp_refs: list, save_dir: str | None = None, sync: bool = True,
              timeout_s: float = 3600) -> dict:
        """One update; ``sync=False`` skips packing weights for generators (offline recipes)."""
        self.channel.put.remote({"step": step, "exp_refs": list(exp_refs), "save_dir": save_dir, "sync": sync})
        return self._result(timeout_s)

    def save(self, step: int, save_dir: str, timeout_s: float = 600) -> dict:
        """Writes a checkpoint of the learners' current state (no update)."""
        self.channel.put.remote({"step": step, "save_dir": save_dir, "save_only": True})
        return self._result(timeout_s)

    def evaluate(self, step: int, exp_refs: list, timeout_s: float = 3600) -> dict[str, float]:
        """The learners' held-out metrics on a batch (``Learner.evaluate``), no update."""
        self.channel.put.remote({"step": step, "exp_refs": list(exp_refs), "evaluate": True})
        return self._result(timeout_s)["metrics"]

    def stop(self, timeout_s: float = 60) -> None:
        try:
            ray.get(self.channel.put.remote({"stop": True}), timeout=10)
        except Exception:  # the channel may already be gone after a failure
            pass
        self.thread.join(timeout=timeout_s)
