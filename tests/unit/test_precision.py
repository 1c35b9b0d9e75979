"""``auto`` precision: bf16 only where the device computes it natively (learners/training/precision.py)."""

import pytest

import learners.training.precision as precision
from cluster.config import ConfigError
from cluster.config.loading import load_config
from learners.training.precision import cpu_flags, resolve_bf16, resolve_engine_dtype
from tests.helpers.factories import make_learner

X86_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.fixture
def native(monkeypatch):
    """Sets what the CPU is said to support: ``native(True)`` or ``native(False)``."""

    def set_native(value: bool) -> None:
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: value)

    return set_native


def test_cpu_flags_find_native_bf16_on_x86_and_arm():
    assert "avx2" in cpu_flags(X86_AVX2) and not cpu_flags(X86_AVX2) & precision._BF16_CPU_FLAGS
    assert cpu_flags(X86_BF16) & precision._BF16_CPU_FLAGS == {"avx512_bf16", "amx_bf16"}
    assert cpu_flags(ARM_BF16) & precision._BF16_CPU_FLAGS == {"bf16"}
    assert cpu_flags("no flags here") == set()


@pytest.mark.parametrize("has_bf16", [False, True])
def test_auto_follows_the_cpu_and_explicit_values_stay(native, has_bf16):
    native(has_bf16)
    assert resolve_bf16("auto", "cpu") is has_bf16
    assert resolve_bf16(True, "cpu") is True and resolve_bf16(False, "cpu") is False
    assert resolve_engine_dtype("auto", uses_gpu=False) == ("bfloat16" if has_bf16 else "float32")
    assert resolve_engine_dtype("auto", uses_gpu=True) == "bfloat16"
    assert resolve_engine_dtype("float32", uses_gpu=True) == "float32"
    assert resolve_engine_dtype("bfloat16", uses_gpu=False) == "bfloat16"
    with pytest.raises(ValueError, match="auto"):
        resolve_bf16("maybe", "cpu")


@pytest.mark.parametrize("has_bf16", [False, True])
def test_the_config_resolves_the_generator_dtype_once_and_leaves_train_bf16_to_each_learner(native, has_bf16):
    native(has_bf16)
    cfg = load_config(overrides=["model.generator_dtype=auto", "train.bf16=auto"])
    assert cfg.model.generator_dtype == ("bfloat16" if has_bf16 else "float32")
    assert cfg.train.bf16 == "auto"
    gpu = load_config(overrides=["rollout.gpus_per_generator=1", "cluster.layout=disaggregated"])
    assert gpu.model.generator_dtype == "bfloat16"
    explicit = load_config(overrides=["model.generator_dtype=bfloat16", "train.bf16=off"])
    assert explicit.model.generator_dtype == "bfloat16" and explicit.train.bf16 is False
    # A resolved config reloads as it is (what a run directory's config.yaml holds).
    assert load_config(base=cfg.to_dict()).model.generator_dtype == cfg.model.generator_dtype


def test_train_bf16_accepts_true_false_and_auto_only():
    assert load_config(overrides=["train.bf16=yes"]).train.bf16 is True
    with pytest.raises(ConfigError, match=r"train\.bf16: .*must be true, false or 'auto'"):
        load_config(overrides=["train.bf16=maybe"])


@pytest.mark.parametrize("has_bf16", [False, True])
def test_a_learner_decides_auto_on_its_device_without_changing_the_callers_settings(native, tiny_model_path, has_bf16):
    from cluster.config import PPOConfig, TrainConfig
    from learners.base import LearnerContext
    from learners.ppo import PPOLearner

    native(has_bf16)
    train = TrainConfig(bf16="auto")
    learner = PPOLearner.build(LearnerContext(model_path=tiny_model_path), train, PPOConfig())
    assert learner.tr.bf16 is has_bf16 and train.bf16 == "auto"
    explicit = make_learner(tiny_model_path, train={"bf16": True})
    assert explicit.tr.bf16 is True


@pytest.mark.parametrize("has_bf16", [False, True])
def test_the_reference_holds_bf16_weights_only_where_auto_says_so(native, tiny_model_path, has_bf16):
    import torch

    from actors.reference import Reference

    native(has_bf16)
    ref = Reference(tiny_model_path, bf16="auto")
    assert ref.bf16 is has_bf16
    assert next(ref.model.parameters()).dtype == (torch.bfloat16 if has_bf16 else torch.float32)
