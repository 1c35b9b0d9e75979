"""Where the generators run: Ray scheduling options for each generator actor.

* disaggregated (default): the generators hold resources of their own, one placement-group
  bundle each ({CPU: rollout.cpus_per_generator, GPU: rollout.gpus_per_generator,
  **rollout.resources}) under
  ``rollout.placement_strategy``. The group is reserved before any generator starts, so a layout
  that cannot be placed fails at once with the settings named, not with actors pending forever.
  A restarted generator returns to its own bundle.
* colocated: generator i runs on the node of learner rank i (mod the learners) and requests no
  resources: it shares that learner's reservation, and generation and learning take turns on it
  (as in a hybrid engine). Learners are placed first (Ray Train's placement group, under
  ``cluster.learner_placement_strategy``), then their nodes decide the generators'.
"""

from __future__ import annotations

from typing import Any

import ray

from cluster.config import Config, UserError

# How long a placement group may take to be reserved before the run stops (seconds).
_RESERVE_TIMEOUT_S = 120.0


def generator_bundle(cfg: Config) -> dict[str, float]:
    """One generator's bundle: its CPUs, GPUs and custom resources (zero amounts left out)."""
    bundle = {
        "CPU": float(cfg.rollout.cpus_per_generator),
        "GPU": float(cfg.rollout.gpus_per_generator),
        **{k: float(v) for k, v in cfg.rollout.resources.items()},
    }
    return {k: v for k, v in bundle.items() if v > 0}


def colocated_options(num_generators: int, learner_nodes: list[str]) -> list[dict[str, Any]]:
    """Generator i on learner rank i's node (mod the learners), requesting nothing of its own."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return [
        {
            "num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(learner_nodes[i % len(learner_nodes)], soft=False),
        }
        for i in range(num_generators)
    ]


def reserve_generators(cfg: Config) -> tuple[Any, list[dict[str, Any]]]:
    """The generators' placement group (None when a bundle would be empty) and each generator's
    actor options. Raises UserError when the group cannot be reserved."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n, bundle = cfg.rollout.num_generators, generator_bundle(cfg)
    if not bundle:  # nothing to reserve (cpus_per_generator=0, no resources)
        return None, [{"num_cpus": 0} for _ in range(n)]
    strategy = cfg.rollout.placement_strategy
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name="")
    try:
        ray.get(pg.ready(), timeout=_RESERVE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise UserError(
            f"the generators' placement group ({n} bundles of {bundle}, {strategy}) could not be reserved in "
            f"{_RESERVE_TIMEOUT_S:.0f} s: the cluster has {ray.cluster_resources()} in {len(ray.nodes())} node(s); "
            "change rollout.num_generators, rollout.cpus_per_generator, rollout.resources or "
            "rollout.placement_strategy"
        ) from None
    resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return pg, [
        {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "resources": resources or None,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        }
        for i in range(n)
    ]


def release(pg: Any) -> None:
    """Returns a placement group's resources to the cluster (after its actors are gone)."""
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
