"""The step of the recipes that train on a fixed, encoded data set (DPO's pairs, the reward
model's pairs, SFT's demonstrations): not a recipe itself.

    batch    <- the next units of the data set (a seeded, epoch-wise shuffle; exact on resume)
    learners <- one update on it (its units recorded in the ledger: issued, trained)
    evaluate <- the learners' held-out metrics and, with generators, greedy task accuracy after
                a weight sync
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from cluster.roles import Roles
from cluster.run_context import RunContext
from cluster.data.prompts import PromptSampler, eval_seed, held_out_eval
from cluster.step_loop import StepOutcome
from learners.experience import Experience


@dataclass
class FixedData:
    # The encoded training set.
    train: Experience
    # Units (pairs, demonstrations) in it.
    units: int
    # Units per step.
    per_step: int
    # A unit's rows in ``train`` (a pair is two).
    rows_of: Callable[[int], list[int]]
    # The data's ids in each metrics row (e.g. ``data/pair_ids``).
    ids_key: str
    # Held-out records for the learners' evaluation (an object ref), or None.
    held_ref: Any = None
    # Which of the learners' held-out metrics is ``eval/accuracy`` and which counts ``eval/n``.
    eval_keys: tuple[str, str] = ("", "")
    # Held-out task prompts for greedy accuracy on the generators.
    eval_prompts: list[dict] = field(default_factory=list)
    # Logged with every step (data counts, rows skipped while loading).
    row_extra: dict[str, Any] = field(default_factory=dict)
    # Sync the generators after the last step too (a staged run's next stage reads them).
    sync_last: bool = False


class FixedDataSteps:
    def __init__(self, ctx: RunContext, roles: Roles, data: FixedData) -> None:
        self.ctx, self.roles, self.data = ctx, roles, data
        self.learners, self.rollout = roles.learners, roles.rollout
        self.sampler = PromptSampler(
            data.units, min(data.per_step, data.units), ctx.cfg.run.seed, **ctx.run_state["sampler"]
        )

    def position(self) -> PromptSampler:
        return self.sampler

    def save(self, step: int, folder: str) -> dict:
        return self.learners.save(step, folder)

    def evaluate(self, step: int, weights: Any) -> dict[str, float]:
        data, row = self.data, {}
        if data.held_ref is not None:
            row.update(self.learners.evaluate(step, [data.held_ref]))
            accuracy, n = data.eval_keys
            row.update({"eval/accuracy": row.get(accuracy, float("nan")), "eval/n": row.get(n, 0.0)})
        if self.rollout is not None and data.eval_prompts:
            if weights is not None:
                self.rollout.sync_weights(weights)
            # eval/accuracy: the task's, greedy
            row.update(held_out_eval(self.rollout, data.eval_prompts, eval_seed(self.ctx.cfg)))
        return row

    def step(self, step: int) -> StepOutcome:
        data, ctx = self.data, self.ctx
        ids, uids = self.sampler.next_with_uids()
        self.roles.ledger.record("issued", [{"step": step, "uid": u, "prompt": i} for u, i in zip(uids, ids)])
        batch = ray.put(data.train.select([r for i in ids for r in data.rows_of(i)]))
        eval_now = ctx.eval_due(step)
        # Weights go to the generators when a greedy evaluation needs them (and at the end if asked).
        sync = self.rollout is not None and (eval_now or (data.sync_last and step == ctx.cfg.run.steps))
        with ctx.phase("learn"):
            result = self.learners.learn(step, [batch], save_dir=ctx.checkpoint_dir(step), sync=sync)
        self.roles.ledger.record(
            "trained", [{"step": step, "uid": u, "samples": 1, "version": result["version"]} for u in uids]
        )
        row = {
            data.ids_key: ids,
            **data.row_extra,
            **result["metrics"],
            **self.roles.ledger.metrics(),
            **self.roles.record_restarts(step),
        }
        weights = (result.get("weights") or [None])[0]
        if weights is not None:
            with ctx.phase("sync"):
                self.rollout.sync_weights(weights, version=result["version"])
            row["sync/generator_version"] = float(ray.get(self.rollout.generators[0].version.remote()))
        return StepOutcome(row, saved=result.get("saved"), version=result["version"])
