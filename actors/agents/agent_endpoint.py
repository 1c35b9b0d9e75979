"""Your own agent program as the rollout: an OpenAI-compatible endpoint over a generator.

``rollout.agent: module:function`` names ``fn(row, base_url) -> float`` or ``async def fn(row,
base_url) -> float``: it plays one episode of an existing agent (the ``openai`` client, the
OpenAI Agents SDK, LangChain, verifiers...) against ``base_url`` and returns its reward. Each
episode gets a base URL of its own (``http://127.0.0.1:<port>/episodes/<random token>/v1``:
the token is its credential; the endpoint listens on the loopback interface only), so the calls
of one episode are told apart without the program's help. Plain functions run on a thread
each (``env.workers`` at once); ``async def`` programs run together on one event loop.

The endpoint (``actors/agents/agent_server.py``) serves chat completions, the Responses API and
completions, streamed or not (``actors/agents/openai_api.py``). It samples with the run's rollout
settings (temperature, top_p: the samples stay on-policy whatever the program asks) and records
each call's context, sampled token ids and log-probs. The calls of an episode join into
trajectories, token in, token out: a call whose context extends an earlier call's context plus
the reply it got (its messages, or its prompt's text or ids) continues that trajectory, whose
earlier ids are kept as sampled and whose new part alone is tokenised (messages as the chat
template renders them after the reply); any other call starts a new segment, and each of a
call's ``n > 1`` replies is a segment of its own. Each segment is one record row with the
episode's reward. A program that raises, hangs past its time limit or returns no finite number
is counted (``agent_error``, ``agent_timeout``) and its episode dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from actors.agents.chat_tokens import ChatTokens, from_client
from actors.agents.openai_api import (
    ApiError,
    Ask,
    Choice,
    chat_reply,
    chat_stream,
    completion_reply,
    completion_stream,
    finish_reason,
    parse_chat,
    parse_completion,
    parse_responses,
    reply_message,
    responses_reply,
    responses_stream,
)
from actors.rollout.records import Rollout, Sampled, row_routes, share_group_prompt_routes, token_versions

log = logging.getLogger("rayrlhf.agent")


@dataclass
class Segment:
    """One trajectory of an episode: a prompt, then the replies (actions) and the ids of what
    came between them."""

    kind: str  # chat (messages) | text (a completions prompt)
    messages: list[dict]  # chat: the conversation so far, the last reply included
    tools: Any
    prompt_ids: list[int]
    text: str | None = None  # text: the prompt and replies so far, when the prompt was text
    ids: list[int] = field(default_factory=list)
    action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    truncated: bool = False
    calls: int = 0
    # Per call: the MoE experts the engine routed its context and reply to (None: not recorded).
    call_routes: list[Any] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def fork(self) -> "Segment":
        return replace(
            self,
            messages=list(self.messages),
            ids=list(self.ids),
            action=list(self.action),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            call_routes=list(self.call_routes),
        )


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
    # Responses API: each response's conversation (its input and its reply), by response id.
    responses: dict[str, list[dict]] = field(default_factory=dict)
    # What the program reported beside its reward (a rubric's functions, its metrics), by name.
    components: dict[str, float] = field(default_factory=dict)
    # One call of an episode at a time (its calls extend one another's contexts); made on the
    # endpoint's event loop.
    lock: asyncio.Lock | None = None


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
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return message.get("role"), content or "", tuple(calls)


@dataclass
class Answer:
    """What the endpoint sends back: a JSON body, or Server-Sent Events."""

    body: dict | None = None
    events: Iterator[str] | None = None


class _Waiter:
    """A call's generation: resolved on the endpoint's event loop by the engine's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future = self.loop.create_future()

    def _settle(self, output: Any = None, error: BaseException | None = None) -> None:
        if not self.future.done():
            self.future.set_exception(error) if error is not None else self.future.set_result(output)

    def resolve(self, output: Any = None, error: BaseException | None = None) -> None:
        self.loop.call_soon_threadsafe(self._settle, output, error)


class AgentRunner:
    """Runs agent programs against the endpoint for one batch (the ``Feed`` of
    ``EngineLoop.stream``: their calls' generations join the engine's running batch)."""

    def __init__(
        self,
        chat: ChatTokens,
        limits: Any,
        sampling: Callable[..., Any],
        pool: Any,
        episode_timeout_s: float,
        models: tuple[str, ...] = ("policy",),
    ) -> None:
        self.chat, self.limits, self.sampling, self.pool = chat, limits, sampling, pool
        self.episode_timeout_s, self.models = episode_timeout_s, tuple(models)
        self._cv = threading.Condition()
        self._queue: list[tuple[Any, dict, Any]] = []
        self._waiting: set[_Waiter] = set()
        self.episodes: dict[str, AgentEpisode] = {}
        self._open = 0
        self._deadline = math.inf

    # -- the batch -------------------------------------------------------------------------------
    def run(
        self, loop: Any, endpoint: Any, agent: Callable, rows: list[dict], group_ids: list[int], n: int
    ) -> list[AgentEpisode]:
        episodes = [
            AgentEpisode(k * n + j, row, g, secrets.token_urlsafe(16))
            for k, (row, g) in enumerate(zip(rows, group_ids))
            for j in range(n)
        ]
        self.episodes = {ep.token: ep for ep in episodes}
        self._open = len(episodes)
        endpoint.attach(self)
        self._deadline = time.monotonic() + self.episode_timeout_s
        programs = _Programs(agent, self.pool)
        try:
            for ep in episodes:
                programs.start(ep, endpoint.base_url(ep.token), self._end)
            loop.stream(self)
        finally:
            endpoint.detach(self)
            programs.cancel()
            self._fail_waiting(RuntimeError("the batch ended"))
        return episodes

    def _end(self, ep: AgentEpisode, status: str, reward: Any = None, error: str = "") -> None:
        if status == "done" and isinstance(reward, dict):  # {"reward": x, "components": {name: value}}
            ep.components = {
                str(k): float(v)
                for k, v in (reward.get("components") or {}).items()
                if isinstance(v, (int, float)) and math.isfinite(v)
            }
            reward = reward.get("reward")
        if status == "done":
            try:
                reward = float(reward)
            except (TypeError, ValueError):
                status, error = "agent_error", f"returned {type(reward).__name__} {reward!r}, not a reward"
            else:
                if not math.isfinite(reward):
                    status, error = "agent_error", f"returned a non-finite reward ({reward})"
        if error:
            log.warning("agent episode %d: %s", ep.key, error)
        with self._cv:
            if ep.status is not None:
                return
            ep.status, ep.reward, ep.error = status, reward if status == "done" else None, error
            self._open -= 1
            self._cv.notify_all()

    def _fail_waiting(self, error: BaseException) -> None:
        with self._cv:
            waiting, self._waiting, self._queue = list(self._waiting), set(), []
        for w in waiting:
            w.resolve(error=error)

    # -- the Feed --------------------------------------------------------------------------------
    def ready(self) -> list:
        with self._cv:
            out, self._queue = self._queue, []
        return out

    def finished(self, waiter: _Waiter, output: Any) -> None:
        with self._cv:
            self._waiting.discard(waiter)
        waiter.resolve(output)

    def expecting(self) -> bool:
        if time.monotonic() > self._deadline:
            for ep in list(self.episodes.values()):
                self._end(ep, "agent_timeout", error=f"still running after {self.episode_timeout_s:g}s")
        with self._cv:
            return self._open > 0 or bool(self._queue)

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._queue and self._open > 0:
                self._cv.wait(timeout)

    # -- one call (on the endpoint's event loop) -------------------------------------------------
    async def answer(self, token: str, route: str, body: Any) -> Answer:
        """A reply to episode ``token``'s request on ``route`` (chat, responses, completions);
        raises ApiError (a 400, counted as a refused call) or KeyError (no such episode: 404)."""
        ep = self.episodes[token]
        if ep.lock is None:
            ep.lock = asyncio.Lock()
        async with ep.lock:
            try:
                return await self._answer(ep, route, body)
            except ApiError:
                ep.refused += 1
                raise

    async def _answer(self, ep: AgentEpisode, route: str, body: Any) -> Answer:
        if ep.status is not None:
            raise ApiError("this episode has ended", code="episode_ended")
        ask = self._parse(ep, route, body)
        ep.calls += 1
        if ep.calls > self.limits.max_turns:
            raise ApiError(
                f"the episode's call limit ({self.limits.max_turns}, env.max_turns) is reached",
                code="episode_call_limit",
            )
        seg, delta = self._continued(ep, ask)
        new = seg is None
        seg = seg or self._new_segment(ask)
        room = min(
            self.limits.max_new_tokens, ask.max_tokens or 10**9, self.limits.max_tokens - seg.length - len(delta)
        )
        if room < 1:
            raise ApiError(
                f"the episode's token budget ({self.limits.max_tokens}, env.max_tokens) is spent",
                code="episode_token_limit",
            )
        context = seg.prompt_ids + seg.ids + delta
        output = await self._generate(context, self.sampling(room, ep.key, ep.calls, n=ask.n, stop=ask.stop))
        choices = [self._choice(ask, comp) for comp in output.outputs]
        self._record(ep, ask, seg, new, delta, output.outputs, choices)
        return self._reply(ep, ask, choices, context)

    def _parse(self, ep: AgentEpisode, route: str, body: Any) -> Ask:
        if route == "chat":
            return parse_chat(body, self.models)
        if route == "completions":
            return parse_completion(body, self.models)
        return parse_responses(body, self.models, ep.responses.get)

    async def _generate(self, prompt_ids: list[int], params: Any) -> Any:
        waiter = _Waiter()
        with self._cv:
            self._waiting.add(waiter)
            self._queue.append((waiter, {"prompt_token_ids": prompt_ids}, params))
            self._cv.notify_all()
        return await waiter.future

    def _choice(self, ask: Ask, comp: Any) -> Choice:
        sampled = list(comp.token_ids)
        lps = [float(step[t].logprob) for t, step in zip(sampled, comp.logprobs)]
        message = reply_message(comp.text, ask.tools, ask.tool_choice) if ask.route != "completions" else {}
        tokens = [self.chat.tok.decode([t]) for t in sampled] if ask.logprobs else []
        return Choice(comp.text, message, sampled, lps, finish_reason(message, comp.finish_reason == "length"), tokens)

    def _reply(self, ep: AgentEpisode, ask: Ask, choices: list[Choice], context: list[int]) -> Answer:
        if ask.route == "chat":
            return (
                Answer(events=chat_stream(ask, choices, context))
                if ask.stream
                else Answer(chat_reply(ask, choices, context))
            )
        if ask.route == "completions":
            return (
                Answer(events=completion_stream(ask, choices, context))
                if ask.stream
                else Answer(completion_reply(ask, choices, context))
            )
        response_id = f"resp_{uuid.uuid4().hex}"
        ep.responses[response_id] = ask.messages + [choices[0].message]
        return (
            Answer(events=responses_stream(ask, choices[0], context, response_id))
            if ask.stream
            else Answer(responses_reply(ask, choices[0], context, response_id))
        )

    # -- trajectories ----------------------------------------------------------------------------
    def _new_segment(self, ask: Ask) -> Segment:
        if ask.route == "completions":
            if isinstance(ask.prompt, list):
                return Segment("text", [], None, list(ask.prompt))
            return Segment("text", [], None, list(self.chat.tok.encode(ask.prompt)), text=ask.prompt)
        return Segment("chat", ask.messages, ask.tools, self.chat.prompt_messages(from_client(ask.messages), ask.tools))

    def _continued(self, ep: AgentEpisode, ask: Ask) -> tuple[Segment | None, list[int]]:
        """The segment this request's context extends, and the ids of its new part; (None, [])
        for a new segment."""
        for seg in reversed(ep.segments):
            if ask.route == "completions" and seg.kind == "text":
                delta = self._text_delta(seg, ask.prompt)
            elif ask.route != "completions" and seg.kind == "chat":
                delta = self._chat_delta(seg, ask)
            else:
                continue
            if delta is not None:
                return seg, delta
        return None, []

    def _chat_delta(self, seg: Segment, ask: Ask) -> list[int] | None:
        k = len(seg.messages)
        if ask.tools != seg.tools or len(ask.messages) <= k:
            return None
        if [_norm(m) for m in ask.messages[:k]] != [_norm(m) for m in seg.messages]:
            return None
        ended = bool(seg.ids) and seg.ids[-1] == self.chat.tok.eos_token_id
        return self.chat.after_reply(from_client(ask.messages[k:]), reply_ended=ended)

    def _text_delta(self, seg: Segment, prompt: str | list[int]) -> list[int] | None:
        if isinstance(prompt, list):
            whole = seg.prompt_ids + seg.ids
            return prompt[len(whole) :] if len(prompt) > len(whole) and prompt[: len(whole)] == whole else None
        if seg.text is None or len(prompt) <= len(seg.text) or not prompt.startswith(seg.text):
            return None
        return list(self.chat.tok.encode(prompt[len(seg.text) :], add_special_tokens=False))

    def _record(
        self, ep: AgentEpisode, ask: Ask, seg: Segment, new: bool, delta: list[int], comps: list, choices: list[Choice]
    ) -> None:
        """The first reply extends ``seg`` (new or continued); every other one extends a copy of
        it as it was before this call."""
        before = seg.fork()
        for i, (comp, choice) in enumerate(zip(comps, choices)):
            target = seg if i == 0 else before.fork()
            target.ids += delta + choice.token_ids
            target.action += [False] * len(delta) + [True] * len(choice.token_ids)
            target.logprobs += [0.0] * len(delta) + choice.logprobs
            target.versions += [None] * len(delta) + token_versions(comp.weight_versions, len(choice.token_ids))
            target.truncated, target.calls = comp.finish_reason == "length", target.calls + 1
            target.call_routes.append(getattr(comp, "routed_experts", None))
            if target.kind == "chat":
                target.messages = list(ask.messages) + [choice.message]
            else:  # a prompt given as ids has no text to go on from by text
                target.text = ask.prompt + choice.text if isinstance(ask.prompt, str) else None
            if i > 0 or new:
                ep.segments.append(target)


_PROGRAMS_LOOP: asyncio.AbstractEventLoop | None = None
_PROGRAMS_LOCK = threading.Lock()


def programs_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for ``async def`` agent programs (a daemon thread, started on
    first use): it outlives a batch, so what a program opens once (a verifiers environment's
    servers, a client's connection pool) stays open for the next."""
    global _PROGRAMS_LOOP
    with _PROGRAMS_LOCK:
        if _PROGRAMS_LOOP is None or _PROGRAMS_LOOP.is_closed():
            _PROGRAMS_LOOP = asyncio.new_event_loop()
            threading.Thread(target=_PROGRAMS_LOOP.run_forever, daemon=True, name="rayrlhf-agents").start()
        return _PROGRAMS_LOOP


class _Programs:
    """Agent programs of one batch: plain functions on the pool's threads, ``async def`` ones
    together on the programs' event loop."""

    def __init__(self, agent: Callable, pool: Any) -> None:
        self.agent, self.pool = agent, pool
        is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))
        self.loop = programs_loop() if is_async else None
        self.tasks: list[Any] = []

    def start(self, ep: AgentEpisode, base_url: str, end: Callable) -> None:
        if self.loop is not None:
            self.tasks.append(asyncio.run_coroutine_threadsafe(self._play_async(ep, base_url, end), self.loop))
        else:
            self.pool.submit(self._play, ep, base_url, end)

    def _play(self, ep: AgentEpisode, base_url: str, end: Callable) -> None:
        try:
            end(ep, "done", self.agent(ep.row, base_url))
        except Exception as e:  # the program's failure ends its episode, never the batch
            end(ep, "agent_error", error=f"{type(e).__name__}: {e}")

    async def _play_async(self, ep: AgentEpisode, base_url: str, end: Callable) -> None:
        try:
            end(ep, "done", await self.agent(ep.row, base_url))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            end(ep, "agent_error", error=f"{type(e).__name__}: {e}")

    def cancel(self) -> None:
        """Cancels this batch's async programs still running (timed out)."""
        for task in self.tasks:
            task.cancel()


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
        for name, value in ep.components.items():  # logged as their means (cluster/ops/metrics.py)
            counts[f"{name}/sum"] = counts.get(f"{name}/sum", 0.0) + value
            counts[f"{name}/n"] = counts.get(f"{name}/n", 0.0) + 1
    return dropped, counts


def play_agents(
    loop: Any,
    chat: ChatTokens,
    rows: list[dict],
    group_ids: list[int],
    n: int,
    agent: Callable,
    endpoint: Any,
    limits: Any,
    sampling: Callable[..., Any],
    pool: Any,
    timeout_s: float = 300.0,
    models: tuple[str, ...] = ("policy",),
) -> Rollout:
    """The agent-program strategy over an engine loop: ``n`` episodes per row of ``agent(row,
    base_url) -> reward`` against ``endpoint`` (``AgentRunner``), one ``Sampled`` row per
    trajectory segment of a finished program (its reward in ``meta["episode"]``); failed
    programs dropped and counted. ValueError when none finished."""
    episodes = AgentRunner(chat, limits, sampling, pool, timeout_s, models).run(
        loop, endpoint, agent, rows, group_ids, n
    )
    dropped, counts = agent_summary(episodes)
    out = []
    for ep in episodes:
        if ep.status != "done":
            continue
        meta = {
            **ep.row.get("meta", {}),
            "episode": {"reward": ep.reward, "calls": ep.calls, "segments": len(ep.segments), "status": ep.status},
        }
        out += [
            Sampled(
                seg.prompt_ids,
                seg.ids,
                seg.logprobs,
                seg.truncated,
                chat.tok.decode(seg.ids),
                meta,
                ep.group,
                seg.versions,
                seg.action,
                row_routes(seg.call_routes, len(seg.prompt_ids), seg.action),
            )
            for seg in ep.segments
        ]
    if not out:
        errors = sorted({ep.error or str(ep.status) for ep in episodes})[:3]
        raise ValueError(f"no agent episode of a batch of {len(episodes)} finished: {dropped}; e.g. {errors}")
    share_group_prompt_routes(out)
    return Rollout(out, dropped, counts)


def resolve_agent(spec: str, args: dict | None = None, max_tokens: int = 64) -> Callable[[dict, str], Any]:
    """``module:function`` of an agent program, or ``verifiers:<id>`` (the environment's own
    rollout, ``actors/agents/verifiers_env.py``, with ``args`` over its config and ``max_tokens`` per
    reply); ValueError naming what is wrong."""
    if spec.startswith("verifiers:"):
        from actors.agents.verifiers_env import VerifiersProgram

        return VerifiersProgram(spec[len("verifiers:") :], args or {}, max_tokens)
    from actors.imports import import_callable

    return import_callable(spec, "rollout.agent")
