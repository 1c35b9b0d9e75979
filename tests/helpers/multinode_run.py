"""A tiny PPO run on a simulated two-node cluster (``ray.cluster_utils.Cluster``: two raylets on
this machine). Layout ``disaggregated``: generators placed on one node and learners on the other
by custom resources. Layout ``colocated``: one learner per node (STRICT_SPREAD) and each
generator on its learner's node, sharing its reservation. Run as a script (its own driver and
cluster; the layouts given run one after another on the same cluster); prints
``RESULT <layout> <json>`` with each run's outcome.

    python -m tests.helpers.multinode_run OUT_DIR disaggregated colocated
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


LAYOUTS = {
    "disaggregated": ["rollout.resources={rollout_node: 1}", "cluster.learner_resources={trainer_node: 1}"],
    "colocated": ["cluster.layout=colocated", "cluster.learner_placement_strategy=STRICT_SPREAD"],
}


def main(out_dir: str, layouts: list[str]) -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"rollout_node": 2}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=3, resources={"trainer_node": 2})
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address)
        for layout in layouts:
            print(f"RESULT {layout} " + json.dumps(_run(out_dir, layout)), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _run(out_dir: str, layout: str) -> dict:
    import ray

    from cluster.config.loading import load_config
    from cluster.driver import train

    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            "rollout.num_generators=2",
            "cluster.num_learners=2",
            *LAYOUTS[layout],
            "cluster.threads=1",
            "rollout.threads=1",
            "run.steps=5",
            f"run.output_dir={out_dir}",
            f"run.name=multinode-{layout}",
            "run.plot=false",
            "cluster.metrics_export=false",
        ],
    )
    result = train(cfg)
    nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if k.endswith("_node")) for n in ray.nodes()}
    placement = json.loads((result.run_dir / "placement.json").read_text())
    return {
        "run_dir": str(result.run_dir),
        "nodes": nodes,
        "placement": placement,
        "rewards": [r["reward/mean"] for r in result.history if r["step"] > 0],
        "versions": [r["generate/policy_version"] for r in result.history if r["step"] > 0],
        "probe_gaps": [r.get("sync/probe_gap") for r in result.history if r["step"] > 0],
        "learner_sequences": [r.get("learner/local_sequences") for r in result.history if r["step"] > 0],
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(LAYOUTS))
