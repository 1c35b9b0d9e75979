"""Each role's own settings, picked from the run's config (a role receives what it needs, not
the whole config), and the environment its Ray process starts with."""

from __future__ import annotations

import os

from actors.agents.environments import EnvSpec, EpisodeLimits
from actors.rollout.generator import GeneratorConfig
from actors.reference import ReferenceConfig
from actors.rewards.remote import RemoteSettings
from actors.rewards.scorer_factory import ScorerSpec
from cluster.config import Config


def _threads(n: int) -> int:
    return n or os.cpu_count() or 1


def generator_config(
    cfg: Config, model_path: str, rank: int = 0, initial_version: int = 0, base_model: str = ""
) -> GeneratorConfig:
    """The generator's own settings, picked from the run's config. ``base_model``: the learners'
    base model folder, into which LoRA adapter syncs are merged (``model_path`` may be a
    checkpoint to continue from)."""
    return GeneratorConfig(
        model_path=model_path,
        dtype=cfg.model.generator_dtype,
        max_prompt_tokens=cfg.model.max_prompt_tokens,
        max_new_tokens=cfg.model.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
        seed=cfg.run.seed * 1000 + rank,
        kv_cache_gib=cfg.rollout.kv_cache_gib,
        threads=cfg.rollout.threads,
        first_core=rank * cfg.rollout.threads,
        system_prompt=cfg.data.system_prompt,
        chat_template=cfg.data.chat_template,
        trust_remote_code=cfg.model.trust_remote_code,
        initial_version=initial_version,
        max_model_len=cfg.judge.max_prompt_tokens + cfg.judge.max_new_tokens if uses_judge(cfg) else 0,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization if cfg.rollout.gpus_per_generator > 0 else 0.0,
        compile=cfg.rollout.compile,
        capture_routes=cfg.train.routing_replay != "none",
        lora_base=(base_model or model_path) if cfg.lora.enabled and cfg.lora.sync == "adapter" else "",
        **episode_settings(cfg),
    )


def episode_settings(cfg: Config) -> dict:
    """The generator's multi-turn settings (none without ``env.name``)."""
    env = cfg.env
    if not (env.name or cfg.rollout.agent):
        return {}
    limits = EpisodeLimits(
        max_turns=env.max_turns,
        max_tokens=env.episode_tokens(cfg.model.max_prompt_tokens, cfg.model.max_new_tokens),
        max_new_tokens=cfg.model.max_new_tokens,
        step_timeout_s=env.step_timeout_s,
    )
    if cfg.rollout.agent or env.name.startswith("verifiers:"):  # an agent program: yours, or a verifiers rollout
        return {
            "agent": cfg.rollout.agent or env.name,
            "agent_args": dict(env.args),
            "agent_timeout_s": cfg.rollout.agent_timeout_s,
            "episode_limits": limits,
            "agent_models": tuple(cfg.rollout.agent_models),
            "env_workers": env.workers,
        }
    spec = EnvSpec(
        name=env.name,
        args=dict(env.args),
        verifier=cfg.reward.function,
        verifier_kwargs=dict(cfg.reward.kwargs),
        tools=list(env.tools),
        max_tool_calls=env.max_tool_calls,
        tool_timeout_s=env.tool_timeout_s,
        python_sandbox=env.python_sandbox,
        python_packages=list(env.python_packages),
        sandbox_tools=list(env.sandbox_tools),
        openenv=env.openenv.model_dump(),
        step_timeout_s=env.step_timeout_s,
    )
    return {"environment": spec, "episode_limits": limits, "env_workers": env.workers}


def uses_judge(cfg: Config) -> bool:
    """Whether the generators also judge (they then need the judge's longer context)."""
    return self_judging(cfg) or (cfg.run.algorithm == "dpo" and cfg.dpo.pairs == "self_judge")


def self_judging(cfg: Config) -> bool:
    """reward.function=llm_judge without a judge model: the policy judges its samples on the generators."""
    return cfg.reward.function == "llm_judge" and not cfg.reward.model


def reward_routes(cfg: Config) -> dict[str | None, list[tuple[str, float, dict]]]:
    """``reward.components`` (every row: key None) or ``reward.by_source``, as the routes of
    ``actors/rewards/routing.py``."""
    r = cfg.reward
    as_tuples = lambda comps: [(c.function, c.weight, dict(c.kwargs)) for c in comps]  # noqa: E731
    return {None: as_tuples(r.components)} if r.components else {k: as_tuples(v) for k, v in r.by_source.items()}


def scorer_spec(cfg: Config) -> ScorerSpec:
    """The scorer role's own settings, picked from the run's config."""
    r = cfg.reward
    # With episodes the environment's rewards are the scores (reward.function checks answers inside it).
    spec = ScorerSpec(
        function="environment" if cfg.env.name or cfg.rollout.agent else r.function,
        kwargs=dict(r.kwargs),
        on_error=r.on_error,
        model=r.model,
        batch_size=r.batch_size,
        max_tokens=cfg.model.max_prompt_tokens + cfg.model.max_new_tokens + 8,
        system_prompt=cfg.data.system_prompt,
        threads=_threads(r.threads),
    )
    if r.components or r.by_source:
        spec.routes = reward_routes(cfg)
        spec.source_key = r.source_key
    if r.function == "llm_judge":
        spec.judge = cfg.judge_config()
        spec.judge_engine = GeneratorConfig(
            model_path=r.model,
            dtype=cfg.model.generator_dtype,
            max_prompt_tokens=cfg.judge.max_prompt_tokens,
            max_new_tokens=cfg.judge.max_new_tokens,
            temperature=cfg.judge.temperature,
            seed=cfg.run.seed + 4242,
            kv_cache_gib=cfg.rollout.kv_cache_gib,
            threads=r.threads,
            trust_remote_code=cfg.model.trust_remote_code,
            max_model_len=cfg.judge.max_prompt_tokens + cfg.judge.max_new_tokens,
        )
    if r.function == "remote":
        rem = r.remote
        spec.remote = RemoteSettings(
            url=rem.url,
            api_key=os.environ.get(rem.api_key_env, "") if rem.api_key_env else "",
            batch_size=rem.batch_size,
            concurrency=rem.concurrency,
            timeout_s=rem.timeout_s,
            max_retries=rem.max_retries,
            backoff_s=rem.backoff_s,
            max_backoff_s=rem.max_backoff_s,
            on_failure=rem.on_failure,
            max_wait_s=rem.max_wait_s,
        )
    return spec


def reference_config(cfg: Config, model_path: str) -> ReferenceConfig:
    """The reference's own settings: precision and chunking from the shared ``train`` section."""
    return ReferenceConfig(
        model_path=model_path,
        bf16=cfg.train.bf16,
        micro_batch_size=cfg.train.micro_batch_size,
        chunk=cfg.train.logprob_chunk,
        temperature=cfg.rollout.temperature or 1.0,
        threads=cfg.cluster.threads,
        trust_remote_code=cfg.model.trust_remote_code,
        shared_prefix=cfg.train.shared_prefix,
        device="cuda" if cfg.cluster.gpus_per_reference > 0 else "cpu",
        routing_replay=cfg.train.routing_replay == "rollout",
    )


# glibc malloc settings (read once, at process start) for processes that train or score on the
# CPU. By default glibc serves every block over 32 MiB with its own mmap and unmaps it on free,
# so each logits or activation tensor of every micro-batch faults in fresh zeroed pages: on a
# GRPO update of SmolLM2-135M that was about a quarter of the time. One arena (Ray Train runs the
# training function on a thread of its own, whose arena could not hold such blocks), no mmap and
# no trimming keep freed blocks in the heap for the next micro-batch to reuse.
KEEP_FREED_MEMORY_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def role_env(threads: int, keep_freed_memory: bool = False) -> dict:
    """Runtime env of an inference actor. Ray sets OMP_NUM_THREADS to the CPUs an actor
    reserves (1 for a fractional reservation); OpenMP reads it once at start-up, and vLLM's CPU
    worker then runs single-threaded whatever torch is told later. The phases of a step run one
    after another, so each role may use every core of the node while it works.
    ``keep_freed_memory``: with ``KEEP_FREED_MEMORY_ENV`` (a role computing on the CPU)."""
    return {
        "env_vars": {
            "OMP_NUM_THREADS": str(_threads(threads)),
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
            **(KEEP_FREED_MEMORY_ENV if keep_freed_memory else {}),
        }
    }
