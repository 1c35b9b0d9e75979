"""Multi-turn rollouts: many episodes in flight on one vLLM engine, token in, token out.

An episode alternates the model's turns and the environment's answers (``actors/agents/environments.py``).
Its record is one row: the prompt's ids, then each turn's sampled ids exactly as the engine
returned them, then the observation's ids, and so on. The model's own text is never tokenised
again (decoding and encoding a reply can give other ids, and the learner would then train on
tokens nobody sampled); each observation is tokenised once, as the chat template renders it
after the reply (``ChatTokens``). Only the model's tokens are actions (``response_mask``); the
observations' tokens are context, with no loss, advantage or log-prob of their own.

Scheduling: every episode's next turn joins the engine's running batch the moment its
environment answered (``EngineLoop.stream``), and environment steps run on a thread pool, so a
slow environment or tool holds back its own episode only. Limits: turns, total tokens (the
engine's context), and a timeout per environment call; an environment that raises, hangs or
returns garbage ends its episode, which is dropped and counted (``env_error``, ``env_timeout``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.agents.chat_tokens import ChatTokens
from actors.agents.env_step import as_step
from actors.agents.environments import EpisodeLimits
from actors.rollout.records import Rollout, Sampled, row_routes, share_group_prompt_routes, token_versions

log = logging.getLogger("rayrlhf.episodes")


@dataclass
class Episode:
    key: int
    row: dict[str, Any]
    group: int
    env: Any = None
    tools: list[dict] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    # After the prompt: sampled and observation ids, which of them are actions, their rollout
    # log-probs and weight versions (0.0 / None at observation tokens).
    ids: list[int] = field(default_factory=list)
    action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    # Per turn: [first action index, end of the actions, end of the observation] in ``ids``.
    spans: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    # Per turn: whether the reply ended by itself (not cut at its token limit).
    ended: list[bool] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    # Per turn: the MoE experts the engine routed the call's tokens to (None: not recorded).
    turn_routes: list[Any] = field(default_factory=list)
    # None while running; done, max_turns, max_tokens, env_error, env_timeout, prompt_too_long.
    status: str | None = None
    truncated: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)


# What a turn boundary's snapshot keeps of an episode: enough to go on from there.
SNAPSHOT_FIELDS = (
    "prompt_ids",
    "ids",
    "action",
    "logprobs",
    "versions",
    "rewards",
    "spans",
    "texts",
    "ended",
    "truncated",
)


def snapshot(ep: Episode) -> dict[str, Any]:
    """An episode at a turn boundary (its next turn not sampled yet), as plain data."""
    out = {f: getattr(ep, f) for f in SNAPSHOT_FIELDS}
    # Copies: the episode goes on changing its lists while the snapshot travels.
    return {
        **{k: list(v) if isinstance(v, list) else v for k, v in out.items()},
        "spans": [list(s) for s in ep.spans],
        "info": dict(ep.info),
    }


class EpisodeRunner:
    """Runs a batch of episodes on an engine loop (the ``Feed`` of ``EngineLoop.stream``).

    Turn boundaries: ``journal(episode_key, snapshot)``, where given, is told of each episode
    whose environment has answered and whose next turn is about to be sampled. An episode with a
    snapshot in ``resume`` (an earlier, interrupted run of the same batch) goes on from it: a
    fresh environment is reset and replays the snapshot's replies, and if it answers each as
    recorded, the episode continues at its next turn; if not (an environment that is not
    deterministic), it starts over (``info["resume"]``: resumed / replay_mismatch)."""

    def __init__(
        self,
        chat: ChatTokens,
        make_env: Callable[[], Any],
        limits: EpisodeLimits,
        sampling: Callable[[int, int, int], Any],
        pool: concurrent.futures.ThreadPoolExecutor,
        journal: Callable[[int, dict], None] | None = None,
        resume: dict[int, dict] | None = None,
    ) -> None:
        self.chat, self.make_env, self.limits, self.sampling, self.pool = chat, make_env, limits, sampling, pool
        self.journal, self.resume = journal, dict(resume or {})
        self._cv = threading.Condition()
        self._ready: deque[Episode] = deque()
        # Episodes whose environment call is out: key -> (deadline, episode).
        self._waiting_env: dict[int, tuple[float, Episode]] = {}
        self._open = 0

    def run(self, loop: Any, rows: list[dict], group_ids: list[int], n: int) -> list[Episode]:
        episodes = [Episode(k * n + j, row, g) for k, (row, g) in enumerate(zip(rows, group_ids)) for j in range(n)]
        self._open = len(episodes)
        # A reset may first wait for a free session of a remote environment (actors/agents/openenv.py).
        reset_wait = float(getattr(self.make_env, "reset_wait_s", 0.0))
        for ep in episodes:
            self._call_env(ep, self._reset, ep, extra_s=reset_wait)
        loop.stream(self)
        return episodes

    # -- the Feed of EngineLoop.stream -----------------------------------------------------------
    def ready(self) -> list[tuple[Any, dict, Any]]:
        self._expire()
        out = []
        with self._cv:
            while self._ready:
                ep = self._ready.popleft()
                room = min(self.limits.max_new_tokens, self.limits.max_tokens - ep.length)
                out.append(
                    (ep, {"prompt_token_ids": ep.prompt_ids + ep.ids}, self.sampling(room, ep.key, len(ep.spans)))
                )
        return out

    def finished(self, ep: Episode, output: Any) -> None:
        comp = output.outputs[0]
        sampled = list(comp.token_ids)
        start = len(ep.ids)
        ep.ids += sampled
        ep.action += [True] * len(sampled)
        ep.logprobs += [float(step[t].logprob) for t, step in zip(sampled, comp.logprobs)]
        ep.versions += token_versions(comp.weight_versions, len(sampled))
        ep.spans.append([start, len(ep.ids), len(ep.ids)])
        ep.texts.append(comp.text)
        ep.truncated = comp.finish_reason == "length"
        ep.ended.append(not ep.truncated)
        ep.turn_routes.append(getattr(comp, "routed_experts", None))
        self._call_env(ep, self._step, ep, comp.text)

    def expecting(self) -> bool:
        with self._cv:
            return self._open > 0

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._ready and self._open > 0:
                self._cv.wait(timeout)
        self._expire()

    # -- environment calls -----------------------------------------------------------------------
    def _call_env(self, ep: Episode, fn: Callable, *args: Any, extra_s: float = 0.0) -> None:
        with self._cv:
            self._waiting_env[ep.key] = (time.monotonic() + self.limits.step_timeout_s + extra_s, ep)
        self.pool.submit(self._guarded, ep, fn, *args)

    def _guarded(self, ep: Episode, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # the environment's failure ends its episode, never the batch
            log.warning("episode %d: environment failed: %s: %s", ep.key, type(e).__name__, e)
            ep.info["error"] = f"{type(e).__name__}: {e}"
            self._end(ep, "env_timeout" if isinstance(e, TimeoutError) else "env_error")

    def _reset(self, ep: Episode) -> None:
        ep.env = self.make_env()
        first = ep.env.reset(ep.row)
        ep.tools = getattr(ep.env, "tools", None) or None
        ep.prompt_ids = self.chat.prompt(first, ep.tools)
        if ep.length + 1 > self.limits.max_tokens:
            self._end(ep, "prompt_too_long")
            return
        saved = self.resume.pop(ep.key, None)
        if saved is not None and not self._replay(ep, saved):
            self._reset(ep)  # the environment answered otherwise: the episode starts over
            return
        self._next_turn(ep)

    def _replay(self, ep: Episode, saved: dict[str, Any]) -> bool:
        """Brings a freshly reset environment to the snapshot's turn boundary by replaying its
        replies; adopts the snapshot if every answer is the recorded one."""
        if saved.get("prompt_ids") != ep.prompt_ids:
            ep.info["resume"] = "replay_mismatch"
            return False
        for (_, end, obs_end), text, ended, reward in zip(
            saved["spans"], saved["texts"], saved["ended"], saved["rewards"]
        ):
            step = as_step(ep.env.step(text))
            if (
                step.done
                or step.observation is None
                or float(step.reward) != reward
                or (self.chat.observation(step.observation, reply_ended=ended) != saved["ids"][end:obs_end])
            ):
                ep.info["resume"] = "replay_mismatch"
                ep.env = self.make_env()
                return False
        for f in SNAPSHOT_FIELDS:
            setattr(ep, f, saved[f])
        ep.info = {**saved.get("info", {}), "resume": "resumed", "resumed_turns": len(saved["spans"])}
        return True

    def _step(self, ep: Episode, text: str) -> None:
        step = as_step(ep.env.step(text))
        reward = float(step.reward)
        ep.rewards.append(reward)
        ep.info.update(step.info)
        if step.done or step.observation is None:
            self._end(ep, "done")
            return
        if len(ep.spans) >= self.limits.max_turns:
            self._end(ep, "max_turns")
            return
        obs = self.chat.observation(step.observation, reply_ended=not ep.truncated)
        if ep.length + len(obs) + 1 > self.limits.max_tokens:
            self._end(ep, "max_tokens")
            return
        ep.ids += obs
        ep.action += [False] * len(obs)
        ep.logprobs += [0.0] * len(obs)
        ep.versions += [None] * len(obs)
        ep.spans[-1][2] = len(ep.ids)
        self._next_turn(ep)

    def _next_turn(self, ep: Episode) -> None:
        with self._cv:
            if ep.key not in self._waiting_env:  # timed out meanwhile: already ended
                return
            del self._waiting_env[ep.key]
        if self.journal is not None and ep.spans:
            self.journal(ep.key, snapshot(ep))
        with self._cv:
            self._ready.append(ep)
            self._cv.notify_all()

    def _end(self, ep: Episode, status: str) -> None:
        with self._cv:
            if ep.status is not None:
                return
            self._waiting_env.pop(ep.key, None)
            ep.status = status
            self._open -= 1
            self._cv.notify_all()
        close = getattr(ep.env, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # a failed close loses nothing the record needs
                pass

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cv:
            late = [ep for deadline, ep in self._waiting_env.values() if deadline < now]
        for ep in late:
            log.warning("episode %d: environment call took over %.3gs", ep.key, self.limits.step_timeout_s)
            self._end(ep, "env_timeout")


KEPT = ("done", "max_turns", "max_tokens")


def episode_summary(episodes: list[Episode]) -> tuple[dict[str, int], dict[str, float]]:
    """(dropped episodes by reason, counters of the batch: turns, statuses, tool calls, episodes
    resumed from an interrupted run and the turns they did not sample again)."""
    dropped: dict[str, int] = {}
    counts: dict[str, float] = {"episodes": len(episodes), "turns": 0}
    for ep in episodes:
        counts[f"status_{ep.status}"] = counts.get(f"status_{ep.status}", 0) + 1
        if ep.info.get("resume"):  # went on from an interrupted run's turn boundary, or could not
            counts[ep.info["resume"]] = counts.get(ep.info["resume"], 0) + 1
            counts["resumed_turns"] = counts.get("resumed_turns", 0) + ep.info.get("resumed_turns", 0)
        if ep.status not in KEPT:
            dropped[ep.status] = dropped.get(ep.status, 0) + 1
            continue
        counts["kept"] = counts.get("kept", 0) + 1
        counts["turns"] += len(ep.spans)
        for k, v in (ep.info.get("tool_calls") or {}).items():
            counts[f"tool_{k}"] = counts.get(f"tool_{k}", 0) + v
    return dropped, counts


def episode_meta(ep: Episode) -> dict[str, Any]:
    """What the record's ``meta`` keeps of an episode: its reward (the sum of its rewards), the
    per-turn rewards, spans and texts, and how it ended."""
    return {
        **ep.row.get("meta", {}),
        "episode": {
            "reward": float(sum(ep.rewards)),
            "rewards": list(ep.rewards),
            "turns": len(ep.spans),
            "resumed_turns": int(ep.info.get("resumed_turns", 0)),
            "spans": [list(s) for s in ep.spans],
            "status": ep.status,
            "tool_calls": dict(ep.info.get("tool_calls") or {}),
        },
    }


def play_episodes(
    loop: Any,
    chat: ChatTokens,
    rows: list[dict[str, Any]],
    group_ids: list[int],
    n: int,
    make_env: Callable[[], Any],
    limits: EpisodeLimits,
    sampling: Callable[..., Any],
    *,
    pool: concurrent.futures.ThreadPoolExecutor | None = None,
    journal: Callable[[int, dict], None] | None = None,
    resume: dict[int, dict] | None = None,
) -> Rollout:
    """The multi-turn strategy over an engine loop: ``n`` episodes per row (``EpisodeRunner``,
    environment steps on ``pool``, or on a pool of 16 threads of its own), one ``Sampled`` row per
    finished episode (its reward in ``meta["episode"]``); episodes that did not finish dropped and
    counted. ValueError when none finished."""
    own_pool = pool is None
    pool = pool or concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="rayrlhf-env")
    try:
        episodes = EpisodeRunner(chat, make_env, limits, sampling, pool, journal=journal, resume=resume).run(
            loop, rows, group_ids, n
        )
    finally:
        if own_pool:
            pool.shutdown(wait=False, cancel_futures=True)
    dropped, counts = episode_summary(episodes)
    kept = [ep for ep in episodes if ep.status not in dropped]
    if not kept:
        errors = sorted({ep.info.get("error", ep.status) for ep in episodes})[:3]
        raise ValueError(f"no episode of a batch of {len(episodes)} finished: {dropped}; e.g. {errors}")
    out = [
        Sampled(
            ep.prompt_ids,
            ep.ids,
            ep.logprobs,
            ep.truncated,
            chat.tok.decode(ep.ids),
            episode_meta(ep),
            ep.group,
            ep.versions,
            ep.action,
            row_routes(ep.turn_routes, len(ep.prompt_ids), ep.action),
        )
        for ep in kept
    ]
    share_group_prompt_routes(out)
    return Rollout(out, dropped, counts)
