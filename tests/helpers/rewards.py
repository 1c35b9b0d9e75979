"""Misbehaving reward functions for the bad-input tests (imported by Ray workers by name)."""

from __future__ import annotations

from actors.rewards import digit_density


def flaky(prompts, completions, **meta):
    """Raises for completions whose index in the batch is 0 mod 5, returns NaN for 1 mod 5,
    inf for 2 mod 5 (only when called on a batch; per-sample calls pass the same test on text)."""
    base = digit_density(prompts, completions)
    out = []
    for c, v in zip(completions, base):
        h = sum(map(ord, c)) % 5
        if h == 0:
            raise RuntimeError("judge exploded")
        out.append(float("nan") if h == 1 else float("inf") if h == 2 else v)
    return out


def wrong_length(prompts, completions, **meta):
    return [0.0]
