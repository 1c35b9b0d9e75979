"""The learner role's own settings (``LearnerSpec``, picked from the run's config) and how its Ray
Train worker group is shaped. Read by the driver side (``cluster/roles/learner_group.py``) and by every
rank (``cluster/roles/learner_worker.py``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from cluster.config import Config
from learners.base import LearnerContext, learner_target


@dataclass
class LearnerSpec:
    """Everything the learner workers need, and nothing else."""

    # Registered learner name (``learners.base.LEARNERS``) and its "module:Class", resolved on the
    # driver (a plugin's registration is not repeated in the workers' processes).
    algorithm: str
    learner_target: str
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
    # LoRA: syncs send the adapters' factors only (``learners/training/lora_sync.py``).
    adapter_sync: bool = False
    # Data-parallel workers, CPUs reserved by each, torch threads of each (0: every core).
    num_learners: int = 1
    cpus_per_learner: float = 1.0
    threads: int = 0
    # GPUs of each worker: 0 (CPU, gloo) or 1 (its CUDA device, NCCL).
    gpus_per_learner: int = 0
    # CPU workers start with ``KEEP_FREED_MEMORY_ENV`` (cluster/config/role_settings.py): glibc reuses
    # freed tensors' memory instead of faulting in fresh pages each micro-batch.
    keep_freed_memory: bool = True
    # Extra Ray resources of each worker (placement on the nodes that offer them).
    resources: dict = dataclasses.field(default_factory=dict)
    # Ray placement-group strategy of the workers' bundles.
    placement_strategy: str = "PACK"
    # Each update under real-time scheduling (``cluster/roles/realtime.py``), where permitted.
    realtime: bool = False
    # Restarts of the worker group Ray Train may make after a worker dies (``FailureConfig``).
    max_failures: int = 0
    # Token ids of the verified-sync probe: rank 0 answers every weight sync with the policy's
    # log-probs of them (empty: no probe).
    probe_ids: list[int] = dataclasses.field(default_factory=list)


def learner_spec(
    cfg: Config, model_path: str, pad_token_id: int, resume_from: str | None = None, probe_ids: list[int] | None = None
) -> LearnerSpec:
    """The learner's slice of the run's config: its recipe's learner and section."""
    from cluster.recipes import get_recipe

    recipe = get_recipe(cfg.run.algorithm)
    algo = cfg.section(recipe.section)
    if cfg.run.algorithm == "ppo" and algo.rollout_correction == "auto":
        # Asynchronous batches come from older weights: correct for them by default.
        algo = algo.model_copy(update={"rollout_correction": "truncate" if cfg.rollout.max_staleness > 0 else "none"})
    return LearnerSpec(
        algorithm=recipe.learner,
        learner_target=learner_target(recipe.learner),
        train=cfg.train,
        algo=algo,
        context=LearnerContext(
            model_path=model_path,
            seed=cfg.run.seed,
            total_steps=cfg.run.steps,
            temperature=cfg.rollout.temperature or 1.0,
            max_new_tokens=cfg.model.max_new_tokens,
            lora=cfg.lora if cfg.lora.enabled else None,
            dropout=cfg.model.dropout,
        ),
        resume_from=resume_from,
        tokenizer_path=model_path,
        pad_token_id=pad_token_id,
        sync_dtype=cfg.model.generator_dtype,
        num_learners=cfg.cluster.num_learners,
        adapter_sync=cfg.lora.enabled and cfg.lora.sync == "adapter",
        cpus_per_learner=cfg.cluster.cpus_per_learner,
        threads=cfg.cluster.threads,
        gpus_per_learner=cfg.cluster.gpus_per_learner,
        keep_freed_memory=cfg.cluster.keep_freed_memory,
        realtime=cfg.cluster.realtime_learners,
        max_failures=cfg.cluster.learner_max_failures,
        probe_ids=list(probe_ids or []),
        resources=dict(cfg.cluster.learner_resources),
        placement_strategy=cfg.cluster.learner_placement_strategy,
    )


def worker_scaling(spec: LearnerSpec) -> dict[str, Any]:
    """Ray Train's ``ScalingConfig`` arguments, the process-group backend of the workers (GPU
    workers reduce with NCCL, CPU workers with gloo: the same learner code either way; GPU
    workers whose shards live in host memory, ``train.cpu_offload``, both: NCCL for CUDA tensors,
    gloo for the host ones, such as the gradient norm over offloaded shards) and the
    environment variables the workers start with."""
    from cluster.config.role_settings import KEEP_FREED_MEMORY_ENV

    gpus = {"GPU": float(spec.gpus_per_learner)} if spec.gpus_per_learner else {}
    return {
        "scaling": {
            "num_workers": spec.num_learners,
            "use_gpu": bool(spec.gpus_per_learner),
            "resources_per_worker": {"CPU": spec.cpus_per_learner, **spec.resources, **gpus},
            "placement_strategy": spec.placement_strategy,
        },
        "backend": (
            "gloo"
            if not spec.gpus_per_learner
            else "cpu:gloo,cuda:nccl"
            if getattr(spec.train, "cpu_offload", False)
            else "nccl"
        ),
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
