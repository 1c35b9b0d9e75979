"""The run's metrics outside ``metrics.jsonl``: Ray metrics (Prometheus, the Ray Dashboard,
Grafana) and TensorBoard event files.

Ray metrics: ``ray.util.metrics`` gauges set by the driver are exported by the node's metrics
agent on its ``metrics_export_port`` as ``ray_<name>`` with a ``run`` tag. All are gauges: a
Histogram's sum is approximated from bucket midpoints by Ray's exporter, and cumulative counts
exported as gauges stay exact.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# name -> (description, extra tag keys). Exported as ``ray_<name>{run=..., <tags>}``.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "rayrlhf_step": ("Last finished training step.", ()),
    "rayrlhf_policy_version": ("Policy version (optimiser updates) the learners hold.", ()),
    "rayrlhf_rollout_tokens_per_s": ("Generated tokens per second of the last step's rollout.", ()),
    "rayrlhf_reward_mean": ("Mean reward of the last step's scored samples.", ()),
    "rayrlhf_kl": ("KL to the reference (k1 estimate) of the last step.", ()),
    "rayrlhf_loss": ("Learner losses of the last step, by kind (policy, value, total).", ("kind",)),
    "rayrlhf_staleness": ("Policy versions between the learners and the samples they last trained on.", ()),
    "rayrlhf_queue_depth": ("Experience batches waiting for the learners.", ()),
    "rayrlhf_weight_sync_seconds": ("Seconds of the last weight sync (learners to generators).", ()),
    "rayrlhf_phase_seconds": (
        "Seconds of each phase of the last step (generate, score, reference, learn, sync).",
        ("phase",),
    ),
    "rayrlhf_eval_accuracy": ("Held-out accuracy at the last evaluation.", ()),
    "rayrlhf_samples_dropped": ("Samples dropped so far in this run, by reason (cumulative).", ("reason",)),
    "rayrlhf_prompts": (
        "Prompts so far in this run by ledger event: issued, reissued, scored, trained, dropped (cumulative).",
        ("event",),
    ),
    "rayrlhf_restarts": ("Role restarts so far in this run, by role: generator, learner (cumulative).", ("role",)),
}

TENSORBOARD_DIR = "tensorboard"


def flat_numbers(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics row, nested dicts flattened with ``/`` (``skipped/reward_error``)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_numbers(v, name + "/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = float(v)
    return out


class TensorBoardSink:
    """Every number of every row as a TensorBoard scalar at its step (``<run>/tensorboard/``)."""

    def __init__(self, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.folder = Path(run_dir) / TENSORBOARD_DIR
        self.writer = SummaryWriter(str(self.folder), flush_secs=30)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for name, value in flat_numbers(row).items():
            if name != "step":
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def gauge_values(row: dict[str, Any], totals: dict[str, float]) -> list[tuple[str, float, dict[str, str]]]:
    """The Ray gauges a metrics row sets: ``(metric, value, extra tags)``. ``totals`` carries the
    cumulative counts (dropped samples by reason) from row to row."""
    out: list[tuple[str, float, dict[str, str]]] = [("rayrlhf_step", float(row["step"]), {})]
    direct = {
        "rayrlhf_policy_version": "policy/version",
        "rayrlhf_rollout_tokens_per_s": "generate/tokens_per_s",
        "rayrlhf_reward_mean": "reward/mean",
        "rayrlhf_kl": "kl/ref_k1",
        "rayrlhf_staleness": "policy/staleness",
        "rayrlhf_queue_depth": "queue/depth",
        "rayrlhf_weight_sync_seconds": "time/sync_s",
        "rayrlhf_eval_accuracy": "eval/accuracy",
    }
    numbers = flat_numbers(row)
    for metric, key in direct.items():
        if key in numbers:
            out.append((metric, numbers[key], {}))
    for key, value in numbers.items():
        if key.startswith("loss/"):
            out.append(("rayrlhf_loss", value, {"kind": key[len("loss/") :]}))
        elif key.startswith("time/") and key.endswith("_s") and key not in ("time/step_s", "time/elapsed_s"):
            out.append(("rayrlhf_phase_seconds", value, {"phase": key[len("time/") : -2]}))
        elif key.startswith("ledger/"):
            out.append(("rayrlhf_prompts", value, {"event": key[len("ledger/") :]}))
        elif key.startswith("restarts/"):
            out.append(("rayrlhf_restarts", value, {"role": key[len("restarts/") :]}))
    for reason, n in (row.get("skipped") or {}).items():
        if reason != "truncated":  # a count of samples that hit the length limit, not a drop
            totals[reason] = totals.get(reason, 0.0) + float(n)
    out += [("rayrlhf_samples_dropped", n, {"reason": reason}) for reason, n in totals.items()]
    return out


class RayMetricsSink:
    """The rows' key figures as ``ray.util.metrics`` gauges (tag ``run``: the run directory's name)."""

    def __init__(self, run_name: str) -> None:
        from ray.util.metrics import Gauge

        self.run = run_name
        self.gauges = {
            name: Gauge(name, description=desc, tag_keys=("run", *tags)) for name, (desc, tags) in METRICS.items()
        }
        self.totals: dict[str, float] = {}

    def write(self, row: dict[str, Any]) -> None:
        for metric, value, tags in gauge_values(row, self.totals):
            self.gauges[metric].set(value, tags={"run": self.run, **tags})

    def close(self) -> None:
        pass
