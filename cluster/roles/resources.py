"""What a run's roles ask of the cluster, checked before any role starts.

Ray queues a request that no node can meet and Ray Train retries its worker group forever, so an
over-asking run would hang. The check compares the roles' CPU claims with the cluster's total
(and each role with the largest node), and their GPU and custom resource claims with the
cluster's totals, and ends the run at once with a message naming both.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import Config, UserError


@dataclass(frozen=True)
class RoleRequest:
    # Role name as the message shows it, e.g. "generator".
    role: str
    # Actors (or Train workers) of this role.
    count: int
    # Ray CPUs each one reserves.
    cpus: float
    # The config key that sets ``cpus``.
    key: str
    # Custom Ray resources each one requests (name -> amount).
    resources: tuple[tuple[str, float], ...] = ()


def role_requests(cfg: Config) -> list[RoleRequest]:
    """The roles the run may hold at once, as its recipe declares them (``Recipe.roles``; an upper
    bound: a DPO run's reference scores before the generators start, but both are counted)."""
    from cluster.recipes import get_recipe

    declared = get_recipe(cfg.run.algorithm).roles(cfg)
    # Colocated generators share their learner's reservation: they request nothing of their own.
    colocated = cfg.cluster.layout == "colocated"
    gen_resources = {**cfg.rollout.resources, **_gpus(cfg.rollout.gpus_per_generator)}
    out = []
    if declared.generators:
        out.append(
            RoleRequest(
                "generator",
                cfg.rollout.num_generators,
                0.0 if colocated else cfg.rollout.cpus_per_generator,
                "rollout.cpus_per_generator",
                () if colocated else tuple(gen_resources.items()),
            )
        )
    if declared.scorer:
        out.append(RoleRequest("scorer", 1, cfg.reward.cpus, "reward.cpus"))
    if declared.reference in ("rollout", "data"):
        out.append(
            RoleRequest(
                "reference",
                1,
                cfg.cluster.cpus_per_reference,
                "cluster.cpus_per_reference",
                tuple(_gpus(cfg.cluster.gpus_per_reference).items()),
            )
        )
    if not declared.learners:
        return out
    learner_resources = {**cfg.cluster.learner_resources, **_gpus(cfg.cluster.gpus_per_learner)}
    out.append(
        RoleRequest(
            "learner",
            cfg.cluster.num_learners,
            cfg.cluster.cpus_per_learner,
            "cluster.cpus_per_learner",
            tuple(learner_resources.items()),
        )
    )
    return out


def _gpus(amount: float) -> dict[str, float]:
    """A role's GPU claim as a Ray resource (none when it runs on the CPU)."""
    return {"GPU": float(amount)} if amount > 0 else {}


def check_fits(requests: list[RoleRequest], node_cpus: list[float], custom: dict[str, float] | None = None) -> None:
    """Raises UserError when the roles cannot all be placed: their CPUs exceed the cluster's, one
    role's claim exceeds every node's, or a custom resource they ask for is missing or short.
    ``node_cpus``: the CPUs of each alive node; ``custom``: the cluster's total of every other
    resource."""
    total = sum(r.count * r.cpus for r in requests)
    have = sum(node_cpus)
    asked = ", ".join(f"{r.role} {r.count} x {r.cpus:g}" if r.count > 1 else f"{r.role} {r.cpus:g}" for r in requests)
    nodes = f"{len(node_cpus)} node{'s' if len(node_cpus) != 1 else ''}"
    if total > have + 1e-9:
        keys = ", ".join(sorted({r.key for r in requests if r.cpus > 0}))
        raise UserError(
            f"the roles ask for {total:g} CPUs ({asked}) but the cluster has {have:g} CPUs ({nodes}); "
            f"lower {keys} (a role's CPUs are a placement claim; its threads are set apart) or add nodes"
        )
    largest = max(node_cpus, default=0.0)
    for r in requests:
        if r.cpus > largest + 1e-9:
            raise UserError(f"a {r.role} asks for {r.cpus:g} CPUs ({r.key}) but the largest node has {largest:g}")
    wanted: dict[str, float] = {}
    for r in requests:
        for name, amount in r.resources:
            wanted[name] = wanted.get(name, 0.0) + r.count * amount
    custom = custom or {}
    for name, amount in wanted.items():
        if amount > custom.get(name, 0.0) + 1e-9:
            who = ", ".join(
                f"{r.role} {r.count} x {dict(r.resources)[name]:g}" for r in requests if name in dict(r.resources)
            )
            raise UserError(
                f"the roles ask for {amount:g} of the resource {name!r} ({who}) but the cluster has "
                f"{custom.get(name, 0.0):g}"
            )


def cluster_node_cpus() -> list[float]:
    """CPUs of every alive node of the connected cluster."""
    import ray

    return [float(n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n.get("Alive")]


def cluster_resources() -> dict[str, float]:
    """The connected cluster's total of every resource."""
    import ray

    return {k: float(v) for k, v in ray.cluster_resources().items()}
