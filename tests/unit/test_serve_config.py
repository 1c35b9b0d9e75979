"""The Serve config file in configs/serve/ is valid for `serve run` / `serve deploy` (Ray's own
schema) and every application's args are ones its builder accepts (no Ray started)."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_serve_config_file_is_valid():
    from ray.serve.schema import ServeDeploySchema

    from serving.policy import POLICY_ARGS
    from serving.scorer import scorer_spec_from_args

    raw = yaml.safe_load((ROOT / "configs" / "serve" / "apps.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert schema.http_options.host == "127.0.0.1"  # loopback unless the user changes it
    apps = {a.name: a for a in schema.applications}
    assert apps["policy"].import_path == "serving.policy:build_policy_app"
    assert set(apps["policy"].args) <= set(POLICY_ARGS)
    assert apps["scorer"].import_path == "serving.scorer:build_scorer_app"
    assert scorer_spec_from_args(dict(apps["scorer"].args["scorer"])).function == "reasoning_gym"


def test_builders_refuse_unknown_settings():
    from serving.policy import build_policy_app
    from serving.scorer import scorer_spec_from_args

    with pytest.raises(ValueError, match="unknown policy server settings"):
        build_policy_app({"model_path": "x", "max_tokenz": 5})
    with pytest.raises(ValueError, match="unknown scorer settings"):
        scorer_spec_from_args({"function": "reasoning_gym", "modell": "x"})
    with pytest.raises(ValueError, match="not a model folder"):
        build_policy_app({"model_path": "/nonexistent"})


def test_a_server_started_on_its_own_cluster_runs_rays_workers_at_the_daemons_priority_and_a_slower_control_loop(
        monkeypatch):
    """`rayrlhf serve` on a local cluster: Ray's worker niceness (15 by default) is set to 0 so the
    engine is not preempted by Ray's own daemons, and Serve's control loop runs every second, not
    every 0.1 s; values the user set are kept."""
    import os

    from serving.common import use_server_cluster_env

    for name in ("RAY_worker_niceness", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"):
        monkeypatch.delenv(name, raising=False)
    use_server_cluster_env()
    assert os.environ["RAY_worker_niceness"] == "0"
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "1"
    monkeypatch.setenv("RAY_worker_niceness", "5")
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    use_server_cluster_env()
    assert os.environ["RAY_worker_niceness"] == "5"
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"


def test_engine_metrics_through_ray_are_off_unless_asked_for(tiny_model_path):
    """Exporting the engine's metrics through Ray's metrics costs throughput (docs/benchmarks.md):
    off by default, on with ``engine_metrics``."""
    from serving.policy import llm_config

    assert llm_config(tiny_model_path).log_engine_metrics is False
    assert llm_config(tiny_model_path, engine_metrics=True).log_engine_metrics is True
