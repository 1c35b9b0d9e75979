"""Weight transports, learners -> generators, behind one interface (``rollout.weight_transport``).

* ``object_store`` (default; any cluster): learner rank 0 packs the weights into one flat buffer
  with its step reply and ``ray.put``s it; every generator reads it from the object store.
* ``collective``: learner rank 0 broadcasts the flat buffer to every generator over a process
  group of their own (``cluster/roles/collective.py``; ``rollout.collective_backend``: gloo through host
  memory, or NCCL GPU to GPU), in buckets of ``rollout.bucket_mb``; nothing goes
  through the object store. The group is made at the first sync and made again after any
  generator or learner restart (a group with a dead member cannot be used).

``sync(result, rollout, learners)`` runs after the learners' step and returns the generators'
load times, the policy version they now hold and the learner's probe log-probs (for
``RolloutGroup.verify_sync``).
"""

from __future__ import annotations

from typing import Any

import ray


class ObjectStoreTransport:
    name = "object_store"
    # The learners pack the weights into their step reply.
    packs_in_step = True

    def sync(self, result: dict, rollout: Any, learners: Any) -> dict[str, Any]:
        load = rollout.sync_weights(result["weights"][0], version=result["version"])
        return {"load_s": load, "version": result["version"], "probe": result.get("probe")}


class CollectiveTransport:
    name = "collective"
    packs_in_step = False

    def __init__(self, bucket_mb: int, backend: str = "gloo") -> None:
        self.bucket_bytes = int(bucket_mb) << 20
        self.backend = backend
        self.group: dict | None = None
        self._restarts = (0, 0)

    def _connect(self, rollout: Any, learners: Any) -> None:
        """Forms the group: learner rank 0 opens a store, the generators and it join."""
        world = len(rollout.generators) + 1
        self.group = learners.weights_group("open", world=world)
        joins = [
            g.join_weight_group.remote(self.group["host"], self.group["port"], i + 1, world, self.backend)
            for i, g in enumerate(rollout.generators)
        ]
        learners.weights_group("join", backend=self.backend)
        ray.get(joins)
        self._restarts = (rollout.restarts, learners.restarts)

    def sync(self, result: dict, rollout: Any, learners: Any) -> dict[str, Any]:
        if self.group is None or self._restarts != (rollout.restarts, learners.restarts):
            self._connect(rollout, learners)
        g = self.group
        receives = [
            gen.receive_weights.remote(g["layout"], g["dtype"], g["total"], result["version"], self.bucket_bytes)
            for gen in rollout.generators
        ]
        sent = learners.weights_group("broadcast", bucket_bytes=self.bucket_bytes)
        load = ray.get(receives)
        if sent["version"] != result["version"]:
            raise RuntimeError(f"broadcast policy version {sent['version']}, the step's is {result['version']}")
        rollout.version = sent["version"]
        return {
            "load_s": load,
            "version": sent["version"],
            "probe": sent.get("probe"),
            "sync/pack_s": sent["pack_s"],
            "sync/broadcast_s": sent["broadcast_s"],
            "sync/bytes": sent["bytes"],
        }


def make_transport(kind: str, bucket_mb: int = 64, backend: str = "gloo"):
    if kind == "object_store":
        return ObjectStoreTransport()
    if kind == "collective":
        return CollectiveTransport(bucket_mb, backend)
    raise ValueError(f"unknown weight transport {kind!r}")
