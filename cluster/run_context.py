"""What every recipe shares: checks before start, the cluster connection, the run directory,
per-phase timers, metrics and progress, evaluation, checkpoints and resume.

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
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import yaml

from actors.start_up import SETUP_HOOK
from cluster.config import Config, UserError
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


class RunContext:
    """One run: its directory, log, timers, checkpoints and (when resuming) the state to continue."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, resume: bool = False) -> None:
        self.cfg = cfg
        self.t_start = time.time()
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        # Absolute: Ray Train's workers run in a folder of their own, so a relative path (a
        # checkpoint to resume from, say) would name nothing there.
        self.dir = (Path(run_dir) if run_dir else Path(cfg.run.output_dir) / f"{cfg.run.name}-{stamp}").absolute()
        self.resume_from: Path | None = None
        self.run_state: dict[str, Any] = {"step": 0, "sampler": {"consumed": 0}, "version": 0}
        if resume:
            ckpt = latest_checkpoint(self.dir)
            if ckpt is None:
                raise UserError(f"--resume {self.dir}: no complete checkpoint under {self.dir / CHECKPOINTS_DIR}")
            self.resume_from = ckpt
            self.run_state = json.loads((ckpt / "trainer_state" / RUN_STATE_FILE).read_text())
            random.setstate(_tuple_state(self.run_state["python_rng"]))
        else:
            random.seed(cfg.run.seed)
        self.start_step = int(self.run_state["step"])
        self.runlog = RunLog(self.dir, cfg.run.steps, keep_until_step=self.start_step if resume else None)
        self.runlog.save_config(cfg.to_dict())
        from cluster.ops.console import attach_run_dir

        attach_run_dir(self.dir)
        if cfg.run.trackers:
            from cluster.ops.trackers import start_trackers

            self.runlog.sinks += start_trackers(
                cfg.run.trackers,
                self.dir,
                cfg.to_dict(),
                wandb_project=cfg.run.wandb_project,
                mlflow_uri=cfg.run.mlflow_tracking_uri,
                mlflow_experiment=cfg.run.mlflow_experiment,
            )
        # Early stopping: best value, its step, evaluations since (carried by checkpoints).
        self.early = dict(
            self.run_state.get("early_stop") or {"best": None, "best_step": None, "bad": 0, "stopped": False}
        )
        self.final_checkpoint: Path | None = None
        self._last_version = int(self.run_state["version"])
        self.times: dict[str, float] = {}
        self.started_cluster = self.connected = False
        self.join_reason = ""
        self.dashboard_url = ""

    # -- cluster ---------------------------------------------------------------------------------
    def connect(self) -> None:
        """Joins the configured / ambient cluster, else starts a local one; then checks that the
        roles fit it (a request no node can meet would otherwise wait forever)."""
        import ray

        from cluster.roles.resources import check_fits, cluster_node_cpus, cluster_resources, role_requests

        cfg = self.cfg
        requests = role_requests(cfg)
        if not ray.is_initialized():
            self._init_ray(sum(r.count * r.cpus for r in requests))
            self.connected = True  # this run made the connection: ``close`` leaves it
        check_fits(requests, cluster_node_cpus(), cluster_resources())
        self._announce_cluster()
        if cfg.cluster.metrics_export:
            from cluster.ops.telemetry import RayMetricsSink

            self.runlog.sinks.append(RayMetricsSink(self.dir.name))

    def _init_ray(self, needed_cpus: float) -> None:
        import ray

        cfg = self.cfg
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Job-wide default for every worker, Ray Train's included: Ray would otherwise pin each
        # process's OpenMP pool to its reserved CPUs (often 1); the roles work one phase at a time.
        env_vars = {
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(cfg.cluster.threads or os.cpu_count() or 1),
        }
        runtime_env = job_runtime_env(env_vars, lighter_gc=cfg.cluster.lighter_gc)
        address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
        if not address:
            address = running_local_cluster(cfg.cluster.temp_dir or None) or ""
            if address:  # a head started by `ray start` on this machine: join it, as `ray job submit` runs do
                self.join_reason = (
                    f"joined the cluster `ray start` left at {address}; "
                    "cluster.address=local starts a run's own instead"
                )
        if address and address != "local":
            self.dashboard_url = ray.init(address=address, runtime_env=runtime_env, log_to_driver=True).dashboard_url
            return
        kwargs: dict[str, Any] = dict(
            address="local",
            num_cpus=cfg.cluster.num_cpus or max(os.cpu_count() or 1, math.ceil(needed_cpus)),
            include_dashboard=cfg.cluster.include_dashboard,
            dashboard_host=cfg.cluster.dashboard_host,
            runtime_env=runtime_env,
        )
        if cfg.cluster.temp_dir:
            kwargs["_temp_dir"] = cfg.cluster.temp_dir
        self.dashboard_url = ray.init(**kwargs).dashboard_url
        self.started_cluster = True

    def _announce_cluster(self) -> None:
        """One line on the cluster (Ray's own start-up messages go to the log file)."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
        ports = sorted({n.get("MetricsExportPort") for n in nodes if n.get("MetricsExportPort")})
        url = self.dashboard_url
        print(
            f"[rayrlhf] Ray cluster: {len(nodes)} node(s), {cpus:g} CPUs"
            + (f"; dashboard http://{url}" if url else "")
            + (f"; Prometheus metrics on port {', '.join(map(str, ports))}" if ports else "")
            + ("" if self.started_cluster else f" (joined{': ' + self.join_reason if self.join_reason else ''})")
            + (" (started for this run)" if self.started_cluster else ""),
            flush=True,
        )

    def close(self) -> None:
        """Closes the run's log; leaves the cluster if this run connected (a caller's own
        connection is kept; a joined cluster keeps running, one started for the run stops). Ray
        prints the repeated worker and raylet lines it held back (its log deduplication) when the
        driver disconnects: here, still through ``rayrlhf train``'s quiet console, not at exit."""
        import ray

        self.runlog.close()
        if self.connected:
            ray.shutdown()

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

        evals = [r["eval/accuracy"] for r in self.runlog.rows if r.get("eval/accuracy") is not None]
        if len(evals) > 1:
            print(
                f"[rayrlhf] held-out {self.runlog.eval_label}: {evals[0]:.3f} (first evaluation) -> {evals[-1]:.3f} (last)",
                flush=True,
            )
        print(
            f"[rayrlhf] done in {seconds:.0f}s; metrics: {self.runlog.path}"
            + (f"; checkpoint: {self.final_checkpoint}" if self.final_checkpoint else ""),
            flush=True,
        )
        learned = learned_line(self.runlog.rows, self.runlog.eval_label)
        if learned:  # the last line: what the run learned, with its uncertainty
            print(learned, flush=True)
        return RunResult(self.dir, self.runlog.rows, self.final_checkpoint, seconds)


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


def job_runtime_env(env_vars: dict[str, str], lighter_gc: bool = True) -> dict[str, Any]:
    """The job's runtime environment: ``env_vars`` for every worker, and (``cluster.lighter_gc``)
    the setup hook that makes each worker's start-up imports cheaper (``actors/start_up.py``)
    unless the job already has a hook of its own (``ray job submit --runtime-env-json``: Ray
    refuses a second one)."""
    from ray._private import ray_constants

    env: dict[str, Any] = {"env_vars": dict(env_vars)}
    if lighter_gc and not os.environ.get(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR):
        env["worker_process_setup_hook"] = SETUP_HOOK
    return env


def running_local_cluster(temp_dir: str | None = None) -> str | None:
    """The address of a head that `ray start` left running on this machine (Ray's own address
    file in its temp folder), if its GCS answers; None otherwise (also for a stale file).
    ``ray.init()`` without an address would join such a head by itself and then refuse the
    resources a local start passes."""
    import socket

    from ray._private.utils import read_ray_address

    address = read_ray_address(temp_dir)
    if not address or ":" not in address:
        return None
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return address
    except (OSError, ValueError):
        return None


def _tuple_state(state: Any) -> Any:
    """JSON turned random.getstate()'s tuples into lists; random.setstate wants them back."""
    return tuple(_tuple_state(x) for x in state) if isinstance(state, list) else state
