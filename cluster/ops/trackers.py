"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, Weights & Biases and MLflow
(``run.trackers``). Each is a sink of ``RunLog`` (``write(row)``, ``checkpoint(path, step)``,
``close()``): every number of every metrics row at its step, the run's config, and each
checkpoint's path as it is saved.

A tracker that fails to start (a package not installed, no W&B login, an unreachable MLflow
server) is one line on the console and the run goes on with the others; one that fails later is
turned off by ``RunLog``. Both work offline: ``WANDB_MODE=offline`` (W&B writes its run under
``<run dir>/wandb/``; ``wandb sync`` uploads it later) and an MLflow file store (the default,
``file:<run dir>/mlruns``; MLflow 3 asks for ``MLFLOW_ALLOW_FILE_STORE``, set here for file
URIs only). A resumed run continues the same tracker runs (their ids are kept in
``<run dir>/trackers.json``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from cluster.ops.telemetry import TensorBoardSink, flat_numbers

log = logging.getLogger("rayrlhf.trackers")

TRACKERS = ("tensorboard", "wandb", "mlflow")
IDS_FILE = "trackers.json"


def _flat_config(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if not isinstance(v, str) else v
    return out


class _Ids:
    """The tracker run ids of a run directory (so a resume logs into the same runs)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / IDS_FILE
        try:
            self.ids = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except ValueError:
            print(f"[rayrlhf] {self.path} is not valid JSON: the trackers start new runs", flush=True)
            self.ids = {}

    def get(self, name: str) -> Any:
        return self.ids.get(name)

    def set(self, name: str, value: Any) -> None:
        self.ids[name] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ids))
        tmp.replace(self.path)


class _Resumable:
    """Rows a tracker already holds are not sent again: a resumed run runs the steps after its
    checkpoint again, and the interrupted run logged them (an exact resume, the same numbers);
    W&B would refuse them (its steps only grow) and MLflow would hold them twice."""

    name = ""

    def fresh(self, row: dict[str, Any]) -> bool:
        step = int(row["step"])
        if step <= (self.ids.get(f"{self.name}_step") or -1):
            return False
        self.ids.set(f"{self.name}_step", step)
        return True


class WandbSink(_Resumable):
    """Weights & Biases: one W&B run per rayrlhf run, the config as its config, the
    checkpoint paths in its summary."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, ids: _Ids) -> None:
        import wandb

        self.name, self.ids = "wandb", ids
        run_id = ids.get("wandb") or uuid.uuid4().hex[:12]
        settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False)
        self.run = wandb.init(
            project=project,
            name=Path(run_dir).name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            settings=settings,
            reinit="create_new",
        )
        ids.set("wandb", run_id)

    def write(self, row: dict[str, Any]) -> None:
        if not self.fresh(row):
            return
        self.run.log({k: v for k, v in flat_numbers(row).items() if k != "step"}, step=int(row["step"]))

    def checkpoint(self, path: str, step: int) -> None:
        self.run.summary.update({"checkpoint": str(path), "checkpoint_step": step})

    def close(self) -> None:
        self.run.finish()


_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


class MlflowSink(_Resumable):
    """MLflow: one MLflow run per rayrlhf run in ``experiment``, the config as flattened params,
    the checkpoint paths as tags."""

    def __init__(self, run_dir: Path, config: dict[str, Any], tracking_uri: str, experiment: str, ids: _Ids) -> None:
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.name, self.ids = "mlflow", ids
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        run_id = ids.get("mlflow")
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
            run_id = self.client.create_run(exp_id, run_name=Path(run_dir).name).info.run_id
            params = [Param(_MLFLOW_KEY.sub("_", k), v[:6000]) for k, v in _flat_config(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
            ids.set("mlflow", run_id)
        self.run_id = run_id

    def write(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        if not self.fresh(row):
            return
        now, step = int(time.time() * 1000), int(row["step"])
        metrics = [Metric(_MLFLOW_KEY.sub("_", k), v, now, step) for k, v in flat_numbers(row).items() if k != "step"]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def checkpoint(self, path: str, step: int) -> None:
        self.client.set_tag(self.run_id, "checkpoint", str(path))
        self.client.set_tag(self.run_id, "checkpoint_step", str(step))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def start_trackers(
    names: list[str],
    run_dir: Path,
    config: dict[str, Any],
    *,
    wandb_project: str = "rayrlhf",
    mlflow_uri: str = "",
    mlflow_experiment: str = "rayrlhf",
) -> list[Any]:
    """The sinks of ``run.trackers`` that started; each one that did not is one console line."""
    ids = _Ids(run_dir)
    makers = {
        "tensorboard": lambda: TensorBoardSink(run_dir),
        "wandb": lambda: WandbSink(run_dir, config, wandb_project, ids),
        "mlflow": lambda: MlflowSink(run_dir, config, mlflow_uri, mlflow_experiment, ids),
    }
    sinks = []
    for name in names:
        try:
            sinks.append(makers[name]())
        except Exception as e:  # never a crashed run: metrics.jsonl and the other trackers go on
            line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(
                f"[rayrlhf] tracker {name} did not start ({type(e).__name__}: {line}); the run goes on without it",
                flush=True,
            )
            log.warning("tracker %s did not start: %r", name, e)
    return sinks
