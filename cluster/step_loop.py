"""The loop every recipe runs. A recipe supplies its step; this owns what every recipe shares:

    evaluate the starting policy (step 0, a fresh run only)
    for each step still to run:
        outcome <- the recipe's step (its update, its own metrics)
        finish the checkpoint the learners wrote this step (the run's state beside it)
        evaluate on the held-out split when due
        log the metrics row (console, metrics.jsonl, TensorBoard, Ray metrics)
        stop early when the held-out metric stopped improving (saving, or keeping the best)

A step that trained on nothing (an asynchronous batch too stale for the loss) is logged and
not evaluated. The checkpoint records ``recipe.position()``: where the recipe's data stream
stands after the step, so a resumed run continues with the next unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.run_context import RunContext, RunResult


@dataclass
class StepOutcome:
    # The step's own metrics (losses, rewards, data ids).
    row: dict[str, Any] = field(default_factory=dict)
    # A checkpoint folder the learners wrote in this step (None: none was due).
    saved: str | None = None
    # The policy version after the step.
    version: int = 0
    # Packed weights the learners sent with the step, for an evaluation that syncs them first.
    weights: Any = None
    # False: the step's batch never reached a loss; it is logged, not evaluated.
    trained: bool = True


class Recipe(Protocol):
    def evaluate(self, step: int, weights: Any) -> dict[str, float]:
        """Held-out metrics of the current policy (``weights``: packed weights to sync first)."""

    def step(self, step: int) -> StepOutcome:
        """One training step."""

    def position(self) -> Any:
        """The data stream's position after the last step (has ``state_dict()``)."""

    def save(self, step: int, folder: str) -> dict:
        """Writes a checkpoint of the current state (no update): ``{"saved", "version"}``."""


def run_steps(ctx: RunContext, recipe: Recipe) -> RunResult:
    try:
        return _steps(ctx, recipe)
    finally:  # a streamed data source closes its reader while the cluster is still up
        getattr(recipe, "close", lambda: None)()


def _steps(ctx: RunContext, recipe: Recipe) -> RunResult:
    if ctx.eval_due(0):
        with ctx.phase("eval"):
            ctx.log_base_eval(recipe.evaluate(0, None))
    for step in ctx.steps():
        outcome = recipe.step(step)
        row = {"step": step, **outcome.row}
        if outcome.saved:
            ctx.finish_checkpoint(outcome.saved, step, recipe.position(), outcome.version)
            row["checkpoint"] = outcome.saved
        if outcome.trained and ctx.eval_due(step):
            with ctx.phase("eval"):
                row.update(recipe.evaluate(step, outcome.weights))
        ctx.log_step(step, row)
        if ctx.early_stop(row, lambda: recipe.save(step, ctx.checkpoint_path(step)), recipe.position()):
            break
    return ctx.result()
