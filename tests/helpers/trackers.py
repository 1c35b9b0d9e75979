"""Reading back what the trackers wrote offline, with the trackers' own formats: a W&B offline
run file (its records are LevelDB-log framed protobufs, ``wandb.proto``) and an MLflow store
(through ``MlflowClient``)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

_BLOCK = 32768  # the LevelDB log format's block size, as W&B writes it


def _wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a record header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start a record, MIDDLE/LAST continue it
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def wandb_offline_run(run_dir: Path) -> dict[str, Any]:
    """{"history": {step: {key: value}}, "summary": {...}, "config": {...}, "run_ids": [...],
    "history_records": {step: n}} of the W&B offline runs under ``run_dir/wandb`` (a resumed
    run's files together): ``run_ids`` each file's run id, ``history_records`` how many history
    records each step got across the files (a merged history alone would hide a step sent twice
    or a resume that opened a new W&B run)."""
    out: dict[str, Any] = {"history": {}, "summary": {}, "config": {}, "run_ids": [], "history_records": {}}
    for f in sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb")):
        for r in _wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                out["run_ids"].append(r.run.run_id)
            if kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
                step = int(items["_step"])
                out["history"].setdefault(step, {}).update(items)
                out["history_records"][step] = out["history_records"].get(step, 0) + 1
            elif kind == "summary":
                out["summary"].update(
                    {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.summary.update}
                )
            elif kind in ("run", "config"):
                update = r.run.config.update if kind == "run" else r.config.update
                out["config"].update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in update})
    return out


def mlflow_run(run_dir: Path) -> dict[str, Any]:
    """{"metrics": {key: {step: value}}, "params": {...}, "tags": {...}} of the run's MLflow run
    in its file store (``<run dir>/mlruns``)."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    run_id = json.loads(Path(run_dir, "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(Path(run_dir).resolve() / "mlruns").as_uri())
    run = client.get_run(run_id)
    metrics = {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in run.data.metrics}
    return {"metrics": metrics, "params": dict(run.data.params), "tags": dict(run.data.tags)}
