from pathlib import Path

import pytest

from cluster.config import Config, ConfigError, config_help, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_documented():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.cluster.dashboard_host == "127.0.0.1"
    assert cfg.model.trust_remote_code is False
    text = config_help()
    # Every field carries a help string.
    for line in text.splitlines():
        if line.startswith("      "):
            assert line.strip(), "empty help string"
    assert "kl_coef" in text and "beta" in text


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_presets_validate(preset):
    cfg = load_config(ROOT / "configs" / preset)
    assert cfg.run.steps >= 1


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("ppo:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="ppo.learning_rate"):
        load_config(f)
    with pytest.raises(ConfigError, match="'bogus'"):
        load_config(overrides=["bogus.x=1"])


def test_types_are_checked_and_coerced():
    cfg = load_config(overrides=["ppo.lr=3e-4", "run.steps=7", "ppo.bf16=false", "data.task_kwargs={\"min_terms\": 3}"])
    assert cfg.ppo.lr == pytest.approx(3e-4) and cfg.run.steps == 7 and cfg.ppo.bf16 is False
    assert cfg.data.task_kwargs == {"min_terms": 3}
    with pytest.raises(ConfigError, match="run.steps"):
        load_config(overrides=["run.steps=many"])
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_config(overrides=["ppo.micro_batch_size=64", "ppo.minibatch_size=8"])
    with pytest.raises(ConfigError, match="must look like"):
        load_config(overrides=["run.steps"])


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f)
