"""Scorer: applies a reward function to an Experience and fills ``scores``.

Reward functions are user code: they may raise, return the wrong length, or NaN. Those samples
are either dropped from the batch and counted (``on_error='skip'``) or fail the step with the
sample named (``on_error='raise'``); a NaN never reaches a loss.
"""

from __future__ import annotations

import importlib
import logging
import math
from typing import Any, Callable

import torch

from actors.rewards import BUILTIN_REWARDS
from learners.experience import Experience

log = logging.getLogger("rayrlhf.scorer")

RewardFn = Callable[..., list[float]]


class RewardError(RuntimeError):
    """The reward function failed and the config says to stop."""


def resolve_reward_fn(spec: str) -> RewardFn:
    """'reasoning_gym' / another built-in, or 'package.module:function'."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"reward function {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor 'module:function'"
        )
    module_name, fn_name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name} has no callable {fn_name!r}")
    return fn


class Scorer:
    def __init__(self, function: str = "reasoning_gym", kwargs: dict | None = None, on_error: str = "skip") -> None:
        if on_error not in ("skip", "raise"):
            raise ValueError("on_error must be 'skip' or 'raise'")
        self.spec = function
        self.fn = resolve_reward_fn(function)
        self.kwargs = dict(kwargs or {})
        self.on_error = on_error

    def _call(self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]) -> list[float]:
        keys = sorted({k for m in meta for k in m})
        columns = {k: [m.get(k) for m in meta] for k in keys}
        out = self.fn(prompts, completions, **columns, **self.kwargs)
        out = list(out)
        if len(out) != len(completions):
            raise RewardError(f"reward function {self.spec!r} returned {len(out)} values for {len(completions)} samples")
        return [float(x) for x in out]

    def score_texts(self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]) -> tuple[list[float | None], dict[str, int]]:
        """Rewards per sample; None where the function failed (raised, NaN/inf) and was skipped."""
        counts = {"reward_error": 0, "reward_nonfinite": 0}
        try:
            values: list[float | None] = list(self._call(prompts, completions, meta))
        except Exception as batch_err:  # isolate the failing samples instead of losing the batch
            if self.on_error == "raise":
                raise RewardError(f"reward function {self.spec!r} raised: {batch_err!r}") from batch_err
            values = []
            for i in range(len(completions)):
                try:
                    values.append(self._call(prompts[i : i + 1], completions[i : i + 1], meta[i : i + 1])[0])
                except Exception as e:
                    counts["reward_error"] += 1
                    log.warning("reward function %r raised on sample %d, skipped: %r", self.spec, i, e)
                    values.append(None)
        for i, v in enumerate(values):
            if v is not None and not math.isfinite(v):
                if self.on_error == "raise":
                    raise RewardError(f"reward function {self.spec!r} returned {v} for sample {i}")
                counts["reward_nonfinite"] += 1
                log.warning("reward function %r returned %s for sample %d, skipped", self.spec, v, i)
                values[i] = None
        return values, counts

    def score(self, exp: Experience) -> Experience:
        """Fills ``exp.scores``; rows whose reward failed are removed and counted."""
        prompts = [m.get("question", "") if isinstance(m, dict) else "" for m in exp.meta]
        values, counts = self.score_texts(prompts, exp.completions, exp.meta)
        keep = [i for i, v in enumerate(values) if v is not None]
        skipped = dict(exp.skipped)
        for k, n in counts.items():
            skipped[k] = skipped.get(k, 0) + n
        scores = torch.tensor([values[i] for i in keep], dtype=torch.float32)
        out = exp if len(keep) == exp.batch_size else exp.select(keep)
        return out.replace(scores=scores, skipped=skipped).validate()
