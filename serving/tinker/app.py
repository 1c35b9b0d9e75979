"""``rayrlhf serve trainer``: the Tinker REST API (``/api/v1/...``) as the official ``tinker`` SDK
speaks it, as a Ray Serve application. The routes hand their work to ``service.TinkerService``;
this file is HTTP only: JSON bodies in, JSON or protobuf out, errors in the SDK's shapes.

* A call that returns a future answers ``{"request_id", ...}`` at once; ``retrieve_future``
  holds the poll until the result is ready (or ``poll_s``, then ``{"type": "try_again"}``), and
  answers the result (protobuf for ``forward_backward`` and ``asample``) or
  ``{"error": message, "category": "user" | "server"}``.
* A request the service refuses outright (unknown model, malformed body) gets a 400 with a JSON
  body (never an empty one: the SDK takes an empty 400 for a proxy's and retries it).
* The API key, when set, is the ``X-API-Key`` header's (``serving.common.Guard``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from serving.common import Guard, GuardSettings, add_error_handlers, configure_guard
from serving.tinker.futures import UserError
from serving.tinker.service import Backend, TinkerService, TrainerSettings

app = FastAPI(title="rayrlhf trainer (Tinker API)")
add_error_handlers(app)
guard = GuardSettings()
GUARD = "serving.tinker.app:guard"
app.add_middleware(Guard, settings=GUARD)

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    # One chunk at a time, in order: the model's calls are then ordered by arrival (futures.py).
    "parallel_fwdbwd_chunks": False,
    "sample_use_retrieve_futures": False,
}


def _refuse(e: Exception) -> JSONResponse:
    return JSONResponse(status_code=400, content={"error": str(e), "category": "user", "type": "invalid_request_error"})


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise UserError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise UserError("the body must be a JSON object")
    return body


def _roles(settings: TrainerSettings) -> tuple[dict[str, Backend], dict[str, Backend]]:
    """One trainer and one sampler actor per base model, started now (in parallel). Each is named
    ``tinker-<role>:<base>:<n>`` (an operator finds it in the Ray Dashboard); one that dies is
    replaced by a fresh one (``Backend``)."""
    import itertools
    import uuid

    import ray

    from actors.lora_tenants import LoraTenants
    from actors.rollout.adapter_sampler import AdapterSampler, SamplerConfig

    trainer_cls = ray.remote(num_cpus=0)(LoraTenants)
    sampler_cls = ray.remote(num_cpus=0)(AdapterSampler)
    serial = itertools.count()
    tag = uuid.uuid4().hex[:6]

    def named(cls: Any, role: str, base: str, *args: Any) -> Any:
        return lambda: cls.options(name=f"tinker-{role}:{base}:{tag}-{next(serial)}").remote(*args)

    trainers, samplers = {}, {}
    for name, folder in settings.models.items():
        make = named(trainer_cls, "trainer", name, folder, settings.dtype, settings.max_adapters, settings.max_rank)
        trainers[name] = Backend(make(), make, f"trainer of {name!r}")
        cfg = SamplerConfig(
            base_path=folder,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            max_lora_rank=settings.max_rank,
            max_tokens=settings.max_tokens,
            kv_cache_gib=settings.kv_cache_gib,
        )
        make = named(sampler_cls, "sampler", name, cfg)
        samplers[name] = Backend(make(), make, f"sampler of {name!r}")
    return trainers, samplers


@serve.deployment(name="Trainer", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class TrainerServer:
    """The Tinker API over ``TinkerService`` (see module doc). One replica: it holds the futures."""

    def __init__(self, settings: TrainerSettings, api_key: str = "") -> None:
        configure_guard(GUARD, api_key, 64 << 20, key_header="x-api-key")
        trainers, samplers = _roles(settings)
        self.service = TinkerService(settings, trainers, samplers)

    async def _call(self, request: Request, method: str, *args: Any) -> Response:
        try:
            body = await _json(request)
            return JSONResponse(getattr(self.service, method)(body, *args))
        except (ValueError, KeyError, TypeError) as e:  # UserError, or a field of the wrong kind
            return _refuse(e if isinstance(e, ValueError) else UserError(f"malformed request: {e!r}"))

    @app.post("/api/v1/client/config")
    async def client_config(self) -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(self) -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(self) -> dict[str, Any]:
        return self.service.capabilities()

    @app.post("/api/v1/telemetry")
    async def telemetry(self) -> dict[str, Any]:
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session(self, request: Request) -> Response:
        return await self._call(request, "create_session")

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(self, request: Request) -> Response:
        return await self._call(request, "heartbeat")

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(self, session_id: str) -> dict[str, Any]:
        return await self.service.finish(session_id)

    @app.post("/api/v1/create_model")
    async def create_model(self, request: Request) -> Response:
        return await self._call(request, "create_model")

    @app.post("/api/v1/get_info")
    async def get_info(self, request: Request) -> Response:
        return await self._call(request, "get_info")

    @app.post("/api/v1/forward_backward")
    async def forward_backward(self, request: Request) -> Response:
        from serving.tinker.wire import read_forward_backward

        try:
            return JSONResponse(self.service.forward_backward(read_forward_backward(await request.body())))
        except ValueError as e:
            return _refuse(e)

    @app.post("/api/v1/optim_step")
    async def optim_step(self, request: Request) -> Response:
        return await self._call(request, "optim_step")

    @app.post("/api/v1/save_weights")
    async def save_weights(self, request: Request) -> Response:
        return await self._call(request, "save_weights", "weights")

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(self, request: Request) -> Response:
        return await self._call(request, "save_weights", "sampler_weights")

    @app.post("/api/v1/load_weights")
    async def load_weights(self, request: Request) -> Response:
        return await self._call(request, "load_weights")

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(self, request: Request) -> Response:
        return await self._call(request, "create_sampling_session")

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(self, sampler_id: str) -> Response:
        try:
            return JSONResponse(self.service.sampler_info(sampler_id))
        except UserError as e:
            return _refuse(e)

    @app.post("/api/v1/asample")
    async def asample(self, request: Request) -> Response:
        return await self._call(request, "asample")

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(self, request: Request) -> Response:
        try:
            body = await _json(request)
        except UserError as e:
            return _refuse(e)
        state, value = await self.service.futures.wait(str(body.get("request_id")), self.service.settings.poll_s)
        if state == "pending":
            return JSONResponse({"type": "try_again", "queue_state": "active"})
        if state == "error":
            return JSONResponse({"error": value[0], "category": value[1]})
        if isinstance(value, bytes):
            from serving.tinker.wire import PROTO

            return Response(content=value, media_type=PROTO)
        return JSONResponse(value)


def build_trainer_app(args: dict[str, Any]) -> Any:
    """The trainer application. ``args``: ``TrainerSettings`` fields (``models``: name to folder,
    ``store``, limits) and ``api_key_env`` (default RAYRLHF_API_KEY); unknown keys are refused."""
    from serving.common import api_key_from_env

    args = dict(args)
    api_key = api_key_from_env(args.pop("api_key_env", "RAYRLHF_API_KEY"))
    unknown = set(args) - set(TrainerSettings.__dataclass_fields__)
    if unknown:
        raise ValueError(
            f"unknown trainer settings {sorted(unknown)}; known: {sorted(TrainerSettings.__dataclass_fields__)}"
        )
    settings = TrainerSettings(**args)
    if not settings.models:
        raise ValueError("the trainer needs at least one base model (models: {name: folder})")
    if not settings.store:
        raise ValueError("the trainer needs a store folder for its adapters and saved states")
    return TrainerServer.options(num_replicas=1).bind(settings, api_key)
