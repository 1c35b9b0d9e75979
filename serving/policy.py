"""The policy server: an OpenAI-API Ray Serve application over vLLM, built on ``ray.serve.llm``.

Its ``LLMServer`` deployment (Ray's vLLM engine host: replicas, autoscaling, streaming) sits behind
rayrlhf's gateway, a subclass of Ray's ``OpenAiIngress`` that keeps its routes and error handling
(unknown model 404, malformed request 400) and adds what Ray's does not have:

    - ``Guard``: Bearer API key (401) and body size (413), before anything is parsed;
    - limits on ``n`` and ``max_tokens`` (400 naming the limit);
    - ``POST /v1/best_of_n``: n sampled answers ranked by a configured scorer (a ``ScorerServer``
      deployment of the same app), the best returned with every candidate's score;
    - tools: a conversation with ``tools``, tool calls and tool answers reaches the template as
      the agents saw it in training (the calls as the text the model writes, the answers inside
      the response tags, the tool list in the system message where the template renders none),
      and ``tool_calls`` come back parsed from the reply by vLLM's parser (``hermes`` by default);
    - ``POST /v1/admin/reload``: switch every replica to a newer checkpoint in place. Each engine
      pauses (requests in flight finish, new ones wait), reloads the weights from the folder,
      drops its prefix cache and resumes: no request is dropped.

``build_policy_app(args)`` makes the application (``rayrlhf serve policy``, ``serve run`` with a
config file such as ``configs/serve/apps.yaml``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    to_model_metadata,
)
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress, init, make_fastapi_ingress

from serving.common import Guard, GuardSettings, Limits, add_error_handlers, api_key_from_env, configure_guard

DEFAULT_MODEL_ID = "policy"


class BestOfNRequest(BaseModel):
    """A chat request answered by the best of ``n`` samples."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Served model id (default: the only one).")
    messages: list[dict[str, Any]] = Field(description="OpenAI chat messages.")
    n: int = Field(4, description="Candidates sampled.")
    max_tokens: int | None = Field(None, description="New tokens per candidate (default: the server's limit).")
    temperature: float = Field(1.0, ge=0, le=2, description="Sampling temperature of the candidates.")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    meta: dict[str, Any] | None = Field(None, description="Metadata the scorer reads (e.g. the reference answer).")


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(description="A model folder (a rayrlhf checkpoint) with the served model's architecture.")


def check_sampling(n: int | None, max_tokens: int | None, limits: Limits) -> None:
    """400 for ``n`` or ``max_tokens`` outside the server's limits."""
    if n is not None and not 1 <= n <= limits.max_n:
        raise HTTPException(400, f"n must be between 1 and {limits.max_n}, got {n}")
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens:
        raise HTTPException(400, f"max_tokens must be between 1 and {limits.max_tokens}, got {max_tokens}")


def check_model_folder(path: str) -> Path:
    folder = Path(path)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise HTTPException(400, f"{path} is not a model folder (config.json and *.safetensors)")
    return folder


app = init()  # Ray's OpenAI app: its error middleware maps validation errors to 400
add_error_handlers(app, validation=False)
guard = GuardSettings()
GUARD = "serving.policy:guard"
app.add_middleware(Guard, settings=GUARD)


class PolicyGateway(OpenAiIngress):
    def __init__(self, llm_deployments: dict, model_cards: dict, *, limits: Limits | None = None, api_key: str = "",
                 scorer: Any = None, model_path: str = "") -> None:
        super().__init__(llm_deployments, model_cards)
        self.limits = limits or Limits()
        configure_guard(GUARD, api_key, self.limits.max_body_bytes)
        self.scorer = scorer
        self.model_path = model_path
        self._chat: tuple[str, Any] | None = None
        self._reload_lock = asyncio.Lock()

    async def completions(self, body: CompletionRequest, request: Request):
        check_sampling(body.n, body.max_tokens, self.limits)
        return await super().completions(body, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        check_sampling(body.n, body.max_completion_tokens or body.max_tokens, self.limits)
        if body.max_tokens is None and body.max_completion_tokens is None:
            body.max_tokens = self.limits.max_tokens  # not "up to the context": the limit
        if body.tools or any(_tool_turn(m) for m in body.messages):
            body.messages = await asyncio.to_thread(self._as_trained, body.messages, body.tools)
        return await super().chat(body, request)

    def _as_trained(self, messages: list, tools: list | None) -> list[dict]:
        """A conversation with tools as rayrlhf's agents saw it in training (``actors/episodes.py``:
        ``from_client``, ``ChatTokens.with_tools``): tool calls and answers as the text the model
        wrote and read, the tool list where the training rollouts put it."""
        from actors.episodes import from_client

        schemas = [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else t for t in tools or []]
        return self._chat_tokens().with_tools(from_client(messages), schemas or None)

    def _chat_tokens(self) -> Any:
        """The served checkpoint's chat template (loaded once per checkpoint)."""
        if self._chat is None or self._chat[0] != self.model_path:
            from transformers import AutoTokenizer

            from actors.episodes import ChatTokens

            self._chat = (self.model_path, ChatTokens(AutoTokenizer.from_pretrained(self.model_path)))
        return self._chat[1]

    async def _one_chat(self, req: ChatCompletionRequest) -> Any:
        """A non-streaming chat response object from the engine (HTTPException on its error)."""
        from ray.llm._internal.serve.core.ingress.ingress import _sanitize_chat_completion_request

        handle = self._get_configured_serve_handle(req.model)
        async for item in handle.chat.remote(_sanitize_chat_completion_request(req), None):
            first = item[0] if isinstance(item, list) else item
            if isinstance(first, ErrorResponse):
                raise HTTPException(first.error.code, first.error.message)
            return first
        raise HTTPException(502, "the engine returned no response")

    async def _candidates(self, model_id: str, body: BestOfNRequest) -> Any:
        """One chat response holding the n candidates. With a seed, n requests seeded seed, seed+1,
        ...: one seeded request with n > 1 would give n copies of one sample."""
        def request(n: int, seed: int | None) -> ChatCompletionRequest:
            return ChatCompletionRequest(model=model_id, messages=body.messages, n=n, seed=seed, stream=False,
                                         max_tokens=body.max_tokens or self.limits.max_tokens,
                                         temperature=body.temperature, top_p=body.top_p)

        if body.seed is None:
            return await self._one_chat(request(body.n, None))
        parts = await asyncio.gather(*(self._one_chat(request(1, body.seed + i)) for i in range(body.n)))
        merged = parts[0]
        merged.choices = [p.choices[0] for p in parts]
        for i, c in enumerate(merged.choices):
            c.index = i
        if merged.usage is not None:
            merged.usage.completion_tokens = sum(p.usage.completion_tokens for p in parts if p.usage is not None)
            merged.usage.total_tokens = merged.usage.prompt_tokens + merged.usage.completion_tokens
        return merged

    async def best_of_n(self, body: BestOfNRequest, request: Request) -> JSONResponse:
        if self.scorer is None:
            raise HTTPException(404, "best-of-n is off: start the server with a scorer (best_of_n_scorer)")
        check_sampling(body.n, body.max_tokens, self.limits)
        model_id = await self._get_model_id(body.model)
        response = await self._candidates(model_id, body)
        candidates = [c.message.content or "" for c in response.choices]
        prompt = next((str(m.get("content", "")) for m in reversed(body.messages) if m.get("role") == "user"), "")
        scored = await self.scorer.score.remote([prompt] * len(candidates), candidates,
                                                [dict(body.meta or {}) for _ in candidates])
        scores = scored["scores"]
        valid = [i for i, s in enumerate(scores) if s is not None]
        if not valid:
            raise HTTPException(502, f"the scorer could not score any of the {len(candidates)} candidates "
                                f"({scored.get('skipped')})")
        best = max(valid, key=lambda i: scores[i])
        out = response.model_dump()
        choice = dict(out["choices"][best], index=0)
        out["choices"] = [choice]
        out["best_of_n"] = {"scores": scores, "candidates": candidates, "best_index": best,
                            "scorer": scored.get("model"), "skipped": scored.get("skipped", {})}
        return JSONResponse(out)

    async def reload(self, body: ReloadRequest, request: Request) -> JSONResponse:
        """Every replica of every served model switches to the folder's weights (see module doc)."""
        from ray.llm._internal.serve.utils.broadcast import broadcast

        folder = check_model_folder(body.model_path)
        t0 = time.perf_counter()
        async with self._reload_lock:
            for handle in self._default_serve_handles.values():
                await asyncio.to_thread(_reload_replicas, broadcast, handle, str(folder.resolve()))
            self.model_path = str(folder)
        return JSONResponse({"model_path": str(folder), "seconds": round(time.perf_counter() - t0, 3)})

    async def served(self, request: Request) -> JSONResponse:
        return JSONResponse({"model_path": self.model_path, "models": sorted(self._model_cards)})


def _tool_turn(message: Any) -> bool:
    m = message if isinstance(message, dict) else {}
    return m.get("role") == "tool" or bool(m.get("tool_calls"))


def _reload_replicas(broadcast: Any, handle: Any, folder: str) -> None:
    """pause (in-flight requests finish) -> reload weights -> reset prefix cache -> resume, per replica."""
    broadcast(handle, "pause", kwargs={"mode": "wait", "clear_cache": True})
    try:
        broadcast(handle, "collective_rpc", kwargs={"method": "reload_weights", "kwargs": {"weights_path": folder}})
        broadcast(handle, "reset_prefix_cache")
    finally:
        broadcast(handle, "resume")


ENDPOINTS = {
    "models": DEFAULT_ENDPOINTS["models"],
    "model_data": DEFAULT_ENDPOINTS["model_data"],
    "completions": DEFAULT_ENDPOINTS["completions"],
    "chat": DEFAULT_ENDPOINTS["chat"],
    "best_of_n": lambda a: a.post("/v1/best_of_n"),
    "reload": lambda a: a.post("/v1/admin/reload"),
    "served": lambda a: a.get("/v1/admin/served"),
}
Gateway = make_fastapi_ingress(PolicyGateway, app=app, endpoint_map=ENDPOINTS)


def llm_config(model_path: str, *, model_id: str = DEFAULT_MODEL_ID, max_model_len: int = 1024,
               dtype: str = "auto", kv_cache_gib: float = 1.0, threads: int = 0, num_replicas: int = 1,
               autoscaling: dict | None = None, seed: int = 0, accelerator: str = "cpu", access_log: bool = False,
               tool_call_parser: str = "hermes") -> Any:
    """``ray.serve.llm.LLMConfig`` of one served checkpoint (safetensors only, no remote code).
    ``access_log``: Serve's per-request log lines (off: on a small machine they cost throughput).
    ``dtype`` "auto": bfloat16 on GPUs and on CPUs with native bf16, float32 on other CPUs, decided
    on the machine that builds the config (``learners.precision``). ``tool_call_parser``: how
    ``tool_calls`` are read from a reply when a request offers ``tools`` (``hermes``: JSON between
    ``<tool_call>`` tags, the format rayrlhf's agents train with, ``actors/tools.py``); "" turns
    automatic tool calls off."""
    import os

    from ray.serve.llm import LLMConfig

    from learners.precision import resolve_engine_dtype

    dtype = resolve_engine_dtype(dtype, uses_gpu=accelerator != "cpu")

    deployment: dict[str, Any] = {"ray_actor_options": {"num_cpus": 0}, "graceful_shutdown_timeout_s": 120,
                                  "logging_config": {"enable_access_log": access_log}}
    if autoscaling:
        deployment["autoscaling_config"] = dict(autoscaling)
    else:
        deployment["num_replicas"] = num_replicas
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(round(kv_cache_gib)))), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):  # the engine's core binding, as the caller set it
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    kwargs: dict[str, Any] = {"max_model_len": max_model_len, "dtype": dtype, "seed": seed,
                              "trust_remote_code": False, "load_format": "safetensors"}
    if accelerator == "cpu":
        kwargs["enforce_eager"] = True
    if tool_call_parser:
        kwargs.update(enable_auto_tool_choice=True, tool_call_parser=tool_call_parser)
    return LLMConfig(model_loading_config={"model_id": model_id, "model_source": str(model_path)},
                     accelerator_config={"kind": accelerator} if accelerator == "cpu" else None,
                     engine_kwargs=kwargs, deployment_config=deployment, runtime_env={"env_vars": env})


POLICY_ARGS = ("model_path", "model_id", "max_model_len", "dtype", "kv_cache_gib", "threads", "num_replicas",
               "autoscaling", "seed", "accelerator", "access_log", "api_key_env", "limits", "best_of_n_scorer",
               "tool_call_parser")


def build_policy_app(args: dict[str, Any]) -> Any:
    """The policy application. ``args``: ``model_path`` (required), ``model_id``, ``max_model_len``,
    ``dtype``, ``kv_cache_gib``, ``threads``, ``num_replicas`` or ``autoscaling`` (Serve's
    autoscaling_config), ``seed``, ``accelerator`` ('cpu' or a GPU kind), ``access_log`` (Serve's
    per-request log lines, default off), ``api_key_env`` (default
    RAYRLHF_API_KEY), ``limits`` (``serving.common.Limits`` fields), ``best_of_n_scorer`` (scorer
    settings as for ``serving.scorer``: enables ``/v1/best_of_n``), ``tool_call_parser`` (default
    ``hermes``: chat requests with ``tools`` get ``tool_calls`` in the format agents train with)."""
    from ray.serve.llm import build_llm_deployment

    unknown = set(args) - set(POLICY_ARGS)
    if unknown:
        raise ValueError(f"unknown policy server settings {sorted(unknown)}; known: {', '.join(POLICY_ARGS)}")
    if not args.get("model_path"):
        raise ValueError("the policy server needs model_path (a model folder or rayrlhf checkpoint)")
    folder = str(Path(args["model_path"]).resolve())
    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"model_path {folder} is not a model folder (no config.json)")
    limits = Limits(**args.get("limits", {}))
    engine = {k: args[k] for k in ("model_id", "max_model_len", "dtype", "kv_cache_gib", "threads", "num_replicas",
                                   "autoscaling", "seed", "accelerator", "access_log", "tool_call_parser") if k in args}
    engine.setdefault("max_model_len", max(1024, limits.max_tokens + 512))
    cfg = llm_config(folder, **engine)
    llm = build_llm_deployment(cfg)
    scorer = None
    if args.get("best_of_n_scorer"):
        from serving.scorer import ScorerBackend, scorer_spec_from_args

        scorer = serve.deployment(ScorerBackend, name="BestOfNScorer", ray_actor_options={"num_cpus": 0}).bind(
            scorer_spec_from_args(dict(args["best_of_n_scorer"])))
    api_key = api_key_from_env(args.get("api_key_env", "RAYRLHF_API_KEY"))
    return serve.deployment(Gateway, name="PolicyGateway", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256,
                            logging_config={"enable_access_log": bool(args.get("access_log", False))}).bind(
        llm_deployments={cfg.model_id: llm}, model_cards={cfg.model_id: to_model_metadata(cfg.model_id, cfg)},
        limits=limits, api_key=api_key, scorer=scorer, model_path=folder)


__all__ = ["BestOfNRequest", "Gateway", "build_policy_app", "llm_config"]
