"""What every rayrlhf Serve app shares: safe defaults for an HTTP endpoint.

``Guard`` is a plain ASGI middleware in front of an app: it refuses a request without the API key
(``Authorization: Bearer <key>``, when one is set) with 401 before anything parses it, and a body
over ``max_body_bytes`` with 413 (by its Content-Length, or while it streams in). Errors use the
OpenAI error shape, ``{"error": {"message", "type", "code"}}``. Apps bind to 127.0.0.1 unless
told otherwise (``serve_http_options``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
#: Paths answered without the key (liveness probes of Kubernetes / load balancers).
OPEN_PATHS = ("/-/healthz", "/-/routes", "/health")


@dataclass
class Limits:
    """Request limits of an endpoint: larger requests get a 4xx, never a hang or a 500."""

    # Largest request body (bytes).
    max_body_bytes: int = 1 << 20
    # Most samples per request (OpenAI ``n``; best-of-n's candidates).
    max_n: int = 8
    # Most new tokens per sample (OpenAI ``max_tokens``).
    max_tokens: int = 512
    # Most (prompt, completion) items per scoring request.
    max_items: int = 256


def api_key_from_env(name: str) -> str:
    """The API key held by environment variable ``name`` ('' when unset: no key required)."""
    return os.environ.get(name, "") if name else ""


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


async def reply_error(send: Any, status: int, message: str, kind: str = "invalid_request_error") -> None:
    """Sends an OpenAI-shaped error response through an ASGI ``send``."""
    body = error_body(status, message, kind)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Any) -> bytes:
    """The whole request body from an ASGI ``receive`` (what arrived before a disconnect)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


class _TooLarge(Exception):
    pass


@dataclass
class GuardSettings:
    """What ``Guard`` enforces. One instance per app module, filled in by the deployment's
    constructor inside its replica (the app object is imported there, not pickled)."""

    api_key: str = ""
    max_body_bytes: int = 1 << 20
    # Where the key travels: "" for ``Authorization: Bearer <key>`` (OpenAI's clients), or a header
    # that carries the key alone (the Tinker SDK's ``X-API-Key``).
    key_header: str = ""


def configure_guard(name: str, api_key: str, max_body_bytes: int, key_header: str = "") -> None:
    """Fills in the ``GuardSettings`` named ``"module:attribute"`` in this process (called by a
    deployment's constructor in its replica; a by-value copy of the class would otherwise set a
    copy of the settings, not the ones ``Guard`` reads)."""
    import importlib

    module, attr = name.split(":")
    settings = getattr(importlib.import_module(module), attr)
    settings.api_key, settings.max_body_bytes, settings.key_header = api_key, max_body_bytes, key_header.lower()


class Guard:
    """ASGI middleware: API key (401) and body size (413) checks, see module doc.

    ``settings`` is named as ``"module:attribute"`` and looked up in the serving process: Serve
    ships an ingress app to its replica by value (a copy of any object it holds), while the
    deployment's constructor fills in the module's own ``GuardSettings`` there."""

    def __init__(self, app: Any, settings: str) -> None:
        self.app, self._name = app, settings

    @property
    def settings(self) -> GuardSettings:
        import importlib

        module, attr = self._name.split(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def api_key(self) -> str:
        return self.settings.api_key

    @property
    def max_body(self) -> int:
        return self.settings.max_body_bytes

    def _authorized(self, headers: dict[str, str]) -> bool:
        import hmac

        header = self.settings.key_header
        sent = headers.get(header, "") if header else headers.get("authorization", "")
        return hmac.compare_digest(sent.encode(), (self.api_key if header else f"Bearer {self.api_key}").encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and not self._authorized(headers):
            how = (
                f"'{self.settings.key_header}: <key>'" if self.settings.key_header else "'Authorization: Bearer <key>'"
            )
            return await reply_error(send, 401, f"missing or invalid API key (send {how})", "authentication_error")
        try:
            declared = int(headers.get("content-length", "0") or 0)
        except ValueError:
            return await reply_error(send, 400, "malformed Content-Length header", "invalid_request_error")
        if declared > self.max_body:
            return await reply_error(
                send,
                413,
                f"request body of {declared} bytes is over the limit of {self.max_body}",
                "invalid_request_error",
            )
        seen = 0

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _TooLarge()
            return message

        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await reply_error(
                    send, 413, f"request body over the limit of {self.max_body} bytes", "invalid_request_error"
                )


def add_error_handlers(app: Any, validation: bool = True) -> None:
    """OpenAI-shaped errors for ``HTTPException`` (FastAPI's default body is ``{"detail": ...}``) and,
    with ``validation``, 400 with the reason for malformed JSON or fields (FastAPI's default: 422)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def http_error(request: Any, exc: HTTPException) -> JSONResponse:
        kind = (
            "authentication_error"
            if exc.status_code == 401
            else ("not_found_error" if exc.status_code == 404 else "invalid_request_error")
        )
        return JSONResponse(
            status_code=exc.status_code,
            content={"error": {"message": str(exc.detail), "type": kind, "code": exc.status_code}},
        )

    async def bad_request(request: Any, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(
            status_code=400, content={"error": {"message": message, "type": "invalid_request_error", "code": 400}}
        )

    app.add_exception_handler(HTTPException, http_error)
    if validation:
        app.add_exception_handler(RequestValidationError, bad_request)


#: Environment of a Ray cluster a server starts for itself (docs/benchmarks.md, policy server).
#: Ray runs its workers (and so the vLLM engine a replica starts) at nice 15 while its own daemons
#: (GCS, raylet, agents) run at nice 0: on a machine the engine fills, every wake-up of a daemon
#: then preempts the engine's OpenMP threads. At 0 they share the cores fairly. Serve's controller
#: runs its control loop every 0.1 s by default, each pass also reading the GCS: every second is
#: enough for a server (replica health checks and autoscaling decisions act on seconds anyway),
#: and the engine is preempted ten times less often. No idle Ray workers are kept warm (Ray keeps
#: as many as the node has CPUs, and starts one for the first driver): each Python worker wakes
#: 100 times a second whether it works or not, and a server starts its actors once.
SERVER_CLUSTER_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
    "RAY_num_workers_soft_limit": "0",
    "RAY_prestart_worker_first_driver": "0",
}


def use_server_cluster_env() -> None:
    """Applies ``SERVER_CLUSTER_ENV`` to this process before it starts a local Ray cluster (a value
    the user set wins)."""
    for name, value in SERVER_CLUSTER_ENV.items():
        os.environ.setdefault(name, value)


#: Serve's direct ingress (``direct_ingress_env``): the longest a stopping replica keeps answering
#: for a load balancer to notice (Serve's default 30 s); a server with one replica has none.
DIRECT_INGRESS_DRAIN_S = 1


def direct_ingress_env(port: int) -> dict[str, str]:
    """Environment of a cluster whose ingress replica answers HTTP itself on ``port`` (Ray Serve's
    direct ingress): a request is then one hop, client to replica, instead of client to Serve's
    proxy, proxy to replica, and the replica calling back into the proxy for the body and for the
    client's disconnect (docs/benchmarks.md, policy server). The port range is that one port
    (Serve's maximum is exclusive), so it suits one ingress replica per node; the proxy still
    starts, on a port of its own. A released port is not held back (Serve holds it 150 s for its
    HAProxy mode, which is not used): a replica that replaces a lost one takes it at once."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DIRECT_INGRESS_DRAIN_S),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def _tcp_socket(host: str) -> Any:
    import socket

    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)


def port_is_free(host: str, port: int) -> bool:
    """Whether this machine can listen on ``host:port`` now."""
    import socket

    with _tcp_socket(host) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = DEFAULT_HOST) -> int:
    """A port the system has free on ``host`` now."""
    with _tcp_socket(host) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_http_options(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> dict[str, Any]:
    """Serve's HTTP options: loopback by default."""
    return {"host": host, "port": port}
