"""Environments an agent acts in over several turns: the interface and the built-in ones.

The interface is Gymnasium's, at the level of text (``Step`` and the protocol: ``actors/agents/env_step.py``)::

    env.reset(row)    -> the first observation (the user's message; ``row`` is a data row)
    env.step(action)  -> Step(observation, reward, done, info)

An observation is a user message's text, or a chat message ``{"role": ..., "content": ...}``
(a tool's answer). An action is the text the model replied with. Rewards may come at any step;
an episode's reward is their sum. ``tools``, where an environment has them, are rendered into
the prompt by the chat template. The rollout (``actors/agents/episodes.py``) turns the text into token
ids once and keeps the model's own tokens as sampled, so an environment never deals in tokens.

A single-turn task is the one-step case: reset returns the prompt, the first step scores the
reply and ends. Built-in (``make_environment``): ``guess_number``, ``feedback`` (try again after a
wrong answer), ``tool_use`` (calculator / Python before answering), ``http://...`` (an
OpenEnv server, one WebSocket session per episode, ``actors/agents/openenv.py``), or ``module:factory``
for your own (an OpenEnv ``Environment`` class runs in-process with the same text mapping).
"""

from __future__ import annotations

import importlib
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.agents.env_step import Step
from actors.agents.tools import ToolBox, ToolCallFormat, parse_tool_calls


# -- verifiers -----------------------------------------------------------------------------------
def verifier(reward_fn: Callable[..., list[float]], row: dict[str, Any]) -> Callable[[str], float]:
    """A reward function (``(prompts, completions, **meta)``) applied to one reply of ``row``."""
    meta = row.get("meta", {})

    def check(reply: str) -> float:
        return float(reward_fn([row["prompt"]], [reply], **{k: [v] for k, v in meta.items()})[0])

    return check


# -- built-in environments -----------------------------------------------------------------------
_INT = re.compile(r"-?\d+")


class GuessNumber:
    """Guess a number in [low, high] from 'higher' / 'lower' answers within ``max_guesses``: the
    smallest task where credit must flow across turns (a later guess is only right if it used the
    earlier answers). Reward 1 when found, 0 otherwise. Rows carry the target (``make_rows``)."""

    def __init__(self, low: int = 1, high: int = 16, max_guesses: int = 4) -> None:
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.target = self.guesses = 0

    @staticmethod
    def make_rows(size: int, seed: int, low: int = 1, high: int = 16, max_guesses: int = 4) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        rows = []
        for _ in range(size):
            target = rng.randint(low, high)
            prompt = (
                f"I am thinking of a whole number from {low} to {high}. Guess it: reply with one number. "
                f"I will say higher or lower. You have {max_guesses} guesses."
            )
            rows.append(
                {
                    "prompt": prompt,
                    "answer": str(target),
                    "meta": {"answer": str(target), "question": prompt, "prompt": prompt},
                }
            )
        return rows

    def reset(self, row: dict[str, Any]) -> str:
        self.target, self.guesses = int(row["answer"]), 0
        return row["prompt"]

    def step(self, action: str) -> Step:
        self.guesses += 1
        numbers = _INT.findall(action)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.target:
            return Step(None, 1.0, True, {"guesses": self.guesses})
        if self.guesses >= self.max_guesses:
            return Step(None, 0.0, True, {"guesses": self.guesses})
        hint = "Reply with one number." if guess is None else ("Higher." if guess < self.target else "Lower.")
        return Step(hint, 0.0, False, {})


class Feedback:
    """Answer a task; a wrong answer hears 'incorrect, try again' up to ``attempts`` times. The
    reward of a right answer at attempt k is ``discount ** (k - 1)``."""

    def __init__(
        self,
        check_row: Callable[[dict], Callable[[str], float]],
        attempts: int = 3,
        discount: float = 0.5,
        retry_message: str = "Incorrect, try again.",
    ) -> None:
        self.check_row, self.attempts, self.discount, self.retry = check_row, attempts, discount, retry_message
        self.check: Callable[[str], float] = lambda reply: 0.0
        self.tries = 0

    def reset(self, row: dict[str, Any]) -> str:
        self.check, self.tries = self.check_row(row), 0
        return row["prompt"]

    def step(self, action: str) -> Step:
        self.tries += 1
        if self.check(action) > 0:
            return Step(None, self.discount ** (self.tries - 1), True, {"attempts": self.tries})
        if self.tries >= self.attempts:
            return Step(None, 0.0, True, {"attempts": self.tries})
        return Step(self.retry, 0.0, False, {})


class ToolUse:
    """Answer a task, calling tools first if it helps: a reply with tool calls is answered with
    the tools' outputs (a ``tool`` message); the first reply without one is the final answer,
    scored by the verifier. More than ``max_tool_calls`` calls end the episode unanswered."""

    def __init__(
        self,
        check_row: Callable[[dict], Callable[[str], float]],
        tools: ToolBox,
        max_tool_calls: int = 4,
        fmt: ToolCallFormat = ToolCallFormat(),
    ) -> None:
        self.check_row, self.toolbox, self.max_tool_calls, self.fmt = check_row, tools, max_tool_calls, fmt
        self.tools = tools.schemas()
        self.check: Callable[[str], float] = lambda reply: 0.0
        self.calls = 0
        # Tool-call outcomes of this episode, by status (ok, timeout, malformed, ...).
        self.counts: dict[str, int] = {}

    def reset(self, row: dict[str, Any]) -> str:
        self.check, self.calls, self.counts = self.check_row(row), 0, {}
        return row["prompt"]

    def step(self, action: str) -> Step:
        calls = parse_tool_calls(action, self.fmt)
        if not calls:
            return Step(None, float(self.check(action)), True, {"tool_calls": dict(self.counts)})
        answers = []
        for call in calls:
            self.calls += 1
            if self.calls > self.max_tool_calls:
                self.counts["over_limit"] = self.counts.get("over_limit", 0) + 1
                return Step(None, 0.0, True, {"tool_calls": dict(self.counts), "stopped": "max_tool_calls"})
            result = self.toolbox.call(call)
            self.counts[result.status] = self.counts.get(result.status, 0) + 1
            answers.append(result.text)
        return Step(
            {"role": "tool", "content": self.fmt.wrap_response("\n".join(answers))},
            0.0,
            False,
            {"tool_calls": dict(self.counts)},
        )


# -- construction --------------------------------------------------------------------------------
@dataclass
class EnvSpec:
    """What a generator needs to build an episode's environment (picklable: built in the actor)."""

    # guess_number | feedback | tool_use | http(s)://... | module:factory
    name: str
    args: dict[str, Any] = field(default_factory=dict)
    # The reward function that checks a final answer (feedback, tool_use): ``reward.function``.
    verifier: str = "exact_match"
    verifier_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)
    max_tool_calls: int = 4
    tool_timeout_s: float = 10.0
    # The python tool's sandbox (bwrap | unsafe), its importable packages, and your own tools
    # to run in the sandbox (actors/agents/sandbox.py).
    python_sandbox: str = "bwrap"
    python_packages: list[str] = field(default_factory=list)
    sandbox_tools: list[str] = field(default_factory=list)
    # OpenEnv servers and classes: ``actors/agents/openenv.py:OpenEnvOptions`` fields, plus action_class
    # and api_key_env; and the seconds one message may take.
    openenv: dict[str, Any] = field(default_factory=dict)
    step_timeout_s: float = 30.0


@dataclass
class EpisodeLimits:
    max_turns: int = 4
    # Prompt plus every turn and observation: the engine's context per episode.
    max_tokens: int = 512
    # Tokens per turn.
    max_new_tokens: int = 64
    # Seconds an environment's reset or step may take before the episode ends as env_timeout.
    step_timeout_s: float = 30.0


def openenv_options(spec: EnvSpec) -> Any:
    """The OpenEnv mapping of ``spec`` (its API key read from the named variable here, in the
    process that talks to the server)."""
    import os

    from actors.agents.openenv import OpenEnvOptions

    opts = {k: v for k, v in spec.openenv.items() if k not in ("action_class", "api_key_env")}
    key_env = spec.openenv.get("api_key_env", "")
    return OpenEnvOptions(**opts, timeout_s=spec.step_timeout_s, api_key=os.environ.get(key_env, "") if key_env else "")


#: Built-in environment name -> a builder of its per-episode factory from the spec.
ENVIRONMENTS: dict[str, Callable[[EnvSpec], Callable[[], Any]]] = {}


def register_environment(name: str) -> Callable:
    """Decorator: ``builder(spec) -> factory`` of the built-in environment ``name`` (``env.name``)."""

    def add(builder: Callable[[EnvSpec], Callable[[], Any]]) -> Callable[[EnvSpec], Callable[[], Any]]:
        if name in ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is already registered")
        ENVIRONMENTS[name] = builder
        return builder

    return add


@register_environment("guess_number")
def _guess_number(spec: EnvSpec) -> Callable[[], Any]:
    return lambda: GuessNumber(**spec.args)


def _check_row(spec: EnvSpec) -> Callable[[dict], Callable[[str], float]]:
    """The spec's verifier bound to an episode's row (the answer checker of feedback and tool_use)."""
    from actors.rewards.scorer import resolve_reward_fn

    fn = resolve_reward_fn(spec.verifier)
    kwargs = dict(spec.verifier_kwargs)

    def check_row(row: dict) -> Callable[[str], float]:
        return verifier(lambda p, c, **m: fn(p, c, **m, **kwargs), row)

    return check_row


@register_environment("feedback")
def _feedback(spec: EnvSpec) -> Callable[[], Any]:
    check_row = _check_row(spec)
    return lambda: Feedback(check_row, **spec.args)


@register_environment("tool_use")
def _tool_use(spec: EnvSpec) -> Callable[[], Any]:
    from actors.agents.tools import resolve_tools

    check_row = _check_row(spec)
    tools = resolve_tools(
        spec.tools or ["calculator"], spec.python_sandbox, tuple(spec.python_packages), tuple(spec.sandbox_tools)
    )
    toolbox = ToolBox(tools, timeout_s=spec.tool_timeout_s)
    return lambda: ToolUse(check_row, toolbox, max_tool_calls=spec.max_tool_calls, **spec.args)


def environment_factory(spec: EnvSpec) -> Callable[[], Any]:
    """A function that makes one fresh environment per episode: a registered built-in, an OpenEnv
    server (an http(s):// URL) or your own ``module:factory``. Raises ValueError on a bad spec."""
    if spec.name in ENVIRONMENTS:
        return ENVIRONMENTS[spec.name](spec)
    if spec.name.startswith(("http://", "https://")):
        from actors.agents.openenv import OpenEnvServer

        if spec.args:
            raise ValueError("env.args are an environment constructor's arguments; an OpenEnv server takes env.openenv")
        return OpenEnvServer(spec.name, openenv_options(spec))
    if ":" in spec.name:
        return _own_factory(spec)
    raise ValueError(
        f"environment {spec.name!r} is neither a built-in ({', '.join(ENVIRONMENTS)}), "
        "an http(s):// URL nor 'module:factory'"
    )


def _own_factory(spec: EnvSpec) -> Callable[[], Any]:
    """``module:factory``: an OpenEnv ``Environment`` class runs in-process, anything else is
    called with ``env.args`` once per episode."""
    module, attr = spec.name.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"environment {spec.name!r}: {e}") from e
    from actors.agents.openenv import is_openenv_environment_class, local_factory

    if is_openenv_environment_class(factory):
        return local_factory(factory, dict(spec.args), openenv_options(spec), spec.openenv.get("action_class", ""))
    return lambda: factory(**spec.args)
