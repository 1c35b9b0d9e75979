"""The prompts a run draws and how it measures itself on the held-out ones: the epoch-wise
prompt sampler whose whole state is a count (a resumed run continues exactly), each step's
sampling seed, and the held-out evaluation (greedy accuracy; with ``run.eval_sampled``, seeded
samples too)."""

from __future__ import annotations

import random
from typing import Any

from cluster.config import Config


class PromptSampler:
    """Epoch-wise shuffled prompt indices. The order is a pure function of (seed, epoch), so the
    sampler's whole state is the number of prompts consumed: a resumed run continues exactly
    where the interrupted one stopped, none repeated or skipped."""

    def __init__(self, num_rows: int, per_step: int, seed: int, consumed: int = 0) -> None:
        if num_rows < 1:
            raise ValueError("no prompts to sample from")
        self.num_rows, self.per_step, self.seed, self.consumed = num_rows, per_step, seed, consumed
        self._perm: tuple[int, list[int]] | None = None

    def _epoch(self, epoch: int) -> list[int]:
        if self._perm is None or self._perm[0] != epoch:
            order = list(range(self.num_rows))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._perm = (epoch, order)
        return self._perm[1]

    def next_with_uids(self) -> tuple[list[int], list[int]]:
        """The next step's rows and their uids: positions in the run's prompt stream, unique per
        draw (a prompt drawn again in a later epoch gets a new one) and the same on resume."""
        first = self.consumed
        rows = self.next()
        return rows, list(range(first, first + len(rows)))

    def next(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.per_step:
            epoch, pos = divmod(self.consumed, self.num_rows)
            take = min(self.per_step - len(out), self.num_rows - pos)
            out += self._epoch(epoch)[pos : pos + take]
            self.consumed += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}


def sampling_seed(run_seed: int, step: int) -> int:
    """Seed of a step's sampling: a function of the step, so a resumed run samples as the
    uninterrupted one would."""
    return run_seed * 100_003 + step


def held_out_eval(rollout: Any, rows: list[dict], sampled_seed: int | None = None) -> dict[str, float]:
    """The policy on held-out prompts: greedy accuracy (score >= 1 counts as solved); with
    ``sampled_seed``, also the mean reward and accuracy of the rollout's samples
    (``rollout.samples_per_prompt`` per prompt at its temperature, seeded: every evaluation draws
    the same random numbers, so two evaluations differ by the policy, not by the draw). Both
    generations are queued at once, so a generator done with its greedy units starts sampling."""
    if not rows:
        return {}
    ids = list(range(len(rows)))
    greedy = rollout.submit(rows, ids, greedy=True)
    sampled = rollout.submit(rows, ids, seed=sampled_seed) if sampled_seed is not None else None
    scores = _scores(rollout, rollout.collect(greedy)[0])
    row = {
        "eval/accuracy": _solved(scores),
        "eval/mean_score": sum(scores) / max(len(scores), 1),
        "eval/n": float(len(scores)),
    }
    if sampled is not None:
        samples = _scores(rollout, rollout.collect(sampled)[0])
        row.update(
            {
                "eval/sampled_reward": sum(samples) / max(len(samples), 1),
                "eval/sampled_accuracy": _solved(samples),
                "eval/sampled_n": float(len(samples)),
            }
        )
    return row


def eval_seed(cfg: Config) -> int | None:
    """The seed of ``held_out_eval``'s sampled evaluation (``run.eval_sampled``): step 0's, which
    no training step samples with."""
    return sampling_seed(cfg.run.seed, 0) if cfg.run.eval_sampled else None


def _scores(rollout: Any, exp_refs: list) -> list[float]:
    _, score_stats = rollout.score_checked(exp_refs)
    return [x for s in score_stats for x in s["scores"]]


def _solved(scores: list[float]) -> float:
    return sum(1.0 for x in scores if x >= 1.0) / max(len(scores), 1)
