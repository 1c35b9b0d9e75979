"""What a run learned, in one line with its uncertainty: the run's last console line.

Read from the metrics rows the run logged. The held-out accuracy (greedy, and sampled with
``run.eval_sampled``) of the first evaluation is compared with the last one's; its standard
error is the binomial one of each evaluation, ``sqrt(p (1 - p) / n)``, combined as for two
independent samples, ``sqrt(se_0^2 + se_1^2)`` (the prompts are the same at every evaluation, so
this over-states it: a conservative band). The train reward of the run's first and last third of
steps is shown beside it: the reward the policy earned on the prompts it trained on.
"""

from __future__ import annotations

import math
from typing import Any


def _se(p: float, n: float) -> float:
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else float("nan")


def change_with_error(first: float, n_first: float, last: float, n_last: float) -> tuple[float, float]:
    """``last - first`` of two accuracies and the standard error of that difference."""
    return last - first, math.sqrt(_se(first, n_first) ** 2 + _se(last, n_last) ** 2)


def _eval_change(rows: list[dict], key: str, n_key: str, label: str) -> str | None:
    evals = [r for r in rows if r.get(key) is not None]
    if len(evals) < 2:
        return None
    a, b = evals[0], evals[-1]
    n0, n1 = float(a.get(n_key) or 0), float(b.get(n_key) or 0)
    delta, se = change_with_error(a[key], n0, b[key], n1)
    head = f"{label} {a[key]:.3f} (step {a.get('step', 0)}) -> {b[key]:.3f} (step {b.get('step', '?')}): {delta:+.3f}"
    if not n0 or not n1:
        return head
    unit = "samples" if "sampled" in key else "prompts"
    apart = f", {abs(delta) / se:.1f} s.e. apart" if se > 0 else ""
    return f"{head} ± {se:.3f} (1 s.e., {int(n1)} {unit}{apart})"


def _train_reward_thirds(rows: list[dict]) -> str | None:
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    if len(rewards) < 3:
        return None
    third = len(rewards) // 3
    first, last = rewards[:third], rewards[-third:]
    return (
        f"train reward {sum(first) / len(first):.3f} (first third of steps) -> {sum(last) / len(last):.3f} (last third)"
    )


def learned_line(rows: list[dict[str, Any]], eval_label: str = "greedy accuracy") -> str | None:
    """``[rayrlhf] learned: ...``, or None when the run logged nothing to compare."""
    parts = [
        _eval_change(rows, "eval/accuracy", "eval/n", f"held-out {eval_label}"),
        _eval_change(rows, "eval/sampled_accuracy", "eval/sampled_n", "held-out sampled accuracy"),
        _train_reward_thirds(rows),
    ]
    parts = [p for p in parts if p]
    return f"[rayrlhf] learned: {'; '.join(parts)}" if parts else None
