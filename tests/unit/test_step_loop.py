"""The loop every recipe runs (cluster/step_loop.py), driven by a stand-in recipe: the evaluation
schedule, checkpoints finished with the recipe's position, stale steps not evaluated, early
stopping (saving, or keeping the best checkpoint), and a resumed run continuing at the right step
and position. No Ray."""

import json
from pathlib import Path

from cluster.config.loading import load_config
from cluster.driver import stage_done
from cluster.run_context import RUN_STATE_FILE, RunContext, latest_checkpoint
from cluster.data.prompts import PromptSampler
from cluster.step_loop import StepOutcome, run_steps


class StandIn:
    """A recipe whose 'learners' write a checkpoint folder when one is due and whose held-out
    metric follows a script; it records every call in order."""

    def __init__(self, ctx: RunContext, metric: list[float] | None = None, stale: set[int] = frozenset()) -> None:
        self.ctx, self.metric, self.stale = ctx, metric or [], stale
        self.sampler = PromptSampler(10, 3, ctx.cfg.run.seed, **ctx.run_state["sampler"])
        self.version = int(ctx.run_state["version"])
        self.events: list[tuple] = []

    def position(self) -> PromptSampler:
        return self.sampler

    def save(self, step: int, folder: str) -> dict:
        self.events.append(("save", step))
        Path(folder, "trainer_state").mkdir(parents=True, exist_ok=True)
        return {"saved": folder, "version": self.version}

    def evaluate(self, step: int, weights) -> dict:
        self.events.append(("eval", step, weights))
        return {"eval/accuracy": self.metric[step] if step < len(self.metric) else 0.5}

    def step(self, step: int) -> StepOutcome:
        ids = self.sampler.next()
        self.events.append(("step", step))
        if step in self.stale:
            return StepOutcome({"skipped": {"stale": 3}}, version=self.version, trained=False)
        self.version += 1
        folder = self.ctx.checkpoint_dir(step)
        if folder:
            self.save(step, folder)
        return StepOutcome({"data/ids": ids}, saved=folder, version=self.version, weights=f"w{step}")


def _ctx(tmp_path, *overrides, resume=False):
    cfg = load_config(overrides=["run.plot=false", "run.trackers=[]", "cluster.metrics_export=false", *overrides])
    return RunContext(cfg, tmp_path / "run", resume=resume)


def _state(folder) -> dict:
    return json.loads((Path(folder) / "trainer_state" / RUN_STATE_FILE).read_text())


def test_evaluations_follow_the_schedule_and_checkpoints_carry_the_recipes_position(tmp_path):
    ctx = _ctx(tmp_path, "run.steps=5", "run.eval_every=2", "run.save_every=2", "run.keep_last=0")
    recipe = StandIn(ctx)
    result = run_steps(ctx, recipe)
    # Step 0 evaluates the starting policy; then every 2 steps and after the last, each right after its step.
    assert recipe.events == [
        ("eval", 0, None),
        ("step", 1),
        ("step", 2),
        ("save", 2),
        ("eval", 2, "w2"),
        ("step", 3),
        ("step", 4),
        ("save", 4),
        ("eval", 4, "w4"),
        ("step", 5),
        ("save", 5),
        ("eval", 5, "w5"),
    ]
    assert [r["step"] for r in result.history] == [0, 1, 2, 3, 4, 5]
    assert [("eval/accuracy" in r) for r in result.history] == [True, False, True, False, True, True]
    # Each checkpoint records the stream's position after its step (3 prompts per step) and its version.
    for step in (2, 4, 5):
        state = _state(ctx.checkpoint_path(step))
        assert state["step"] == step and state["sampler"] == {"consumed": 3 * step} and state["version"] == step
    assert result.final_checkpoint == Path(ctx.checkpoint_path(5))


def test_a_step_that_trained_nothing_is_logged_not_evaluated(tmp_path):
    ctx = _ctx(tmp_path, "run.steps=3", "run.eval_every=1", "run.eval_before_train=false")
    recipe = StandIn(ctx, stale={2})
    result = run_steps(ctx, recipe)
    assert [e for e in recipe.events if e[0] == "eval"] == [("eval", 1, "w1"), ("eval", 3, "w3")]
    assert result.history[1]["skipped"] == {"stale": 3} and "eval/accuracy" not in result.history[1]


def test_a_resumed_loop_continues_after_the_checkpoint_at_its_position(tmp_path):
    ctx = _ctx(tmp_path, "run.steps=4", "run.save_every=2", "run.eval_every=0", "run.keep_last=0")
    first = StandIn(ctx)
    run_steps(ctx, first)
    straight = [e for e in first.events if e[0] == "step"]
    # Interrupted after step 3: the newest complete checkpoint is step 2's (step 4's removed).
    import shutil

    shutil.rmtree(ctx.checkpoint_path(4))
    resumed_ctx = _ctx(tmp_path, "run.steps=4", "run.save_every=2", "run.eval_every=0", "run.keep_last=0", resume=True)
    resumed = StandIn(resumed_ctx)
    result = run_steps(resumed_ctx, resumed)
    assert [e for e in resumed.events if e[0] == "step"] == straight[2:] == [("step", 3), ("step", 4)]
    assert resumed.sampler.consumed == first.sampler.consumed == 12  # the same prompts, none repeated
    assert [r["step"] for r in result.history] == [1, 2, 3, 4]
    assert [r["data/ids"] for r in result.history] == [r["data/ids"] for r in first.ctx.runlog.rows]


def test_early_stop_saves_the_stopping_step_and_a_resume_runs_nothing_more(tmp_path):
    overrides = ["run.steps=10", "run.eval_every=1", "run.early_stop_metric=eval/accuracy", "run.early_stop_patience=2"]
    ctx = _ctx(tmp_path, *overrides)
    recipe = StandIn(ctx, metric=[0.1, 0.2, 0.5, 0.4, 0.3, 0.9])
    result = run_steps(ctx, recipe)
    assert [r["step"] for r in result.history] == [0, 1, 2, 3, 4]  # no improvement at 3 and 4: stop
    assert ("save", 4) in recipe.events and result.final_checkpoint == Path(ctx.checkpoint_path(4))
    assert _state(ctx.checkpoint_path(4))["early_stop"]["stopped"] is True
    assert stage_done(ctx.dir, ctx.cfg) == Path(ctx.checkpoint_path(4))
    again = StandIn(_ctx(tmp_path, *overrides, resume=True))
    run_steps(again.ctx, again)
    assert not [e for e in again.events if e[0] == "step"]


def test_early_stop_can_keep_the_best_checkpoint(tmp_path):
    ctx = _ctx(
        tmp_path,
        "run.steps=10",
        "run.eval_every=1",
        "run.early_stop_metric=eval/accuracy",
        "run.early_stop_patience=2",
        "run.early_stop_keep_best=true",
        "run.save_every=3",
        "run.keep_last=1",
    )
    recipe = StandIn(ctx, metric=[0.1, 0.2, 0.5, 0.4, 0.3])
    result = run_steps(ctx, recipe)
    best = Path(ctx.checkpoint_path(2))
    assert [r["step"] for r in result.history] == [0, 1, 2, 3, 4]
    # Each improvement was saved; the periodic checkpoint of step 3 came after the best and is gone.
    assert ("save", 1) in recipe.events and ("save", 2) in recipe.events
    assert sorted(p.name for p in (ctx.dir / "checkpoints").iterdir()) == ["step_00002"]
    assert result.final_checkpoint == best == latest_checkpoint(ctx.dir)
    state = _state(best)
    assert state["step"] == 2 and state["version"] == 2 and state["early_stop"]["stopped"] is True
    assert stage_done(ctx.dir, ctx.cfg) == best
