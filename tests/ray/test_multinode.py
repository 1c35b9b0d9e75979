"""The same training run across nodes: a simulated two-node cluster (two raylets on this
machine, ``ray.cluster_utils.Cluster``) with 2 generators on one node and 2 learner workers on
the other, placed by per-role custom resources. Its own driver process and cluster: the shared
test cluster is not involved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory) -> dict[str, dict]:
    """Both layouts, one after the other on one simulated cluster (its start is paid once)."""
    out_dir = tmp_path_factory.mktemp("multinode")
    env = {**ray_cluster["env"]}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.multinode_run", str(out_dir), "disaggregated", "colocated"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            layout, payload = line[len("RESULT ") :].split(" ", 1)
            results[layout] = json.loads(payload)
    return results


def test_two_generators_and_two_learners_on_separate_nodes_learn(runs):
    res = runs["disaggregated"]
    nodes = res["nodes"]
    assert len(nodes) == 2
    gen_nodes = set(res["placement"]["generators"])
    assert len(res["placement"]["generators"]) == 2 and gen_nodes == {
        n for n, r in nodes.items() if r == ["rollout_node"]
    }
    assert nodes[res["placement"]["learner_rank0"]] == ["trainer_node"]
    assert res["placement"]["layout"] == "disaggregated" and res["placement"]["generator_placement_group"]
    # Weights crossed the nodes every step: each batch was sampled by the previous step's policy,
    # verified on both generators against the learners' probe.
    assert res["versions"] == [0, 1, 2, 3, 4]
    assert all(g is not None and g < 1e-3 for g in res["probe_gaps"])
    assert all(n == 16 for n in res["learner_sequences"])  # 32 sequences split over 2 learners
    assert res["rewards"][-1] > res["rewards"][0] + 0.3, res["rewards"]


def test_colocated_layout_puts_each_generator_on_its_learners_node_and_learns(runs):
    res = runs["colocated"]
    placement = res["placement"]
    assert placement["layout"] == "colocated" and not placement["generator_placement_group"]
    # One learner per node (STRICT_SPREAD), and generator i on learner rank i's node.
    assert len(set(placement["learners"])) == 2 and set(placement["learners"]) == set(res["nodes"])
    assert placement["generators"] == placement["learners"]
    assert res["versions"] == [0, 1, 2, 3, 4]
    assert all(g is not None and g < 1e-3 for g in res["probe_gaps"])
    assert res["rewards"][-1] > res["rewards"][0] + 0.3, res["rewards"]
