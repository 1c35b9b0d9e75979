"""Scorers: fill an Experience's ``scores`` from its (prompt, completion) texts.

Every kind shares ``TextScorer.score``: a sample whose reward could not be made (a function that
raised or returned NaN, a judge reply that did not parse, a reward model fed an over-long
sequence, a remote endpoint that answered ``null`` for it) is dropped from the batch and counted
under its reason (``on_error='skip'``) or fails the step with the sample named
(``on_error='raise'``); a NaN never reaches a loss. The kinds:

    Scorer              a rule / verifier function (this module)
    RewardModelScorer   a trained reward model (``actors/rewards/reward_model.py``)
    JudgeScorer         an LLM judge on its own vLLM engine (``actors/rewards/judge.py``)
    RemoteScorer        an HTTP scoring endpoint (``actors/rewards/remote.py``)

Which one a run builds is ``actors/rewards/scorer_factory.py``'s business (it imports them all; none of
them imports it).
"""

from __future__ import annotations

import abc
import importlib
import logging
import math
from typing import Any, Callable

import torch

from actors.rewards.functions import BUILTIN_REWARDS
from learners.experience import Experience

log = logging.getLogger("rayrlhf.scorer")

RewardFn = Callable[..., list[float]]


#: ``reward.function`` values that name a scorer kind rather than a rule function.
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


def prompt_text(meta: dict[str, Any]) -> str:
    """The user prompt of a sample, as its data row gave it."""
    if not isinstance(meta, dict):
        return ""
    return str(meta.get("prompt") or meta.get("question") or "")


class TextScorer(abc.ABC):
    """A scorer of texts; ``score`` applies it to a record (see module doc)."""

    on_error: str = "skip"
    #: What the last ``score_texts`` call counted besides dropped samples (e.g. judge parse
    #: counts, remote retries), as metric names; the scorer actor reports them per step.
    last_metrics: dict[str, float]

    @abc.abstractmethod
    def score_texts(
        self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]
    ) -> tuple[list[float | None], dict[str, int]]:
        """Rewards per sample, None where none could be made, and the dropped counts by reason."""

    def _drop_or_raise(self, values: list[float | None], reason: str, what: str) -> dict[str, int]:
        """Samples without a finite reward: counted under ``reason`` and set to None, or raised."""
        n = 0
        for i, v in enumerate(values):
            if v is None or not math.isfinite(v):
                if self.on_error == "raise":
                    raise RewardError(f"{what}: no reward for sample {i} ({v})")
                values[i] = None
                n += 1
        if n:
            log.warning("%s: %d of %d samples without a reward, skipped (%s)", what, n, len(values), reason)
        return {reason: n} if n else {}

    def score(self, exp: Experience) -> Experience:
        """Fills ``exp.scores``; rows whose reward failed are removed and counted."""
        self.last_metrics = {}
        prompts = [prompt_text(m) for m in exp.meta]
        values, counts = self.score_texts(prompts, exp.completions, exp.meta)
        keep = [i for i, v in enumerate(values) if v is not None]
        skipped = dict(exp.skipped)
        for k, n in counts.items():
            skipped[k] = skipped.get(k, 0) + n
        scores = torch.tensor([values[i] for i in keep], dtype=torch.float32)
        out = exp if len(keep) == exp.batch_size else exp.select(keep)
        return out.replace(scores=scores, skipped=skipped).validate()


class Scorer(TextScorer):
    """A rule or verifier: ``reward.function`` applied to the texts and the row's metadata."""

    def __init__(self, function: str = "reasoning_gym", kwargs: dict | None = None, on_error: str = "skip") -> None:
        if on_error not in ("skip", "raise"):
            raise ValueError("on_error must be 'skip' or 'raise'")
        self.spec = function
        self.fn = resolve_reward_fn(function)
        self.kwargs = dict(kwargs or {})
        self.on_error = on_error
        self.last_metrics = {}

    def _call(self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]) -> list[float]:
        keys = sorted({k for m in meta for k in m})
        columns = {k: [m.get(k) for m in meta] for k in keys}
        out = self.fn(prompts, completions, **columns, **self.kwargs)
        out = list(out)
        if len(out) != len(completions):
            raise RewardError(
                f"reward function {self.spec!r} returned {len(out)} values for {len(completions)} samples"
            )
        return [float(x) for x in out]

    def score_texts(
        self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]
    ) -> tuple[list[float | None], dict[str, int]]:
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
