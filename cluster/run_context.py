"""What every recipe shares: checks before start, the run directory, per-phase timers, metrics
and progress, checkpoints, early stopping and resume. The cluster connection is its own object
(``cluster/connection.py``), as are the prompt sampler and the held-out evaluation
(``cluster/data/prompts.py``).

A recipe (``cluster/recipes/<algorithm>.py``) holds only its algorithm's loop; everything here
is the same for every algorithm.

Checkpoints: ``checkpoints/step_NNNNN/`` is a model folder (see ``learners/base.py``); the run's
own state (step, prompt-sampler position, driver RNG, policy version) and the config go into its
``trainer_state/`` beside the learner's. ``run_state.json`` is written last: a checkpoint without
it is incomplete (a crash mid-save) and never resumed from.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import yaml

from cluster.config import Config, UserError
from cluster.data.prompts import PromptSampler
from cluster.connection import ClusterConnection
from cluster.ops.metrics import RunLog

log = logging.getLogger("rayrlhf.run")

RUN_STATE_FILE = "run_state.json"
CHECKPOINTS_DIR = "checkpoints"


@dataclass
class RunResult:
    run_dir: Path
    history: list[dict[str, Any]]
    final_checkpoint: Path | None
    seconds: float
    # A staged run: each stage's result, in order (those run in this call).
    stages: list["RunResult"] = field(default_factory=list)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory (one whose run state was written)."""
    folders = sorted(Path(run_dir, CHECKPOINTS_DIR).glob("step_*"))
    complete = [f for f in folders if (f / "trainer_state" / RUN_STATE_FILE).is_file()]
    return complete[-1] if complete else None


def preflight(cfg: Config) -> tuple[str, Any, Any, str]:
    """Resolves what the user named (model, data, reward function) before anything starts;
    a missing or broken one raises UserError with one clear line. Returns the model folder, the
    recipe's train and held-out data and a one-line description of them."""
    from cluster.assets import resolve_model
    from cluster.recipes import recipe_module

    try:
        model_path = resolve_model(cfg.model.path, cfg.model.cache_dir or None)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    train_set, eval_set, description = recipe_module(cfg.run.algorithm).load_data(cfg)
    return model_path, train_set, eval_set, description


def fresh_start(seed: int) -> tuple[None, dict[str, Any]]:
    """A new run's state (step 0, no prompt consumed, version 0); the driver's RNG seeded."""
    random.seed(seed)
    return None, {"step": 0, "sampler": {"consumed": 0}, "version": 0}


def resume_point(run_dir: Path, seed: int) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint of ``run_dir`` and the run state written into it (the
    driver's RNG restored from it); UserError when there is none."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise UserError(f"--resume {run_dir}: no complete checkpoint under {run_dir / CHECKPOINTS_DIR}")
    state = json.loads((ckpt / "trainer_state" / RUN_STATE_FILE).read_text())
    random.setstate(_tuple_state(state["python_rng"]))
    return ckpt, state


def open_run_log(cfg: Config, run_dir: Path, keep_until_step: int | None) -> RunLog:
    """The run's metric sinks: the JSONL log and progress line (``RunLog``, with the config
    saved), ``train.log`` beside it, and the experiment trackers ``run.trackers`` names."""
    from cluster.ops.console import attach_run_dir

    runlog = RunLog(run_dir, cfg.run.steps, keep_until_step=keep_until_step)
    runlog.save_config(cfg.to_dict())
    attach_run_dir(run_dir)
    if cfg.run.trackers:
        from cluster.ops.trackers import start_trackers

        runlog.sinks += start_trackers(
            cfg.run.trackers,
            run_dir,
            cfg.to_dict(),
            wandb_project=cfg.run.wandb_project,
            mlflow_uri=cfg.run.mlflow_tracking_uri,
            mlflow_experiment=cfg.run.mlflow_experiment,
        )
    return runlog


class RunContext:
    """One run: its directory, log, timers, checkpoints and (when resuming) the state to continue."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, resume: bool = False) -> None:
        self.cfg = cfg
        self.t_start = time.time()
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        # Absolute: Ray Train's workers run in a folder of their own, so a relative path (a
        # checkpoint to resume from, say) would name nothing there.
        self.dir = (Path(run_dir) if run_dir else Path(cfg.run.output_dir) / f"{cfg.run.name}-{stamp}").absolute()
        self.resume_from, self.run_state = resume_point(self.dir, cfg.run.seed) if resume else fresh_start(cfg.run.seed)
        self.start_step = int(self.run_state["step"])
        self.runlog = open_run_log(cfg, self.dir, keep_until_step=self.start_step if resume else None)
        # Early stopping: best value, its step, evaluations since (carried by checkpoints).
        self.early = dict(
            self.run_state.get("early_stop") or {"best": None, "best_step": None, "bad": 0, "stopped": False}
        )
        self.final_checkpoint: Path | None = None
        self._last_version = int(self.run_state["version"])
        self.times: dict[str, float] = {}
        self.cluster = ClusterConnection(cfg.cluster)

    # -- cluster ---------------------------------------------------------------------------------
    def connect(self) -> None:
        """Joins or starts the cluster and checks that the run's roles fit it
        (``cluster/connection.py``); Ray metrics join the run's sinks."""
        from cluster.roles.resources import role_requests

        self.cluster.connect(role_requests(self.cfg))
        if self.cfg.cluster.metrics_export:
            from cluster.ops.telemetry import RayMetricsSink

            self.runlog.sinks.append(RayMetricsSink(self.dir.name))

    def close(self) -> None:
        """Closes the run's log, then leaves the cluster if this run connected. Ray prints the
        repeated worker and raylet lines it held back (its log deduplication) when the driver
        disconnects: here, still through ``rayrlhf train``'s quiet console, not at exit."""
        self.runlog.close()
        self.cluster.close()

    # -- the loop --------------------------------------------------------------------------------
    def steps(self) -> range:
        """The steps still to run (all of them, or those after the resumed checkpoint; none after
        a checkpoint an early stop marked final)."""
        if self.early.get("stopped"):
            return range(0)
        return range(self.start_step + 1, self.cfg.run.steps + 1)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times one phase of a step into ``time/<name>_s``."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{name}_s"] = time.perf_counter() - t

    def checkpoint_path(self, step: int) -> str:
        return str((self.dir / CHECKPOINTS_DIR / f"step_{step:05d}").resolve())

    def checkpoint_dir(self, step: int) -> str | None:
        """Where this step's checkpoint goes, if one is due."""
        run = self.cfg.run
        last = step == run.steps
        if (run.save_every and step % run.save_every == 0) or (last and run.save_final):
            return self.checkpoint_path(step)
        return None

    def early_stop(self, row: dict[str, Any], save: Any, sampler: PromptSampler) -> bool:
        """Whether to stop after this step: ``run.early_stop_metric`` (when this row evaluated it)
        has not improved for ``run.early_stop_patience`` evaluations. Stopping saves this step's
        checkpoint (``save()`` -> the learners' reply) unless one was just written, marked as
        final, so resuming a stopped run (or a later stage) treats it as done. With
        ``run.early_stop_keep_best`` each improvement is saved instead, and stopping makes the
        best checkpoint the run's final one (later checkpoints are removed)."""
        run, e = self.cfg.run, self.early
        metric = run.early_stop_metric
        value = row.get(metric)
        if not metric or value is None or isinstance(value, (list, dict)) or math.isnan(float(value)):
            return False
        lower = run.early_stop_mode == "min" or (
            run.early_stop_mode == "auto" and ("loss" in metric or "nll" in metric)
        )
        if e["best"] is None or (value < e["best"] if lower else value > e["best"]):
            e.update(best=float(value), best_step=row["step"], bad=0)
            if run.early_stop_keep_best:
                e["best_checkpoint"] = self._checkpoint_of(row, save, sampler)
            return False
        e["bad"] += 1
        if e["bad"] < run.early_stop_patience:
            return False
        e["stopped"] = True
        step = row["step"]
        print(
            f"[rayrlhf] early stop at step {step}: {metric} has not improved for {e['bad']} evaluations "
            f"(best {e['best']:.4f} at step {e['best_step']}, now {float(value):.4f})"
            + (f"; keeping the best checkpoint {e['best_checkpoint']}" if e.get("best_checkpoint") else ""),
            flush=True,
        )
        if e.get("best_checkpoint"):
            self._keep_best(Path(e["best_checkpoint"]))
        else:
            self._checkpoint_of(row, save, sampler)  # (re)written with stopped=True
        return True

    def _checkpoint_of(self, row: dict[str, Any], save: Any, sampler: PromptSampler) -> str:
        """This step's checkpoint: the one the step wrote (its state written again, with the
        current early-stopping state), else a new one (``save()``)."""
        if row.get("checkpoint") and self.final_checkpoint == Path(row["checkpoint"]):
            self.finish_checkpoint(row["checkpoint"], row["step"], sampler, self._last_version)
            return row["checkpoint"]
        reply = save()
        self.finish_checkpoint(reply["saved"], row["step"], sampler, reply["version"])
        return reply["saved"]

    def _keep_best(self, best: Path) -> None:
        """The best checkpoint becomes the run's last (its state marked stopped); newer ones go."""
        for folder in sorted((self.dir / CHECKPOINTS_DIR).glob("step_*")):
            if folder.name > best.name:
                shutil.rmtree(folder, ignore_errors=True)
        path = best / "trainer_state" / RUN_STATE_FILE
        state = json.loads(path.read_text())
        state["early_stop"] = dict(self.early)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(path)
        self.final_checkpoint = best

    def eval_due(self, step: int) -> bool:
        """Step 0 is the starting policy, evaluated once on a fresh run."""
        run = self.cfg.run
        if not run.eval_every:
            return False
        if step == 0:
            return run.eval_before_train and self.start_step == 0
        return step % run.eval_every == 0 or step == run.steps

    def log_base_eval(self, metrics: dict[str, float]) -> None:
        """Logs the starting policy's evaluation as step 0 (no training metrics)."""
        row = {"step": 0, **metrics, **self.times}
        self.times = {}
        self.runlog.log(row)
        print(
            f"[rayrlhf] before training: held-out {self.runlog.eval_label} "
            f"{metrics.get('eval/accuracy', float('nan')):.3f} ({int(metrics.get('eval/n', 0))} held out)",
            flush=True,
        )

    def finish_checkpoint(self, folder: str, step: int, sampler: PromptSampler, version: int) -> None:
        """Adds the run's state to a checkpoint the learner wrote, then prunes old ones."""
        state_dir = Path(folder) / "trainer_state"
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        state = {
            "step": step,
            "sampler": sampler.state_dict(),
            "version": version,
            "python_rng": random.getstate(),
            "early_stop": dict(self.early),
        }
        self._last_version = version
        tmp = state_dir / (RUN_STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(state_dir / RUN_STATE_FILE)
        self.final_checkpoint = Path(folder)
        self.runlog.checkpoint(folder, step)
        self._prune()

    def _prune(self) -> None:
        keep = self.cfg.run.keep_last
        if not keep:
            return
        folders = sorted((self.dir / CHECKPOINTS_DIR).glob("step_*"))
        best = self.early.get("best_checkpoint")
        for old in folders[:-keep]:
            if best is None or old != Path(best):  # the best one stays (run.early_stop_keep_best)
                shutil.rmtree(old, ignore_errors=True)

    def log_step(self, step: int, row: dict[str, Any]) -> None:
        row = {"step": step, **row, **self.times}
        row["time/step_s"] = sum(v for k, v in self.times.items() if k != "time/eval_s")
        row["time/elapsed_s"] = time.time() - self.t_start
        self.times = {}
        self.runlog.log(row)
        self.runlog.progress(row)

    def result(self) -> RunResult:
        if self.cfg.run.plot:
            self.runlog.plot()
        seconds = time.time() - self.t_start
        from cluster.ops.learned import learned_line

        print(
            f"[rayrlhf] done in {seconds:.0f}s; metrics: {self.runlog.path}"
            + (f"; checkpoint: {self.final_checkpoint}" if self.final_checkpoint else ""),
            flush=True,
        )
        learned = learned_line(self.runlog.rows, self.runlog.eval_label)
        if learned:  # the last line: what the run learned, with its uncertainty
            print(learned, flush=True)
        return RunResult(self.dir, self.runlog.rows, self.final_checkpoint, seconds)


def _tuple_state(state: Any) -> Any:
    """JSON turned random.getstate()'s tuples into lists; random.setstate wants them back."""
    return tuple(_tuple_state(x) for x in state) if isinstance(state, list) else state
