"""What an environment's step returns (``Step``), the interface an environment implements, and
``as_step``, which reads the shapes environments return as a ``Step``.

Below every environment (the built-ins in ``actors/agents/environments.py``, OpenEnv's in
``actors/agents/openenv.py``) and the episode runner (``actors/agents/episodes.py``): it imports none of them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class Step(NamedTuple):
    observation: Any  # str | {"role", "content"} | None when the episode ends with nothing to say
    reward: float = 0.0
    done: bool = False
    info: dict = {}


class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> Any: ...

    def step(self, action: str) -> Step: ...


def as_step(result: Any) -> Step:
    """A ``Step`` from what an environment returned: a Step, Gymnasium's 4- or 5-tuple
    (observation, reward, terminated, truncated, info) or a dict; anything else raises."""
    if isinstance(result, Step):
        return result
    if isinstance(result, dict):
        return Step(
            result.get("observation"),
            float(result.get("reward") or 0.0),
            bool(result.get("done")),
            dict(result.get("info") or {}),
        )
    if isinstance(result, tuple) and len(result) == 5:
        obs, reward, terminated, truncated, info = result
        return Step(obs, float(reward), bool(terminated or truncated), dict(info or {}))
    if isinstance(result, tuple) and len(result) == 4:
        obs, reward, done, info = result
        return Step(obs, float(reward), bool(done), dict(info or {}))
    raise TypeError(f"environment step returned {type(result).__name__}, expected Step / (obs, reward, done, info)")
