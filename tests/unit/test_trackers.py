"""Trackers beside metrics.jsonl: W&B (offline) and an MLflow file store receive every number of
every row at its step, the config and each checkpoint's path, read back with the trackers' own
formats; a resumed run logs into the same tracker runs; a tracker that cannot start is one line."""

import json

import pytest

from cluster.ops.metrics import RunLog
from cluster.ops.trackers import start_trackers
from tests.helpers.trackers import mlflow_run, wandb_offline_run

ROWS = [
    {"step": s, "reward/mean": 0.1 * s, "loss/total": 1.0 / s, "skipped": {"reward_error": s}, "note": "x"}
    for s in (1, 2, 3)
]


def _log(run_dir, rows, config, checkpoint_at=None):
    log = RunLog(run_dir, 3, stream=open("/dev/null", "w"))
    log.sinks += start_trackers(["wandb", "mlflow"], run_dir, config)
    assert len(log.sinks) == 2
    for row in rows:
        log.log(row)
        if row["step"] == checkpoint_at:
            log.checkpoint(run_dir / f"checkpoints/step_{row['step']:06d}", row["step"])
    log.close()


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_wandb_and_mlflow_receive_every_row_the_config_and_checkpoints(tmp_path, offline):
    config = {"run": {"name": "t", "steps": 3}, "train": {"lr": 0.001}}
    _log(tmp_path, ROWS[:2], config, checkpoint_at=2)
    # The resumed run (from a checkpoint of step 1) runs step 2 again, then 3: the same tracker
    # runs continue, and step 2 is not sent twice.
    _log(tmp_path, ROWS[1:], config)
    wb = wandb_offline_run(tmp_path)
    ml = mlflow_run(tmp_path)
    for row in ROWS:
        s = row["step"]
        assert wb["history"][s]["reward/mean"] == pytest.approx(row["reward/mean"])
        assert wb["history"][s]["skipped/reward_error"] == s
        assert ml["metrics"]["reward/mean"][s] == pytest.approx(row["reward/mean"])
        assert ml["metrics"]["loss/total"][s] == pytest.approx(row["loss/total"])
        assert ml["metrics"]["skipped/reward_error"][s] == s
    assert wb["config"]["train"] == {"lr": 0.001}
    assert ml["params"]["train.lr"] == "0.001" and ml["params"]["run.name"] == "t"
    assert wb["summary"]["checkpoint"].endswith("step_000002") and wb["summary"]["checkpoint_step"] == 2
    assert ml["tags"]["checkpoint"].endswith("step_000002")
    ids = json.loads((tmp_path / "trackers.json").read_text())
    assert {"wandb", "mlflow"} <= set(ids) and len(list((tmp_path / "mlruns").glob("*/*/meta.yaml"))) == 1
    # Both starts wrote into the one W&B run, and each step reached it once.
    assert len(wb["run_ids"]) == 2 and set(wb["run_ids"]) == {ids["wandb"]}, wb["run_ids"]
    assert wb["history_records"] == {1: 1, 2: 1, 3: 1}, wb["history_records"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "reward/mean")] == [1, 2, 3]


def test_a_tracker_that_cannot_start_is_one_line_and_the_others_go_on(tmp_path, offline, capsys):
    sinks = start_trackers(["mlflow", "tensorboard"], tmp_path, {}, mlflow_uri="nosuchscheme://x")
    assert [type(s).__name__ for s in sinks] == ["TensorBoardSink"]
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("[rayrlhf] tracker mlflow did not start")
    for s in sinks:
        s.close()


def test_runs_saved_with_the_old_tensorboard_switch_still_load():
    from cluster.config.loading import load_config

    assert load_config(base={"run": {"tensorboard": False}}).run.trackers == []
    assert load_config(base={"run": {"tensorboard": True}}).run.trackers == ["tensorboard"]
