import json
from pathlib import Path

import pytest

from cluster.config import MOVED_KEYS, Config, ConfigError
from cluster.config.help import config_help, config_schema
from cluster.config.loading import check_resume_compatible, load_config, stage_configs

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_documented():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.cluster.dashboard_host == "127.0.0.1"
    assert cfg.model.trust_remote_code is False
    # The default update is the on-policy single update.
    assert cfg.train.epochs == 1 and cfg.train.num_minibatches == 1
    text = config_help()
    # Every field carries a help string.
    for line in text.splitlines():
        if line.startswith("      "):
            assert line.strip(), "empty help string"
    assert "kl_coef" in text and "beta" in text
    assert "train:" in text and "num_minibatches" in text


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_presets_validate(preset):
    # The distillation preset's teacher is a model folder the user names (its preset says how).
    needs = {"distill_smollm2.yaml": ["ppo.teacher=runs/teacher/checkpoints/step_00030"]}
    cfg = load_config(ROOT / "configs" / preset, needs.get(preset, []))
    assert cfg.run.steps >= 1
    if preset in needs:
        with pytest.raises(ConfigError, match="ppo.teacher"):
            load_config(ROOT / "configs" / preset)


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("ppo:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="ppo.learning_rate") as info:
        load_config(f)
    # The message lists what the section does accept.
    assert "valid keys" in str(info.value) and "clip_eps" in str(info.value)
    with pytest.raises(ConfigError, match="'bogus'"):
        load_config(overrides=["bogus.x=1"])
    with pytest.raises(ConfigError, match="train.learning_rate.*valid keys"):
        load_config(overrides=["train.learning_rate=0.1"])


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_moved_keys_say_where_they_went(tmp_path, old):
    section, key = old.split(".")
    value = {"rollout.truncation": "mask", "reward.clip": 5.0}.get(old, 1)
    f = tmp_path / "old.yaml"
    f.write_text(f"{section}:\n  {key}: {json.dumps(value)}\n")
    new = MOVED_KEYS[old].split()[0]
    with pytest.raises(ConfigError, match="has moved to") as info:
        load_config(f)
    assert repr(old) in str(info.value) and new in str(info.value)
    # The same through a command-line override.
    with pytest.raises(ConfigError, match=f"{old!r} has moved to {new}"):
        load_config(overrides=[f"{old}={json.dumps(value)}"])


def test_moved_keys_work_in_their_new_place():
    cfg = load_config(
        overrides=[
            "train.lr=3e-4",
            "train.num_minibatches=2",
            "ppo.reward_clip=5",
            "ppo.truncation=mask",
            "ppo.truncation_penalty=-0.5",
        ]
    )
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.train.num_minibatches == 2
    assert cfg.ppo.reward_clip == 5.0 and cfg.ppo.truncation == "mask" and cfg.ppo.truncation_penalty == -0.5


def test_types_are_checked_and_coerced():
    cfg = load_config(
        overrides=["train.lr=3e-4", "run.steps=7", "train.bf16=false", 'data.task_kwargs={"min_terms": 3}']
    )
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.run.steps == 7 and cfg.train.bf16 is False
    assert cfg.data.task_kwargs == {"min_terms": 3}
    with pytest.raises(ConfigError, match="run.steps"):
        load_config(overrides=["run.steps=many"])
    # More minibatches than sequences in a step (16 prompts x 1 sample by default).
    with pytest.raises(ConfigError, match="train.num_minibatches"):
        load_config(overrides=["train.num_minibatches=64"])
    assert load_config(overrides=["train.num_minibatches=16"]).train.num_minibatches == 16
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config(overrides=["train.epochs=0"])
    with pytest.raises(ConfigError, match="ppo.advantage_estimator"):
        load_config(overrides=["ppo.advantage_estimator=sarsa"])
    with pytest.raises(ConfigError, match="samples_per_prompt"):
        load_config(overrides=["ppo.advantage_estimator=grpo", "rollout.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="must look like"):
        load_config(overrides=["run.steps"])
    # In-flight weight updates need a generation running when the weights sync: asynchronous PPO.
    with pytest.raises(ConfigError, match="rollout.inflight_updates needs.*max_staleness > 0"):
        load_config(overrides=["rollout.inflight_updates=true"])
    assert load_config(overrides=["rollout.inflight_updates=true", "rollout.max_staleness=1"]).rollout.inflight_updates
    # Sharded learners: every built-in learner, not compiled layers (one clear line).
    assert load_config(overrides=["train.sharding=fsdp"]).train.sharding == "fsdp"
    assert load_config(overrides=["train.sharding=fsdp", "run.algorithm=reward_model", "dpo.pairs=scorer"])
    with pytest.raises(ConfigError, match="train.sharding=fsdp is built for .*, without train.compile"):
        load_config(overrides=["train.sharding=fsdp", "train.compile=true"])
    # Offloading shards to host memory is for sharded GPU learners: CPU learners are there already.
    with pytest.raises(
        ConfigError, match="train.cpu_offload .* needs train.sharding=fsdp and cluster.gpus_per_learner > 0"
    ):
        load_config(overrides=["train.sharding=fsdp", "train.cpu_offload=true"])
    with pytest.raises(ConfigError, match="train.cpu_offload .* needs train.sharding=fsdp"):
        load_config(overrides=["train.cpu_offload=true", "cluster.gpus_per_learner=1"])
    # The learners' own reference is the initial model: a distillation teacher stays in its actor.
    assert load_config(overrides=["train.reference=learners"]).train.reference == "learners"
    with pytest.raises(ConfigError, match="ppo.teacher needs train.reference=actor"):
        load_config(overrides=["train.reference=learners", "ppo.teacher=/x", "ppo.distill_coef=1"])


def test_algorithm_must_be_a_registered_recipe():
    assert load_config(overrides=["run.algorithm=ppo"]).run.algorithm == "ppo"
    with pytest.raises(ConfigError, match="run.algorithm must be one of dpo, ppo, qlearn, reward_model, sft"):
        load_config(overrides=["run.algorithm=kto"])
    with pytest.raises(ConfigError, match="dpo.candidates"):
        load_config(overrides=["run.algorithm=dpo", "dpo.candidates=1"])
    with pytest.raises(ConfigError, match="dpo.pairs=spin makes its own pairs"):
        load_config(overrides=["run.algorithm=dpo", "dpo.pairs=spin", "data.preference_file=p.jsonl"])
    assert load_config(overrides=["run.algorithm=dpo"]).dpo.candidates == 4
    cfg = load_config(
        overrides=[
            "run.algorithm=dpo",
            "data.preference_file=p.jsonl",
            "dpo.pairs_per_step=4",
            "train.num_minibatches=4",
        ]
    )
    assert cfg.dpo.pairs_per_step == 4
    with pytest.raises(ConfigError, match="4 pairs per step"):
        load_config(
            overrides=[
                "run.algorithm=dpo",
                "data.preference_file=p.jsonl",
                "dpo.pairs_per_step=4",
                "train.num_minibatches=5",
            ]
        )


def test_lora_target_modules_from_the_command_line_is_a_list(capsys):
    cfg = load_config(overrides=["lora.target_modules=q_proj,v_proj"])
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(overrides=["lora.target_modules=[q_proj, o_proj]"]).lora.target_modules == ["q_proj", "o_proj"]
    assert load_config(overrides=["lora.target_modules= q_proj , v_proj "]).lora.target_modules == ["q_proj", "v_proj"]
    # The CLI's --set goes the same way.
    from cluster.cli import main

    assert (
        main(["validate", str(ROOT / "configs" / "ppo_tiny.yaml"), "--set", "lora.target_modules=q_proj,v_proj"]) == 0
    )
    assert "config OK" in capsys.readouterr().out


def test_schema_is_json_naming_every_section(capsys):
    schema = json.loads(config_schema())
    assert set(schema["properties"]) == {
        "run",
        "model",
        "data",
        "reward",
        "rollout",
        "env",
        "train",
        "ppo",
        "dpo",
        "sft",
        "qlearn",
        "reward_model",
        "judge",
        "lora",
        "cluster",
        "stages",
    }
    defs = schema["$defs"]
    assert {"TrainConfig", "PPOConfig"} <= set(defs)
    train = defs["TrainConfig"]["properties"]
    assert {"lr", "num_minibatches", "micro_batch_size", "shared_prefix"} <= set(train)
    assert "minibatch_size" not in train and "lr" not in defs["PPOConfig"]["properties"]
    assert train["num_minibatches"]["description"]
    # ... and `rayrlhf config --schema` prints it.
    from cluster.cli import main

    assert main(["config", "--schema"]) == 0
    assert json.loads(capsys.readouterr().out) == schema


def test_resume_refuses_what_a_checkpoint_cannot_carry():
    saved = load_config(overrides=["model.path=tiny", "run.steps=10"])
    # More steps (and other run settings) are fine.
    check_resume_compatible(saved, load_config(overrides=["model.path=tiny", "run.steps=50", "train.lr=1e-5"]))
    with pytest.raises(ConfigError, match="model.path"):
        check_resume_compatible(saved, load_config(overrides=["model.path=smollm2-135m", "run.steps=10"]))
    with pytest.raises(ConfigError, match="ppo.advantage_estimator"):
        check_resume_compatible(
            saved,
            load_config(overrides=["model.path=tiny", "ppo.advantage_estimator=grpo", "rollout.samples_per_prompt=4"]),
        )
    # The adapter's shape matters only where there is an adapter.
    check_resume_compatible(saved, load_config(overrides=["model.path=tiny", "lora.r=8"]))
    with pytest.raises(ConfigError, match="lora.enabled"):
        check_resume_compatible(saved, load_config(overrides=["model.path=tiny", "lora.enabled=true"]))
    saved_lora = load_config(overrides=["model.path=tiny", "lora.enabled=true"])
    with pytest.raises(ConfigError, match="lora.r"):
        check_resume_compatible(saved_lora, load_config(overrides=["model.path=tiny", "lora.enabled=true", "lora.r=8"]))


def test_load_config_leaves_its_base_untouched():
    base = {"run": {"steps": 5}}
    assert load_config(overrides=["run.steps=9"], base=base).run.steps == 9
    assert base == {"run": {"steps": 5}}


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f)


def test_judge_section_checked_when_loading():
    cfg = load_config(overrides=["judge.samples=2", "judge.max_score=10"])
    assert cfg.judge_config().samples == 2 and cfg.judge_config().max_score == 10
    with pytest.raises(ConfigError, match="capturing group"):
        load_config(overrides=["judge.score_pattern='Score: \\d+'"])
    with pytest.raises(ConfigError, match="must contain {response}"):
        load_config(overrides=["judge.template=Rate {prompt}"])


def test_stages_each_validated_with_their_changes():
    cfg = load_config(
        overrides=[
            "stages=[{name: sft, set: {run.algorithm: sft, run.steps: 3}}, "
            "{name: dpo1, set: {run.algorithm: dpo, dpo.pairs: self_judge}}]"
        ]
    )
    (n0, c0), (n1, c1) = stage_configs(cfg)
    assert (n0, c0.run.algorithm, c0.run.steps, c0.run.name) == ("sft", "sft", 3, "sft")
    assert (n1, c1.run.algorithm, c1.dpo.pairs, c1.run.steps) == ("dpo1", "dpo", "self_judge", cfg.run.steps)
    assert not c0.stages and not c1.stages
    with pytest.raises(ConfigError, match=r"stages\[1\] \(b\): unknown config key 'dpo.beta2'"):
        load_config(overrides=["stages=[{name: a, set: {}}, {name: b, set: {dpo.beta2: 1}}]"])
    with pytest.raises(ConfigError, match=r"stages\[0\] \(a\): run.algorithm must be one of"):
        load_config(overrides=["stages=[{name: a, set: {run.algorithm: kto}}]"])
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(overrides=["stages=[{name: a}, {name: a}]"])
    with pytest.raises(ConfigError, match="unknown config key 'stages.0.sett'"):
        load_config(overrides=["stages=[{name: a, sett: {}}]"])


@pytest.mark.parametrize(
    "sets, message",
    [
        (["env.tools=[calculator,nosuchtool]"], "env.tools is set but not read with no episodes run"),
        (["env.max_turns=3"], "env.max_turns is set but not read with no episodes run"),
        (
            ["env.name=tool_use", "env.openenv.action_field=text"],
            "env.openenv is set but not read with env.name=tool_use",
        ),
        (
            ["env.name=guess_number", "env.max_tool_calls=2"],
            "env.max_tool_calls is set but not read with env.name=guess_number",
        ),
        (
            ["env.name=http://127.0.0.1:1", "env.args={a: 1}"],
            "env.args is set but not read with env.name=http://127.0.0.1:1",
        ),
        (
            ["rollout.agent=tests.helpers.agents:three_turns", "env.tool_timeout_s=3"],
            "env.tool_timeout_s is set but not read with rollout.agent",
        ),
        (["rollout.agent_models=[gpt-4o]"], "rollout.agent_models is set but no agent program runs"),
    ],
)
def test_settings_nothing_would_read_are_refused_in_one_line(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Path(__file__).resolve().parents[2] / "configs" / "ppo_tiny.yaml", sets)


def test_settings_their_episodes_read_are_accepted():
    root = Path(__file__).resolve().parents[2] / "configs" / "ppo_tiny.yaml"
    load_config(root, ["env.name=tool_use", "env.tools=[calculator,python]", "env.max_tool_calls=2"])
    load_config(root, ["env.name=http://127.0.0.1:1", "env.openenv.reset_fields=prompt", "env.step_timeout_s=5"])
    load_config(
        root, ["rollout.agent=tests.helpers.agents:three_turns", "env.max_turns=3", "rollout.agent_models=[gpt-4o]"]
    )
