"""Reward functions for tests (imported by Ray workers by name): misbehaving ones for the
bad-input tests, and a dense one that ranks a random model's samples."""

from __future__ import annotations

from actors.rewards.functions import digit_density


def flaky(prompts, completions, **meta):
    """Raises for samples whose (question, reply) characters sum to 0 mod 5, returns NaN for 1 mod 5,
    inf for 2 mod 5; per-sample calls see the same sample and give the same outcome."""
    base = digit_density(prompts, completions)
    questions = meta.get("question") or [""] * len(completions)
    out = []
    for c, q, v in zip(completions, questions, base):
        # The question too, not only the text: a degenerate policy writes the same reply to every
        # prompt, which would put a whole batch in one class.
        h = (sum(map(ord, c)) + sum(map(ord, q or ""))) % 5
        if h == 0:
            raise RuntimeError("judge exploded")
        out.append(float("nan") if h == 1 else float("inf") if h == 2 else v)
    return out


def wrong_length(prompts, completions, **meta):
    return [0.0]


def reply_length(prompts, completions, **meta):
    """Characters of the reply / 100: dense, rarely tied, and learnable (prefer long tokens, no EOS),
    so a random-weight model's samples always give preference pairs."""
    return [len(c) / 100.0 for c in completions]


def informative_prompt(prompt: str) -> bool:
    """A third of the prompts, by their text (so which ones is known before any sampling)."""
    import zlib

    return zlib.crc32(prompt.encode()) % 3 == 0


def some_groups_informative(prompts, completions, **meta):
    """For an informative prompt (``informative_prompt``) a random reward, so that its group's
    scores differ whatever the replies (a collapsed policy may write identical ones); for the
    others 0.5: their groups score evenly."""
    import random

    return [random.random() if informative_prompt(p) else 0.5 for p in prompts]


def held_digit_density(prompts, completions, hold: str = "", after_steps: int = 0, run_dir: str = "", **meta):
    """digit_density, except that once the run in ``run_dir`` has logged ``after_steps`` steps
    (its metrics rows: in a synchronous run, written before the next step samples), each call
    touches ``<hold>.held`` and waits until ``<hold>.release`` exists. A test can then stop the
    run at a known point (step ``after_steps + 1`` being scored, its checkpoint not yet written)
    without racing the run's clock. Once released it never waits again."""
    import json
    from pathlib import Path

    from tests.helpers.timeouts import hold as hold_here

    metrics = Path(run_dir) / "metrics.jsonl"
    if hold and not Path(hold + ".release").exists() and metrics.is_file():
        # kills.steps_logged's reading, not imported: that module imports tests.conftest, whose
        # import sets up a test session, which a Ray worker must not do.
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
        if max(steps, default=0) >= after_steps:
            hold_here(hold, 300)
    return digit_density(prompts, completions)
