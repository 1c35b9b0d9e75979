"""The policy server: an OpenAI-API Ray Serve application over vLLM, built on ``ray.serve.llm``.

One deployment, ``PolicyServer``: Ray's ``LLMServer`` (one vLLM engine per replica; replicas,
autoscaling, health checks) serving vLLM's own OpenAI app as the ingress, so a request goes from
Serve's proxy straight into the replica that holds the engine and is answered by the same code
as vLLM's own server (routes, SSE streaming, validation, tool-call parsing, error shapes).
rayrlhf adds, in that replica:

    - ``Guard``: Bearer API key (401) and body size (413), before anything is parsed;
    - ``RequestRules``: limits on ``n`` and ``max_tokens`` (400 naming the limit), chat's
      ``max_tokens`` defaulting to the server's limit (not the whole context), and a conversation
      with ``tools``, tool calls and tool answers rewritten as the agents saw it in training (the
      calls as the text the model writes, the answers inside the response tags, the tool list in
      the system message where the template renders none); ``tool_calls`` come back parsed from
      the reply by vLLM's parser (``hermes`` by default);
    - ``POST /v1/responses``: the Responses API (the OpenAI Agents SDK's default model), streamed
      or not, answered through the chat path with the same rewrite of tools and tool turns, the
      sampled token ids beside the reply, ``previous_response_id`` kept per replica;
    - ``POST /v1/best_of_n``: n sampled answers ranked by a configured scorer (a ``ScorerServer``
      deployment of the same app), the best returned with every candidate's score;
    - ``POST /v1/admin/reload``: switch every replica to a newer checkpoint in place. Each engine
      pauses (requests in flight finish, new ones wait), reloads the weights from the folder,
      drops its prefix cache and resumes: no request is dropped.

Why one deployment: a gateway deployment in front of the engine's (Ray's ``OpenAiIngress``, the
layout this server had before) costs two extra actor hops per request, each request and
response pickled twice; measured alone on 2 cores it served 0.75x the bare vLLM server
(``docs/benchmarks.md``). ``build_policy_app(args)`` makes the application (``rayrlhf serve
policy``, ``serve run`` with a config file such as ``configs/serve/apps.yaml``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, ErrorResponse
from ray.llm._internal.serve.core.server.llm_server import LLMServer, _add_middleware_to_built_app

from serving.common import Guard, GuardSettings, Limits, api_key_from_env, configure_guard, read_body, reply_error

DEFAULT_MODEL_ID = "policy"
#: The OpenAI routes whose bodies ``RequestRules`` checks, and the request kind of each.
SAMPLING_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
#: The Responses API, answered by ``PolicyServer.responses`` through the chat path.
RESPONSES_ROUTE = "/v1/responses"
#: Responses a replica keeps for ``previous_response_id`` (the oldest are forgotten first).
KEPT_RESPONSES = 4096


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


def check_sampling(n: Any, max_tokens: Any, limits: Limits) -> None:
    """400 for ``n`` or ``max_tokens`` outside the server's limits (values that are not integers
    are left to the OpenAI request's own validation)."""
    if _integer(n) and not 1 <= n <= limits.max_n:
        raise HTTPException(400, f"n must be between 1 and {limits.max_n}, got {n}")
    if _integer(max_tokens) and not 1 <= max_tokens <= limits.max_tokens:
        raise HTTPException(400, f"max_tokens must be between 1 and {limits.max_tokens}, got {max_tokens}")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model_folder(path: str) -> Path:
    folder = Path(path)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise HTTPException(400, f"{path} is not a model folder (config.json and *.safetensors)")
    return folder


guard = GuardSettings()
GUARD = "serving.policy:guard"


class RequestRules:
    """ASGI middleware on the sampling routes (``SAMPLING_ROUTES``): the body is read once, checked
    and completed by ``PolicyServer.apply_rules``, and handed on (re-encoded only when changed).
    A body that is not a JSON object goes on untouched: vLLM's validation answers it with 400."""

    def __init__(self, app: Any, server: "PolicyServer") -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == RESPONSES_ROUTE and scope.get("method") == "POST":
            return await self.server.answer_responses(await read_body(receive), send)
        kind = SAMPLING_ROUTES.get(path)
        if kind is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if isinstance(request, dict):
            try:
                if await self.server.apply_rules(kind, request):
                    body = json.dumps(request).encode()
            except HTTPException as e:
                return await reply_error(send, e.status_code, str(e.detail))
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if delivered:
                return await receive()  # what comes after the body: the client's disconnect
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class PolicyServer(LLMServer):
    """``LLMServer`` with rayrlhf's rules, routes and reload (see module doc)."""

    async def __init__(
        self,
        llm_config: Any,
        *,
        limits: Limits | None = None,
        api_key: str = "",
        scorer: Any = None,
        model_path: str = "",
        **server_kwargs: Any,
    ) -> None:
        self.limits = limits or Limits()
        configure_guard(GUARD, api_key, self.limits.max_body_bytes)
        self.scorer = scorer
        self.model_path = model_path
        self._chat: tuple[str, Any] | None = None
        self._reload_lock = asyncio.Lock()
        # Responses API: each answered response's conversation, for previous_response_id.
        self._responses: "collections.OrderedDict[str, list[dict]]" = collections.OrderedDict()
        await super().__init__(llm_config, **server_kwargs)

    async def _start_engine(self) -> None:
        """Starts the engine without ``LLMServer``'s usage-telemetry actor: a detached actor that
        outlives the application and wakes 100 times a second on the engine's cores, for a report
        rayrlhf does not need (docs/benchmarks.md, policy server)."""
        if self.engine is None:
            raise ValueError("Engine is not set")
        await self.engine.start()

    async def __serve_build_asgi_app__(self) -> Any:
        app = await super().__serve_build_asgi_app__()
        app.add_api_route("/v1/best_of_n", self.best_of_n, methods=["POST"])
        app.add_api_route("/v1/admin/reload", self.reload, methods=["POST"])
        app.add_api_route("/v1/admin/served", self.served, methods=["GET"])
        _add_middleware_to_built_app(app, RequestRules, server=self)
        _add_middleware_to_built_app(app, Guard, settings=GUARD)  # added last: runs first
        return app

    async def apply_rules(self, kind: str, body: dict) -> bool:
        """Checks a sampling request's limits and completes it; True when ``body`` was changed."""
        check_sampling(body.get("n"), body.get("max_completion_tokens") or body.get("max_tokens"), self.limits)
        if kind != "chat":
            return False
        changed = False
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = self.limits.max_tokens  # not "up to the context": the limit
            changed = True
        messages, tools = body.get("messages"), body.get("tools")
        if (
            isinstance(messages, list)
            and all(isinstance(m, dict) for m in messages)
            and (tools or any(_tool_turn(m) for m in messages))
        ):
            try:
                body["messages"] = await asyncio.to_thread(self._as_trained, messages, tools)
            except (TypeError, ValueError, AttributeError) as e:
                raise HTTPException(400, f"malformed tool conversation: {e}") from None
            changed = True
        return changed

    def _as_trained(self, messages: list, tools: list | None) -> list[dict]:
        """A conversation with tools as rayrlhf's agents saw it in training (``actors/agents/chat_tokens.py``:
        ``from_client``, ``ChatTokens.with_tools``): tool calls and answers as the text the model
        wrote and read, the tool list where the training rollouts put it."""
        from actors.agents.chat_tokens import from_client

        schemas = [t for t in tools or [] if isinstance(t, dict)]
        return self._chat_tokens().with_tools(from_client(messages), schemas or None)

    def _chat_tokens(self) -> Any:
        """The served checkpoint's chat template (loaded once per checkpoint)."""
        if self._chat is None or self._chat[0] != self.model_path:
            from transformers import AutoTokenizer

            from actors.agents.chat_tokens import ChatTokens

            self._chat = (self.model_path, ChatTokens(AutoTokenizer.from_pretrained(self.model_path)))
        return self._chat[1]

    async def answer_responses(self, raw: bytes, send: Any) -> None:
        """``POST /v1/responses`` (the OpenAI Agents SDK's default model): its input items read as
        a chat conversation (``actors/agents/openai_api.py``), rewritten as the agents trained on it,
        sampled through the chat path (vLLM's tool-call parser), and answered as a Responses
        object or its event stream."""
        from actors.agents.openai_api import ApiError

        try:
            body = json.loads(raw)
            events, reply = await self.responses(body if isinstance(body, dict) else None)
        except ValueError as e:  # not JSON, or ApiError (a ValueError naming the field)
            error = e if isinstance(e, ApiError) else ApiError(f"the body is not JSON: {e}")
            return await _send_json(send, error.status, error.body())
        except HTTPException as e:
            return await reply_error(send, e.status_code, str(e.detail))
        if reply is not None:
            return await _send_json(send, 200, reply)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        for event in events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def responses(self, body: dict | None) -> tuple[Any, dict | None]:
        """(the event stream, None) or (None, the response) of a Responses request."""
        from actors.agents.openai_api import Choice, finish_reason, parse_responses, responses_reply, responses_stream

        model = self._llm_config.model_id
        ask = parse_responses(body, (model,), self._responses.get)
        check_sampling(None, ask.max_tokens, self.limits)
        messages = await asyncio.to_thread(self._as_trained, ask.messages, ask.tools)
        # tool_choice only with tools: given as None vLLM would not default it to auto (no parsing).
        tooling = {"tools": ask.tools, "tool_choice": ask.tool_choice} if ask.tools else {}
        req = ChatCompletionRequest(
            model=model,
            messages=messages,
            stream=False,
            logprobs=True,
            return_token_ids=True,
            max_tokens=ask.max_tokens or self.limits.max_tokens,
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            **tooling,
        )
        resp = await self._one_chat(req)
        c = resp.choices[0]
        msg = c.message.model_dump(exclude_none=True)
        message = {
            "role": "assistant",
            "content": msg.get("content"),
            **({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {}),
        }
        lps = [t.logprob for t in c.logprobs.content] if c.logprobs and c.logprobs.content else []
        choice = Choice(
            msg.get("content") or "",
            message,
            list(c.token_ids or []),
            lps,
            finish_reason(message, c.finish_reason == "length"),
        )
        response_id = f"resp_{uuid.uuid4().hex}"
        self._responses[response_id] = ask.messages + [message]
        while len(self._responses) > KEPT_RESPONSES:
            self._responses.popitem(last=False)
        prompt_ids = list(resp.prompt_token_ids or [])
        if ask.stream:
            return responses_stream(ask, choice, prompt_ids, response_id), None
        return None, responses_reply(ask, choice, prompt_ids, response_id)

    async def _one_chat(self, req: ChatCompletionRequest) -> Any:
        """A non-streaming chat response object from this replica's engine (HTTPException on its error)."""
        async for item in await self.chat(req):
            first = item[0] if isinstance(item, list) else item
            if isinstance(first, ErrorResponse):
                raise HTTPException(first.error.code, first.error.message)
            return first
        raise HTTPException(502, "the engine returned no response")

    async def _candidates(self, body: BestOfNRequest) -> Any:
        """One chat response holding the n candidates. With a seed, n requests seeded seed, seed+1,
        ...: one seeded request with n > 1 would give n copies of one sample."""

        def request(n: int, seed: int | None) -> ChatCompletionRequest:
            return ChatCompletionRequest(
                model=self._llm_config.model_id,
                messages=body.messages,
                n=n,
                seed=seed,
                stream=False,
                max_tokens=body.max_tokens or self.limits.max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
            )

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

    async def best_of_n(self, body: BestOfNRequest) -> JSONResponse:
        if self.scorer is None:
            raise HTTPException(404, "best-of-n is off: start the server with a scorer (best_of_n_scorer)")
        check_sampling(body.n, body.max_tokens, self.limits)
        if body.model not in (None, self._llm_config.model_id):
            raise HTTPException(404, f"The model `{body.model}` does not exist.")
        response = await self._candidates(body)
        candidates = [c.message.content or "" for c in response.choices]
        prompt = next((str(m.get("content", "")) for m in reversed(body.messages) if m.get("role") == "user"), "")
        scored = await self.scorer.score.remote(
            [prompt] * len(candidates), candidates, [dict(body.meta or {}) for _ in candidates]
        )
        scores = scored["scores"]
        valid = [i for i, s in enumerate(scores) if s is not None]
        if not valid:
            raise HTTPException(
                502, f"the scorer could not score any of the {len(candidates)} candidates ({scored.get('skipped')})"
            )
        best = max(valid, key=lambda i: scores[i])
        out = response.model_dump()
        out["choices"] = [dict(out["choices"][best], index=0)]
        out["best_of_n"] = {
            "scores": scores,
            "candidates": candidates,
            "best_index": best,
            "scorer": scored.get("model"),
            "skipped": scored.get("skipped", {}),
        }
        return JSONResponse(out)

    async def reload(self, body: ReloadRequest) -> JSONResponse:
        """Every replica of this deployment switches to the folder's weights (see module doc)."""
        from ray.llm._internal.serve.utils.broadcast import broadcast

        given = check_model_folder(body.model_path)
        folder = str(given.resolve())
        context = serve.get_replica_context()
        handle = serve.get_deployment_handle(context.deployment, context.app_name)
        t0 = time.perf_counter()
        async with self._reload_lock:
            await asyncio.to_thread(_reload_replicas, broadcast, handle, folder, str(given))
        return JSONResponse({"model_path": str(given), "seconds": round(time.perf_counter() - t0, 3)})

    def current_model_path(self) -> str:
        """The checkpoint this replica serves (``_reload_replicas`` routes one call of it first)."""
        return self.model_path

    def set_model_path(self, folder: str) -> None:
        """The checkpoint this replica serves now (called on every replica by ``reload``)."""
        self.model_path = folder

    async def served(self) -> JSONResponse:
        return JSONResponse({"model_path": self.model_path, "models": [self._llm_config.model_id]})


async def _send_json(send: Any, status: int, obj: dict) -> None:
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _tool_turn(message: Any) -> bool:
    m = message if isinstance(message, dict) else {}
    return m.get("role") == "tool" or bool(m.get("tool_calls"))


def _reload_replicas(broadcast: Any, handle: Any, folder: str, shown: str) -> None:
    """pause (in-flight requests finish) -> reload weights -> reset prefix cache -> resume, per
    replica; ``shown``: the path as the client gave it, what ``/v1/admin/served`` reports.

    First one ordinary call through the handle: routing it builds the handle's request router on
    the router's own event loop. ``broadcast`` reads that router from this thread, and when it
    would be the first to build it (the replica list arrived before the router's config) the build
    needs an event loop this thread does not have ("no running event loop": a reload failing now
    and then)."""
    handle.current_model_path.remote().result()
    broadcast(handle, "pause", kwargs={"mode": "wait", "clear_cache": True})
    try:
        broadcast(handle, "collective_rpc", kwargs={"method": "reload_weights", "kwargs": {"weights_path": folder}})
        broadcast(handle, "reset_prefix_cache")
        broadcast(handle, "set_model_path", kwargs={"folder": shown})
    finally:
        broadcast(handle, "resume")


def _engine_env(kv_cache_gib: float, threads: int) -> dict[str, str]:
    """The engine replica's environment: its KV cache on CPU, threads, logging, core binding."""
    import os

    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(round(kv_cache_gib)))),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):  # the engine's core binding, as the caller set it
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    return env


def llm_config(
    model_path: str,
    *,
    model_id: str = DEFAULT_MODEL_ID,
    max_model_len: int = 1024,
    dtype: str = "auto",
    kv_cache_gib: float = 1.0,
    threads: int = 0,
    num_replicas: int = 1,
    autoscaling: dict | None = None,
    seed: int = 0,
    accelerator: str = "cpu",
    access_log: bool = False,
    tool_call_parser: str = "hermes",
    engine_metrics: bool = False,
) -> Any:
    """``ray.serve.llm.LLMConfig`` of one served checkpoint (safetensors only, no remote code).
    ``access_log``: Serve's per-request log lines (off: on a small machine they cost throughput).
    ``dtype`` "auto": bfloat16 on GPUs and on CPUs with native bf16, float32 on other CPUs, decided
    on the machine that builds the config (``learners.training.precision``). ``tool_call_parser``: how
    ``tool_calls`` are read from a reply when a request offers ``tools`` (``hermes``: JSON between
    ``<tool_call>`` tags, the format rayrlhf's agents train with, ``actors/agents/tools.py``); "" turns
    automatic tool calls off. ``engine_metrics``: the engine's per-step and per-request metrics
    also exported through Ray's metrics (the Ray Dashboard's Serve LLM panels; ``ray.serve.llm``'s
    default), at a cost in throughput (docs/benchmarks.md)."""

    from ray.serve.llm import LLMConfig

    from learners.training.precision import resolve_engine_dtype

    dtype = resolve_engine_dtype(dtype, uses_gpu=accelerator != "cpu")

    deployment: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": 0},
        "graceful_shutdown_timeout_s": 120,
        "logging_config": {"enable_access_log": access_log},
    }
    if autoscaling:
        deployment["autoscaling_config"] = dict(autoscaling)
    else:
        deployment["num_replicas"] = num_replicas
    env = _engine_env(kv_cache_gib, threads)
    kwargs: dict[str, Any] = {
        "max_model_len": max_model_len,
        "dtype": dtype,
        "seed": seed,
        "trust_remote_code": False,
        "load_format": "safetensors",
    }
    if accelerator == "cpu":
        kwargs["enforce_eager"] = True
    if tool_call_parser:
        kwargs.update(enable_auto_tool_choice=True, tool_call_parser=tool_call_parser)
    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": str(model_path)},
        accelerator_config={"kind": accelerator} if accelerator == "cpu" else None,
        engine_kwargs=kwargs,
        deployment_config=deployment,
        runtime_env={"env_vars": env},
        log_engine_metrics=engine_metrics,
    )


POLICY_ARGS = (
    "model_path",
    "model_id",
    "max_model_len",
    "dtype",
    "kv_cache_gib",
    "threads",
    "num_replicas",
    "autoscaling",
    "seed",
    "accelerator",
    "access_log",
    "api_key_env",
    "limits",
    "best_of_n_scorer",
    "tool_call_parser",
    "engine_metrics",
)


def build_policy_app(args: dict[str, Any]) -> Any:
    """The policy application. ``args``: ``model_path`` (required), ``model_id``, ``max_model_len``,
    ``dtype``, ``kv_cache_gib``, ``threads``, ``num_replicas`` or ``autoscaling`` (Serve's
    autoscaling_config), ``seed``, ``accelerator`` ('cpu' or a GPU kind), ``access_log`` (Serve's
    per-request log lines, default off), ``api_key_env`` (default
    RAYRLHF_API_KEY), ``limits`` (``serving.common.Limits`` fields), ``best_of_n_scorer`` (scorer
    settings as for ``serving.scorer``: enables ``/v1/best_of_n``), ``tool_call_parser`` (default
    ``hermes``: chat requests with ``tools`` get ``tool_calls`` in the format agents train with),
    ``engine_metrics`` (default off: see ``llm_config``)."""
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
    engine = {
        k: args[k]
        for k in (
            "model_id",
            "max_model_len",
            "dtype",
            "kv_cache_gib",
            "threads",
            "num_replicas",
            "autoscaling",
            "seed",
            "accelerator",
            "access_log",
            "tool_call_parser",
            "engine_metrics",
        )
        if k in args
    }
    engine.setdefault("max_model_len", max(1024, limits.max_tokens + 512))
    cfg = llm_config(folder, **engine)
    scorer = None
    if args.get("best_of_n_scorer"):
        from serving.scorer import ScorerBackend, scorer_spec_from_args

        scorer = serve.deployment(ScorerBackend, name="BestOfNScorer", ray_actor_options={"num_cpus": 0}).bind(
            scorer_spec_from_args(dict(args["best_of_n_scorer"]))
        )
    api_key = api_key_from_env(args.get("api_key_env", "RAYRLHF_API_KEY"))
    # serve.ingress() without an app: the replica builds it (PolicyServer.__serve_build_asgi_app__)
    # once its engine runs.
    return build_llm_deployment(
        cfg,
        name_prefix="PolicyServer:",
        deployment_cls=serve.ingress()(PolicyServer),
        bind_kwargs={"limits": limits, "api_key": api_key, "scorer": scorer, "model_path": folder},
    )


__all__ = ["BestOfNRequest", "PolicyServer", "build_policy_app", "llm_config"]
