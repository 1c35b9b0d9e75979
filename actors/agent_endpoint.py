"""Your own agent program as the rollout: an OpenAI-compatible chat endpoint over a generator.

``rollout.agent: module:function`` names a function ``fn(row, base_url) -> float``: it runs one
episode of an existing agent (the ``openai`` client, an agent SDK) against ``base_url`` and
returns the episode's reward. Each episode gets a base URL of its own
(``http://127.0.0.1:<port>/episodes/<random token>/v1``: the token is its credential; the
endpoint listens on the loopback interface only), so the calls of one episode are told apart
without the program's help.

The endpoint samples with the run's rollout settings (temperature, top_p: the samples stay
on-policy whatever the program asks) and records each call's prompt, sampled token ids and
log-probs. The calls of an episode join into trajectories, token in, token out: a call whose
messages extend an earlier call's messages plus the reply the endpoint gave continues that
trajectory (the earlier ids are kept as sampled; only the new messages are tokenised, as the
chat template renders them after the reply); any other call starts a new segment. Each segment
is one record row with the episode's reward. A program that raises, hangs past its time limit or
returns no number is counted (``agent_error``, ``agent_timeout``) and its episode dropped.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from actors.episodes import ChatTokens, from_client
from actors.generator import token_versions
from actors.tools import parse_tool_calls

log = logging.getLogger("rayrlhf.agent")


@dataclass
class Segment:
    """One trajectory of an episode: a prompt, then the replies (actions) and the ids of the
    messages between them."""

    messages: list[dict]  # the conversation so far, the endpoint's last reply included
    tools: Any
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    truncated: bool = False
    calls: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)


@dataclass
class AgentEpisode:
    key: int
    row: dict
    group: int
    token: str
    segments: list[Segment] = field(default_factory=list)
    reward: float | None = None
    status: str | None = None  # None while running; done, agent_error, agent_timeout
    error: str = ""
    calls: int = 0
    refused: int = 0
    # One call of an episode at a time (its calls extend one another's conversations).
    lock: threading.Lock = field(default_factory=threading.Lock)


def _norm(message: dict) -> tuple:
    """A message as compared between calls (content, and tool calls by name and arguments)."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return message.get("role"), message.get("content") or "", tuple(calls)


class AgentRequestError(ValueError):
    """A call the endpoint refuses (answered 400 with the reason)."""


class AgentRunner:
    """Runs agent programs against the endpoint for one batch (the ``Feed`` of
    ``EngineLoop.stream``: their calls' generations join the engine's running batch)."""

    def __init__(self, chat: ChatTokens, limits: Any, sampling: Callable[[int, int, int], Any], pool: Any,
                 episode_timeout_s: float) -> None:
        self.chat, self.limits, self.sampling, self.pool = chat, limits, sampling, pool
        self.episode_timeout_s = episode_timeout_s
        self._cv = threading.Condition()
        self._queue: list[tuple[Any, dict, Any]] = []
        self.episodes: dict[str, AgentEpisode] = {}
        self._open = 0

    # -- the batch -------------------------------------------------------------------------------
    def run(self, loop: Any, endpoint: "AgentEndpoint", agent: Callable, rows: list[dict], group_ids: list[int],
            n: int) -> list[AgentEpisode]:
        episodes = [AgentEpisode(k * n + j, row, g, secrets.token_urlsafe(16))
                    for k, (row, g) in enumerate(zip(rows, group_ids)) for j in range(n)]
        self.episodes = {ep.token: ep for ep in episodes}
        self._open = len(episodes)
        endpoint.attach(self)
        self._deadline = time.monotonic() + self.episode_timeout_s
        try:
            for ep in episodes:
                self.pool.submit(self._play, agent, ep, endpoint.base_url(ep.token))
            loop.stream(self)
        finally:
            endpoint.detach(self)
        return episodes

    def _play(self, agent: Callable, ep: AgentEpisode, base_url: str) -> None:
        try:
            reward = agent(ep.row, base_url)
            reward = float(reward)
            self._end(ep, "done", reward)
        except Exception as e:  # the program's failure ends its episode, never the batch
            log.warning("agent episode %d failed: %s: %s", ep.key, type(e).__name__, e)
            ep.error = f"{type(e).__name__}: {e}"
            self._end(ep, "agent_error")

    def _end(self, ep: AgentEpisode, status: str, reward: float | None = None) -> None:
        with self._cv:
            if ep.status is not None:
                return
            ep.status, ep.reward = status, reward
            self._open -= 1
            self._cv.notify_all()

    # -- the Feed --------------------------------------------------------------------------------
    def ready(self) -> list:
        with self._cv:
            out, self._queue = self._queue, []
        return out

    def finished(self, waiter: "_Call", output: Any) -> None:
        waiter.output = output
        waiter.done.set()

    def expecting(self) -> bool:
        if time.monotonic() > self._deadline:
            for ep in list(self.episodes.values()):
                self._end(ep, "agent_timeout")
        with self._cv:
            return self._open > 0 or bool(self._queue)

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._queue and self._open > 0:
                self._cv.wait(timeout)

    # -- one call --------------------------------------------------------------------------------
    def complete(self, token: str, body: dict) -> dict:
        """A chat completion for episode ``token``; raises AgentRequestError (400) or KeyError (404)."""
        ep = self.episodes[token]
        with ep.lock:
            try:
                return self._complete(ep, body)
            except AgentRequestError:
                ep.refused += 1
                raise

    def _complete(self, ep: AgentEpisode, body: dict) -> dict:
        if ep.status is not None:
            raise AgentRequestError("this episode has ended")
        messages, tools = _check_request(body)
        ep.calls += 1
        if ep.calls > self.limits.max_turns:
            raise AgentRequestError(f"the episode's call limit ({self.limits.max_turns}) is reached")
        seg, delta = self._continued(ep, messages, tools)
        new = seg is None
        if new:
            seg = Segment(messages, tools, self.chat.prompt_messages(from_client(messages), tools))
        room = min(self.limits.max_new_tokens, int(body.get("max_completion_tokens") or body.get("max_tokens") or 10**9),
                   self.limits.max_tokens - seg.length - len(delta))
        if room < 1:
            raise AgentRequestError(f"the episode's token budget ({self.limits.max_tokens}) is spent")
        if new:
            ep.segments.append(seg)
        call = _Call()
        with self._cv:
            self._queue.append((call, {"prompt_token_ids": seg.prompt_ids + seg.ids + delta},
                                self.sampling(room, ep.key, ep.calls)))
            self._cv.notify_all()
        call.done.wait()
        comp = call.output.outputs[0]
        sampled = list(comp.token_ids)
        lps = [float(step[t].logprob) for t, step in zip(sampled, comp.logprobs)]
        seg.ids += delta + sampled
        seg.action += [False] * len(delta) + [True] * len(sampled)
        seg.logprobs += [0.0] * len(delta) + lps
        seg.versions += [None] * len(delta) + token_versions(comp.weight_versions, len(sampled))
        seg.truncated, seg.calls = comp.finish_reason == "length", seg.calls + 1
        reply = _reply_message(comp.text, tools)
        seg.messages = messages + [reply]
        return _response(reply, comp, sampled, lps, len(seg.prompt_ids) + len(seg.ids) - len(sampled),
                         self.chat.tok, bool(body.get("logprobs")))

    def _continued(self, ep: AgentEpisode, messages: list[dict], tools: Any) -> tuple[Segment | None, list[int]]:
        """The segment these messages extend (its conversation, the last reply included, is their
        start) and the ids of the new messages; (None, []) for a new segment."""
        for seg in reversed(ep.segments):
            k = len(seg.messages)
            if tools == seg.tools and len(messages) > k and [_norm(m) for m in messages[:k]] == [_norm(m) for m in seg.messages]:
                ended = bool(seg.ids) and seg.ids[-1] == self.chat.tok.eos_token_id
                return seg, self.chat.after_reply(from_client(messages[k:]), reply_ended=ended)
        return None, []


class _Call:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.output: Any = None


def _check_request(body: dict) -> tuple[list[dict], Any]:
    if not isinstance(body, dict):
        raise AgentRequestError("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise AgentRequestError("messages must be a non-empty list of {role, content} objects")
    if body.get("stream"):
        raise AgentRequestError("stream=true is not supported by the rollout endpoint")
    if int(body.get("n") or 1) != 1:
        raise AgentRequestError("n must be 1 (each sample is an episode of its own)")
    tools = body.get("tools") or None
    return messages, tools


def _reply_message(text: str, tools: Any) -> dict:
    """The assistant message: tool calls parsed from the reply when the request offered tools."""
    calls = [c for c in parse_tool_calls(text) if not c.error] if tools else []
    if not calls:
        return {"role": "assistant", "content": text}
    head = text[: text.find("<tool_call>")].strip()
    return {"role": "assistant", "content": head or None, "tool_calls": [
        {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]}


def _response(reply: dict, comp: Any, sampled: list[int], lps: list[float], prompt_len: int, tok: Any,
              with_logprobs: bool) -> dict:
    finish = "tool_calls" if reply.get("tool_calls") else ("length" if comp.finish_reason == "length" else "stop")
    choice: dict[str, Any] = {"index": 0, "message": reply, "finish_reason": finish, "token_ids": sampled}
    if with_logprobs:
        choice["logprobs"] = {"content": [{"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                                          for t, lp in zip(sampled, lps)]}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": "policy", "choices": [choice],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(sampled),
                      "total_tokens": prompt_len + len(sampled)}}


class _Server(ThreadingHTTPServer):
    # Every episode's program may connect at once: the default backlog of 5 pending connections
    # refused some of a batch's 32 under load ("Connection error" in the client).
    request_queue_size = 1024
    daemon_threads = True


class AgentEndpoint:
    """The HTTP server (one per generator, on 127.0.0.1): routes each call to its episode."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.runner: AgentRunner | None = None
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                token = endpoint._token(self.path, "/v1/models")
                if token is None:
                    return self._send(404, {"error": {"message": "not found"}})
                self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802
                token = endpoint._token(self.path, "/v1/chat/completions")
                runner = endpoint.runner
                if token is None or runner is None or token not in runner.episodes:
                    return self._send(404, {"error": {"message": "no such episode"}})
                try:
                    size = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(size) or b"null")
                    self._send(200, runner.complete(token, body))
                except (AgentRequestError, json.JSONDecodeError, ValueError, TypeError) as e:
                    self._send(400, {"error": {"message": str(e), "type": "invalid_request_error"}})

            def _send(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = _Server((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True, name="rayrlhf-agent-endpoint").start()

    def base_url(self, token: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/episodes/{token}/v1"

    @staticmethod
    def _token(path: str, route: str) -> str | None:
        parts = path.split("?", 1)[0]
        if not parts.startswith("/episodes/") or not parts.endswith(route):
            return None
        return parts[len("/episodes/"):-len(route)] or None

    def attach(self, runner: AgentRunner) -> None:
        self.runner = runner

    def detach(self, runner: AgentRunner) -> None:
        if self.runner is runner:
            self.runner = None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def agent_summary(episodes: list[AgentEpisode]) -> tuple[dict[str, int], dict[str, float]]:
    """(dropped episodes by reason, counters: episodes, calls, segments, refused calls, statuses)."""
    dropped: dict[str, int] = {}
    counts: dict[str, float] = {"episodes": len(episodes), "turns": 0, "segments": 0, "refused_calls": 0}
    for ep in episodes:
        counts[f"status_{ep.status}"] = counts.get(f"status_{ep.status}", 0) + 1
        counts["refused_calls"] += ep.refused
        if ep.status != "done" or not ep.segments:
            reason = ep.status if ep.status != "done" else "agent_no_calls"
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        counts["kept"] = counts.get("kept", 0) + 1
        counts["turns"] += sum(seg.calls for seg in ep.segments)
        counts["segments"] += len(ep.segments)
    return dropped, counts


def resolve_agent(spec: str) -> Callable[[dict, str], Any]:
    """``module:function`` of an agent program; ValueError naming what is wrong."""
    from actors.imports import import_callable

    return import_callable(spec, "rollout.agent")
