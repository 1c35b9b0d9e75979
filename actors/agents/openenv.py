"""OpenEnv environments through OpenEnv's own protocol: one WebSocket session per episode.

An OpenEnv server (``openenv-core``'s ``create_app``) keeps an episode's state in an environment
instance that lives exactly as long as one WebSocket session on ``{url}/ws``; its HTTP routes
``POST /reset`` and ``POST /step`` build a fresh environment per request and are stateless, so
a ``/step`` after a ``/reset`` runs on an environment that was never reset. An episode here is
therefore one session: ``reset`` opens it and sends ``{"type": "reset", "data": {...}}``, every
``step`` sends ``{"type": "step", "data": action}`` on the same socket, and the end of the
episode sends ``{"type": "close"}``. A step is refused locally before a reset, and a dropped
socket is never reopened mid-episode (a new socket is a new, unreset environment): the episode
ends as ``env_error``. A step that outlives its timeout ends it as ``env_timeout``.

Text in, text out: the action is the server's action model (``GET /schema``) with the model's
reply in its text field (``action_field``, or the schema's one required string field, or one of
``message``/``text``/``content``/...) and ``action_defaults`` for the others; the observation's
text is ``observation_field`` or its string fields (one as it is, several as ``name: value``
lines), ``reward`` and ``done`` are read as sent. The same mapping drives an OpenEnv
``Environment`` instance in-process (``LocalOpenEnv``), e.g. to compare the two.

The protocol is spoken with ``websockets`` (the library ``openenv-core``'s own ``EnvClient``
uses) rather than through that client: importing it imports the package's web UI (gradio, ~5 s
per generator process), it sends no headers (an API key), and its sync wrapper runs a thread
and an event loop per episode. Here every session of a process shares one event loop thread.
A server at capacity (``CAPACITY_REACHED``: more sessions than its ``max_concurrent_envs``)
and a server not accepting connections (restarting) are retried with backoff for up to
``connect_wait_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.agents.env_step import Step

log = logging.getLogger("rayrlhf.openenv")

# Action fields that take the model's text when the schema does not single one out.
TEXT_FIELDS = ("message", "text", "content", "action", "response", "answer", "code", "command", "query")
# Observation fields that are not its text.
NOT_TEXT = ("metadata", "reward", "done")


@dataclass
class OpenEnvOptions:
    """How text maps onto an OpenEnv environment's action and observation (``env.openenv``)."""

    action_field: str = ""
    observation_field: str = ""
    # Values of the action's other fields, sent with every step.
    action_defaults: dict[str, Any] = field(default_factory=dict)
    # Row keys sent as keyword arguments of reset (e.g. prompt, answer), and constant ones.
    reset_fields: list[str] = field(default_factory=list)
    reset_kwargs: dict[str, Any] = field(default_factory=dict)
    # Remote only: seconds one message may take, the wait for a server at capacity or
    # restarting, and the API key sent as a Bearer token.
    timeout_s: float = 30.0
    connect_wait_s: float = 60.0
    api_key: str = ""


class OpenEnvError(RuntimeError):
    """The server refused a message or the session broke: the episode ends as env_error."""


class CapacityError(OpenEnvError):
    """The server holds as many sessions as it allows (retried)."""


# -- text <-> action and observation ------------------------------------------------------------
def choose_action_field(schema: dict[str, Any], wanted: str, defaults: dict[str, Any]) -> str:
    """The action field the model's text goes to; ValueError naming the fields when none fits
    or another required field has no value."""
    props = schema.get("properties") or {}
    required = [k for k in schema.get("required") or [] if k not in defaults]
    texts = [k for k, p in props.items() if _is_string(p)]
    if wanted:
        if wanted not in props:
            raise ValueError(
                f"env.openenv.action_field {wanted!r} is not a field of the action ({', '.join(props) or 'none'})"
            )
        name = wanted
    elif len([k for k in required if k in texts]) == 1:
        name = next(k for k in required if k in texts)
    else:
        name = next((k for k in TEXT_FIELDS if k in texts), "")
        if not name:
            raise ValueError(
                f"no text field of the action ({', '.join(props) or 'none'}) takes the model's reply: "
                "set env.openenv.action_field"
            )
    missing = [k for k in required if k != name]
    if missing:
        raise ValueError(
            f"the action's required field(s) {', '.join(missing)} get no value: set them in env.openenv.action_defaults"
        )
    return name


def _is_string(prop: dict[str, Any]) -> bool:
    if prop.get("type") == "string":
        return True
    return any(p.get("type") == "string" for p in prop.get("anyOf") or [])


def observation_text(obs: Any, wanted: str = "") -> str:
    """An observation's text: ``wanted``'s value, or its string fields (one as it is, several
    as ``name: value`` lines), or its JSON when it has none."""
    if obs is None or isinstance(obs, str):
        return obs or ""
    if not isinstance(obs, dict):
        return json.dumps(obs, default=str)
    if wanted:
        if wanted not in obs:
            raise OpenEnvError(
                f"the observation has no field {wanted!r} (env.openenv.observation_field); "
                f"it has {', '.join(obs) or 'none'}"
            )
        value = obs[wanted]
        return value if isinstance(value, str) else json.dumps(value, default=str)
    texts = [(k, v) for k, v in obs.items() if isinstance(v, str) and k not in NOT_TEXT]
    if len(texts) == 1:
        return texts[0][1]
    if texts:
        return "\n".join(f"{k}: {v}" for k, v in texts)
    rest = {k: v for k, v in obs.items() if k not in NOT_TEXT}
    return json.dumps(rest, default=str) if rest else ""


def as_reward(value: Any) -> float:
    """The step's reward (None: 0); a non-number raises (the episode ends as env_error)."""
    if value is None:
        return 0.0
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        raise OpenEnvError(f"the environment's reward is {type(value).__name__} {value!r}, not a number")
    return float(value)


def reset_data(opts: OpenEnvOptions, row: dict[str, Any], episode_id: str) -> dict[str, Any]:
    """The keyword arguments of the environment's reset: the episode id, the row fields asked
    for (an absent one raises) and the constant ones."""
    missing = [k for k in opts.reset_fields if k not in row]
    if missing:
        raise OpenEnvError(f"env.openenv.reset_fields {missing} are not in the row (it has {', '.join(row)})")
    return {"episode_id": episode_id, **opts.reset_kwargs, **{k: row[k] for k in opts.reset_fields}}


class _Episode:
    """What both the remote and the local environment keep of the text mapping."""

    def __init__(self, opts: OpenEnvOptions, action_field: str) -> None:
        self.opts, self.action_field = opts, action_field
        self.prompt = ""

    def _first(self, result: dict[str, Any], row: dict[str, Any]) -> str:
        # An environment whose reset says nothing: the row's prompt is the first message.
        return observation_text(result.get("observation"), self.opts.observation_field) or str(row.get("prompt", ""))

    def _action(self, text: str) -> dict[str, Any]:
        return {**self.opts.action_defaults, self.action_field: text}

    def _step(self, result: dict[str, Any]) -> Step:
        done = bool(result.get("done"))
        text = observation_text(result.get("observation"), self.opts.observation_field)
        reward = as_reward(result.get("reward"))
        return Step(None if done else (text or " "), reward, done, {})


# -- one event loop for every session of the process --------------------------------------------
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def session_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for OpenEnv sessions (a daemon thread, started on first use)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="rayrlhf-openenv").start()
            _LOOP = loop
        return _LOOP


def _run(coro: Any, timeout: float) -> Any:
    future = asyncio.run_coroutine_threadsafe(coro, session_loop())
    try:
        return future.result(timeout)
    except TimeoutError:
        future.cancel()
        raise


# -- a remote environment: one WebSocket session per episode ------------------------------------
class OpenEnvServer:
    """An OpenEnv server at ``url``: reads its action schema once (``GET /schema``; an
    unreachable server or another kind of server is a ValueError naming it) and makes one
    ``OpenEnvSession`` per episode."""

    def __init__(self, url: str, opts: OpenEnvOptions) -> None:
        import requests

        self.url, self.opts = url.rstrip("/"), opts
        self.ws_url = "ws" + self.url[len("http") :] + "/ws"
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        try:
            resp = requests.get(f"{self.url}/schema", headers=self.headers, timeout=opts.timeout_s)
            resp.raise_for_status()
            action = resp.json()["action"]
        except (requests.RequestException, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{self.url}/schema: {type(e).__name__}: {e} (an OpenEnv server built with "
                "openenv-core's create_app serves its schemas there)"
            ) from None
        self.action_field = choose_action_field(action, opts.action_field, opts.action_defaults)
        # The runner's deadline for a reset: its own wait for a free session comes first.
        self.reset_wait_s = opts.connect_wait_s

    def __call__(self) -> "OpenEnvSession":
        return OpenEnvSession(self)


class OpenEnvSession(_Episode):
    """One episode on its own WebSocket session (see the module docstring)."""

    def __init__(self, server: OpenEnvServer) -> None:
        super().__init__(server.opts, server.action_field)
        self.server = server
        self.ws: Any = None
        self.episode_id = uuid.uuid4().hex
        self.closed = False

    def reset(self, row: dict[str, Any]) -> str:
        if self.ws is not None:
            raise OpenEnvError("an OpenEnv session is reset once: an episode is one session")
        data = reset_data(self.opts, row, self.episode_id)
        result = _run(self._open_and_reset(data), self.opts.connect_wait_s + 2 * self.opts.timeout_s)
        return self._first(result, row)

    def step(self, action: str) -> Step:
        if self.ws is None:  # never sent on a session that was not reset
            raise OpenEnvError("step before reset: the session has no environment of this episode")
        result = _run(self._send({"type": "step", "data": self._action(action)}), self.opts.timeout_s + 1)
        return self._step(result)

    def close(self) -> None:
        """Ends the session (``close`` message, then the socket); never waits: the runner may
        call it from the engine's thread."""
        if not self.closed:
            self.closed = True
            asyncio.run_coroutine_threadsafe(self._close(), session_loop())

    # -- on the event loop -------------------------------------------------------------------------
    async def _open_and_reset(self, data: dict[str, Any]) -> dict[str, Any]:
        """Connects and resets, retrying a server at capacity or not accepting connections
        (backoff up to 2 s) until ``connect_wait_s`` has passed."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        deadline, pause = time.monotonic() + self.opts.connect_wait_s, 0.05
        while True:
            try:
                self.ws = await connect(
                    self.server.ws_url,
                    additional_headers=self.server.headers,
                    open_timeout=self.opts.timeout_s,
                    max_size=2**27,
                    proxy=None,
                )
                return await self._send({"type": "reset", "data": data})
            except InvalidStatus as e:  # the handshake was refused: no retry helps
                raise OpenEnvError(
                    f"{self.server.ws_url}: the server refused the session (HTTP {e.response.status_code})"
                ) from None
            except (CapacityError, OSError) as e:
                await self._drop()
                if self.closed or time.monotonic() + pause > deadline:
                    raise OpenEnvError(
                        f"{self.server.ws_url}: no session within {self.opts.connect_wait_s:g}s: {e}"
                    ) from None
                await asyncio.sleep(pause)
                pause = min(2.0, pause * 2)

    async def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        try:
            await self.ws.send(json.dumps(message))
        except ConnectionClosed:
            pass  # its answer may be waiting: a server at capacity answers, then closes
        try:
            raw = await asyncio.wait_for(self.ws.recv(), self.opts.timeout_s)
        except ConnectionClosed as e:
            raise OpenEnvError(f"{self.server.ws_url}: the session was closed ({e})") from None
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"{self.server.ws_url}: no answer to {message['type']} within {self.opts.timeout_s:g}s"
            ) from None
        reply = json.loads(raw)
        if reply.get("type") == "error":
            err = reply.get("data") or {}
            if err.get("code") == "CAPACITY_REACHED":
                raise CapacityError(str(err.get("message", "at capacity")))
            raise OpenEnvError(f"the environment refused {message['type']}: {err.get('message')} ({err.get('code')})")
        if reply.get("type") != "observation":
            raise OpenEnvError(f"expected an observation, got a {reply.get('type')!r} message")
        return reply.get("data") or {}

    async def _close(self) -> None:
        if self.ws is not None:
            try:
                await self.ws.send(json.dumps({"type": "close"}))
                # The server ends the session and closes the socket itself; closing it first
                # makes the server's own close fail (logged there as an error).
                await asyncio.wait_for(self.ws.wait_closed(), self.opts.timeout_s)
            except Exception:  # already gone, or slow to close: closed below all the same
                pass
        await self._drop()

    async def _drop(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                await ws.close()
            except Exception:  # a socket that cannot close cleanly is closed all the same
                pass


# -- an OpenEnv environment in this process ------------------------------------------------------
def is_openenv_environment_class(obj: Any) -> bool:
    """Whether ``obj`` is an ``openenv-core`` ``Environment`` class (checked without importing
    the package: a module defining one has imported it)."""
    import sys

    mod = sys.modules.get("openenv.core.env_server.interfaces")
    return mod is not None and isinstance(obj, type) and issubclass(obj, mod.Environment)


def action_class(env_cls: type, named: str = "") -> type:
    """The environment's action model: ``named`` ('module:Class'), else the first type argument
    of its ``Environment[Action, Observation, State]`` base."""
    import typing

    if named:
        from actors.imports import import_callable

        return import_callable(named, "env.openenv.action_class")
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and hasattr(args[0], "model_json_schema"):
                return args[0]
    raise ValueError(
        f"{env_cls.__name__} does not declare its action model (Environment[Action, ...]): set env.openenv.action_class"
    )


class LocalOpenEnv(_Episode):
    """An OpenEnv ``Environment`` run in this process with the same text mapping as a remote
    session (its observations serialised as its server would send them)."""

    def __init__(self, env: Any, opts: OpenEnvOptions, action_cls: type, action_field: str) -> None:
        super().__init__(opts, action_field)
        self.env, self.action_cls = env, action_cls
        self.episode_id = uuid.uuid4().hex
        self.was_reset = False

    def reset(self, row: dict[str, Any]) -> str:
        self.was_reset = True
        return self._first(_serialised(self.env.reset(**reset_data(self.opts, row, self.episode_id))), row)

    def step(self, action: str) -> Step:
        if not self.was_reset:
            raise OpenEnvError("step before reset")
        return self._step(_serialised(self.env.step(self.action_cls.model_validate(self._action(action)))))

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def _serialised(obs: Any) -> dict[str, Any]:
    """An observation as OpenEnv's server sends it: its fields but reward, done and metadata,
    and those two beside them."""
    return {
        "observation": obs.model_dump(exclude={"reward", "done", "metadata"}),
        "reward": obs.reward,
        "done": obs.done,
    }


def local_factory(
    env_cls: type, args: dict[str, Any], opts: OpenEnvOptions, action_cls_name: str = ""
) -> Callable[[], LocalOpenEnv]:
    """One ``LocalOpenEnv`` per episode of ``env_cls(**args)``; ValueError for an action model
    that cannot take the reply."""
    cls = action_class(env_cls, action_cls_name)
    field_name = choose_action_field(cls.model_json_schema(), opts.action_field, opts.action_defaults)
    return lambda: LocalOpenEnv(env_cls(**args), opts, cls, field_name)
