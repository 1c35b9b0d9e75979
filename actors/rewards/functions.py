"""Built-in reward functions: ``(prompts, completions, **meta) -> list[float]``.

``meta`` holds one list per key, aligned with ``completions`` (e.g. ``meta["answer"][i]``).
User functions with the same signature are named in the config as ``module:function``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:/\d+)?")


def extract_final_answer(text: str) -> str | None:
    """The reply's final answer: a \\boxed{...} value, else the text after 'answer is', else its
    last number. Small models write '5 + 8 = 13': the whole reply never equals '13'."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    m = re.search(r"answer is[:\s]*([^\n]+)", text, flags=re.IGNORECASE)
    if m:
        nums = _NUMBER.findall(m.group(1))
        if nums:
            return nums[0].replace(",", "")
    nums = _NUMBER.findall(text)
    if nums:
        return nums[-1].replace(",", "")
    stripped = text.strip()
    return stripped or None


@lru_cache(maxsize=32)
def _scorer_dataset(task: str, kwargs_items: tuple):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **dict(kwargs_items))


def _freeze(obj: Any) -> Any:
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, list):
        return tuple(_freeze(v) for v in obj)
    return obj


def reasoning_gym(prompts: list[str], completions: list[str], **meta: list) -> list[float]:
    """The task's own answer checker applied to the extracted final answer."""
    out = []
    for i, completion in enumerate(completions):
        entry = meta["entry"][i]
        ds = _scorer_dataset(meta["task"][i], _freeze(meta.get("task_kwargs", [{}] * len(completions))[i]))
        answer = extract_final_answer(completion)
        out.append(float(ds.score_answer(answer, entry)))
    return out


def exact_match(prompts: list[str], completions: list[str], **meta: list) -> list[float]:
    """1.0 when the extracted final answer equals ``meta['answer']``, else 0.0."""
    return [float(extract_final_answer(c) == str(a).strip()) for c, a in zip(completions, meta["answer"])]


def digit_density(prompts: list[str], completions: list[str], **meta: list) -> list[float]:
    """Fraction of non-space characters that are digits: a dense toy reward that a random-weight
    test model can learn in a few dozen PPO steps (used by the fast learning tests)."""
    out = []
    for c in completions:
        chars = [ch for ch in c if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out


def environment(prompts: list[str], completions: list[str], **meta: list) -> list[float]:
    """A multi-turn episode's reward as its environment gave it (the sum over its steps,
    ``meta["episode"]["reward"]``, written by the generator's rollout)."""
    episodes = meta.get("episode")
    if episodes is None:
        raise ValueError(
            "reward.function=environment scores multi-turn episodes; these samples carry none (set env.name)"
        )
    return [float(e["reward"]) for e in episodes]


BUILTIN_REWARDS = {
    "environment": environment,
    "reasoning_gym": reasoning_gym,
    "exact_match": exact_match,
    "digit_density": digit_density,
}
