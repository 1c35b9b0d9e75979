"""Early stopping on a held-out metric (RunContext.early_stop): patience, direction, the
checkpoint it leaves and how a staged run reads it (no Ray)."""

import json

import pytest

from cluster.config.loading import load_config
from cluster.driver import stage_done
from cluster.run_context import RunContext
from cluster.data.prompts import PromptSampler


def _ctx(tmp_path, *overrides):
    cfg = load_config(overrides=["run.steps=20", "run.plot=false", *overrides])
    return RunContext(cfg, tmp_path / "run")


def test_stops_after_patience_evaluations_without_improvement_and_saves(tmp_path):
    ctx = _ctx(tmp_path, "run.early_stop_metric=eval/loss/total", "run.early_stop_patience=2")
    saves = []

    def save():
        folder = ctx.checkpoint_path(5)
        saves.append(folder)
        return {"saved": folder, "version": 5}

    sampler = PromptSampler(10, 2, 0)
    rows = [
        {"step": 1, "eval/loss/total": 1.0},
        {"step": 2},
        {"step": 3, "eval/loss/total": 0.9},
        {"step": 4, "eval/loss/total": 0.95},
    ]
    assert [ctx.early_stop(r, save, sampler) for r in rows] == [False] * 4 and not saves
    assert ctx.early == {"best": 0.9, "best_step": 3, "bad": 1, "stopped": False}
    assert ctx.early_stop({"step": 5, "eval/loss/total": 0.97}, save, sampler) is True
    assert saves == [ctx.checkpoint_path(5)]
    state = json.loads(
        (tmp_path / "run" / "checkpoints" / "step_00005" / "trainer_state" / "run_state.json").read_text()
    )
    assert state["step"] == 5 and state["version"] == 5 and state["early_stop"]["stopped"] is True
    # A staged run treats the stopped stage as finished (5 of 20 steps).
    assert stage_done(tmp_path / "run", ctx.cfg) == tmp_path / "run" / "checkpoints" / "step_00005"


@pytest.mark.parametrize(
    "metric, mode, values, stops_at",
    [
        ("eval/accuracy", "auto", [0.2, 0.3, 0.3, 0.25], 3),  # higher is better; a tie is no improvement
        ("eval/nll", "auto", [2.0, 1.0, 1.5, 0.5], None),
        ("eval/accuracy", "min", [0.2, 0.3, 0.4], 2),
    ],
)
def test_direction(tmp_path, metric, mode, values, stops_at):
    ctx = _ctx(tmp_path, f"run.early_stop_metric={metric}", "run.early_stop_patience=2", f"run.early_stop_mode={mode}")
    save = lambda: {"saved": str(tmp_path / "ck"), "version": 0}  # noqa: E731
    stopped = [i for i, v in enumerate(values) if ctx.early_stop({"step": i, metric: v}, save, PromptSampler(4, 1, 0))]
    assert stopped[:1] == ([stops_at] if stops_at is not None else [])


def test_off_without_a_metric(tmp_path):
    ctx = _ctx(tmp_path)
    assert not any(ctx.early_stop({"step": i, "eval/loss/total": 1.0}, None, None) for i in range(10))
