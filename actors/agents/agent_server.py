"""The rollout endpoint's HTTP server: Starlette on uvicorn, in a thread of the generator's
process, on 127.0.0.1 (``actors/agents/agent_endpoint.py`` runs the episodes; ``actors/agents/openai_api.py``
reads and writes the API). Routes, under each episode's base URL
``/episodes/<token>/v1``: ``GET models``, ``POST chat/completions``, ``POST responses``,
``POST completions``. A request that names no running episode gets a 404, a malformed one a 400
in OpenAI's error shape; a stream is ``text/event-stream``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

ROUTES = {"chat/completions": "chat", "responses": "responses", "completions": "completions"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
        status_code=status,
    )


class AgentEndpoint:
    """The HTTP server (one per generator): routes each call to its episode's runner."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, models: tuple[str, ...] = ("policy",)) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.runner: Any = None
        self.models = tuple(models)
        routes = [Route("/episodes/{token}/v1/models", self._list_models, methods=["GET"])]
        routes += [
            Route(f"/episodes/{{token}}/v1/{path}", self._handler(kind), methods=["POST"])
            for path, kind in ROUTES.items()
        ]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        # Every episode's program may connect at once: a small backlog refuses some under load.
        config = uvicorn.Config(
            Starlette(routes=routes),
            log_level="warning",
            lifespan="off",
            backlog=2048,
            timeout_keep_alive=60,
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="rayrlhf-agent-endpoint"
        )
        self.thread.start()
        while not self.server.started:  # listening before any base URL is handed out
            if not self.thread.is_alive():
                raise RuntimeError("the agent endpoint's server did not start")
            time.sleep(0.01)

    def base_url(self, token: str) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}/episodes/{token}/v1"

    def attach(self, runner: Any) -> None:
        self.runner = runner

    def detach(self, runner: Any) -> None:
        if self.runner is runner:
            self.runner = None

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    # -- routes ----------------------------------------------------------------------------------
    def _episode(self, request: Any) -> Any:
        runner, token = self.runner, request.path_params["token"]
        return runner if runner is not None and token in runner.episodes else None

    async def _list_models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if self._episode(request) is None:
            return _error(404, "no such episode", code="episode_not_found")
        return JSONResponse(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "rayrlhf"} for m in self.models]}
        )

    def _handler(self, kind: str):
        async def handle(request: Any) -> Any:
            from starlette.responses import JSONResponse, StreamingResponse

            from actors.agents.openai_api import ApiError

            runner = self._episode(request)
            if runner is None:
                return _error(404, "no such episode", code="episode_not_found")
            try:
                body = json.loads(await request.body() or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                runner.episodes[request.path_params["token"]].refused += 1
                return _error(400, f"the body is not JSON: {e}")
            try:
                answer = await runner.answer(request.path_params["token"], kind, body)
            except ApiError as e:
                return JSONResponse(e.body(), status_code=e.status)
            except KeyError:
                return _error(404, "no such episode", code="episode_not_found")
            if answer.events is not None:
                return StreamingResponse(
                    answer.events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            return JSONResponse(answer.body)

        return handle
