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
