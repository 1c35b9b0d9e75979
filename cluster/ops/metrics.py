"""Run directory, per-step metrics (JSONL), a live progress line, and the reward/KL plot."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("rayrlhf.metrics")


def _skipped_rows(row: dict[str, Any]) -> str:
    """' (16/32 rows skipped)' where the learner left rows without advantage out of its passes."""
    skipped, rows = row.get("learner/zero_advantage_rows"), row.get("learner/sequences")
    return f" ({skipped:.0f}/{rows:.0f} rows skipped)" if skipped and rows else ""


class RunLog:
    def __init__(self, run_dir: Path, total_steps: int, stream=None, keep_until_step: int | None = None) -> None:
        """``keep_until_step``: continue an existing log (a resumed run), dropping rows after that
        step (they were logged after the checkpoint it resumes from and will be run again)."""
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.t0 = time.time()
        self.rows: list[dict[str, Any]] = []
        self.first_step = 1
        # What eval/accuracy measures (set by the recipe): a label for logs and plots.
        self.eval_label = "greedy accuracy"
        # Where rows go besides metrics.jsonl (trackers, Ray metrics): objects with write(row), close()
        # and optionally checkpoint(path, step).
        self.sinks: list[Any] = []
        if keep_until_step is not None and self.path.is_file():
            old = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.rows = [r for r in old if r.get("step", 0) <= keep_until_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            self.first_step = keep_until_step + 1

    def save_config(self, cfg_dict: dict) -> None:
        (self.dir / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))

    def log(self, row: dict[str, Any]) -> None:
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        for sink in list(self.sinks):
            try:
                sink.write(row)
            except Exception as e:  # a metrics exporter never stops a run; it is turned off, once
                log.warning(
                    "%s failed (%r): turned off for this run; metrics.jsonl has every row", type(sink).__name__, e
                )
                self.sinks.remove(sink)

    def checkpoint(self, folder: str | Path, step: int) -> None:
        """Tells the sinks that track checkpoints (W&B, MLflow) where one was saved."""
        for sink in list(self.sinks):
            if hasattr(sink, "checkpoint"):
                try:
                    sink.checkpoint(str(folder), step)
                except Exception as e:
                    log.warning("%s could not record checkpoint %s: %r", type(sink).__name__, folder, e)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                pass
        self.sinks = []

    def progress(self, row: dict[str, Any]) -> None:
        step = row["step"]
        elapsed = time.time() - self.t0
        eta = elapsed / max(step - self.first_step + 1, 1) * (self.total - step)
        width = 20
        filled = int(width * step / self.total)
        bar = "#" * filled + "-" * (width - filled)
        head = f"[{bar}] step {step}/{self.total}"
        timing = f" | {elapsed:.0f}s elapsed, eta {eta:.0f}s"
        if "reward/mean" in row or "generate/tokens_per_s" in row:  # online: generate, score, learn, sync
            line = (
                head + f" | reward {row.get('reward/mean', float('nan')):.3f}"
                f"±{row.get('reward/std', float('nan')):.2f}"
                + (f" | kl {row['kl/ref_k1']:.4f}" if "kl/ref_k1" in row else " | no ref")
                + f" | len {row.get('response/length_mean', float('nan')):.1f}"
                f" | {row.get('generate/tokens_per_s', float('nan')):.0f} tok/s"
                f" | gen {row.get('time/generate_s', 0):.1f}s score {row.get('time/score_s', 0):.1f}s"
                f" ref {row.get('time/reference_s', 0):.1f}s learn {row.get('time/learn_s', 0):.1f}s"
                + _skipped_rows(row)
                + f" sync {row.get('time/sync_s', 0):.2f}s"
                + timing
            )
        else:  # offline (preference or supervised data): the learner's loss and metrics
            line = (
                head
                + f" | loss {row.get('loss/total', float('nan')):.4f}"
                + (
                    f" | reward acc {row['rewards/accuracy']:.3f} margin {row['rewards/margin']:.3f}"
                    if "rewards/accuracy" in row
                    else ""
                )
                + f" | learn {row.get('time/learn_s', 0):.1f}s"
                + timing
            )
        if "loss/td" in row:  # Q-learning: Bellman error and the Q of taken vs unseen tokens
            line += f" | td {row['loss/td']:.4f} q {row.get('q/taken', 0):.2f} unseen {row.get('q/unseen_mean', 0):.2f}"
        if "eval/accuracy" in row:
            line += f" | eval acc {row['eval/accuracy']:.3f}"
        if "eval/mean_score" in row and "loss/td" in row:
            line += f" reward {row['eval/mean_score']:.3f}"
        print(line, file=self.stream, flush=True)

    def plot(self) -> Path | None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not self.rows:
            return None
        trained = [r for r in self.rows if r["step"] > 0]  # step 0: the starting policy's evaluation only
        steps = [r["step"] for r in trained]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        online = any("reward/mean" in r for r in trained)
        left, right = (
            (("reward/mean", "train reward (mean)"), ("kl/ref_k1", "KL to reference (k1)"))
            if online
            else (("loss/total", "train loss"), ("rewards/margin", "implicit reward margin"))
        )
        axes[0].plot(steps, [r.get(left[0], float("nan")) for r in trained], label=left[1])
        ev = [(r["step"], r["eval/accuracy"]) for r in self.rows if r.get("eval/accuracy") is not None]
        if ev:
            axes[0].plot(*zip(*ev), "o-", label=f"held-out {self.eval_label}")
        axes[0].set_xlabel("step")
        axes[0].set_title("reward" if online else "loss")
        axes[0].legend()
        axes[1].plot(steps, [r.get(right[0], float("nan")) for r in trained], label=right[1])
        if online:
            axes[1].plot(
                steps, [r.get("policy/approx_kl", float("nan")) for r in trained], label="KL old->new (approx)"
            )
        axes[1].set_xlabel("step")
        axes[1].set_title("KL" if online else "margin")
        axes[1].legend()
        fig.tight_layout()
        out = self.dir / "curves.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def _merge_counts(stats: list[dict], key: str = "skipped") -> dict[str, float]:
    """Each key's values summed over ``stats``: whole numbers stay integers (counts), others
    (an agent's component sums) stay as they are."""
    out: dict[str, float] = {}
    for s in stats:
        for k, v in s.get(key, {}).items():
            out[k] = out.get(k, 0) + (int(v) if float(v).is_integer() else float(v))
    return out


def judge_metrics(score_stats: list[dict]) -> dict[str, float]:
    """The scorers' own counts summed over shards: judge counts of judging generators
    (``counts``, as ``judge/<count>``, with the parse rate) and a scorer actor's ``metrics``
    (e.g. ``remote/failed_attempts``; a ``X/sum`` with its ``X/n`` also as ``X/mean``)."""
    out: dict[str, float] = {}
    for s in score_stats:
        items = [(f"judge/{k}", v) for k, v in s.get("counts", {}).items()] + list(s.get("metrics", {}).items())
        for k, v in items:
            out[k] = out.get(k, 0) + v
    if "judge/judgements" in out:
        out["judge/parse_rate"] = out["judge/parsed"] / max(out["judge/judgements"], 1)
    for k in [k for k in out if k.endswith("/sum") and k[:-4] + "/n" in out]:  # reward components, sources
        out[k[:-4] + "/mean"] = out[k] / max(out[k[:-4] + "/n"], 1)
    return out


def step_metrics(gen_stats: list[dict], score_stats: list[dict], learner: dict[str, float]) -> dict[str, Any]:
    """One step's row from the generators', scorer's and learners' stats."""
    lengths = [x for s in gen_stats for x in s["response_lengths"]]
    scores = [x for s in score_stats for x in s["scores"]]
    # Per generator, the seconds of all its work units; the busiest one bounds the phase.
    busy: dict[Any, float] = {}
    for i, s in enumerate(gen_stats):
        key = s.get("generator", i)
        busy[key] = busy.get(key, 0.0) + s["seconds"]
    gen_s = max(busy.values())
    tokens = sum(s["tokens"] for s in gen_stats)
    n = max(len(scores), 1)
    mean = sum(scores) / n
    out: dict[str, Any] = {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((x - mean) ** 2 for x in scores) / n),
        "reward/n": len(scores),
        "response/length_mean": sum(lengths) / max(len(lengths), 1),
        "response/truncated_frac": sum(s["truncated"] for s in gen_stats) / max(len(lengths), 1),
        "generate/tokens": tokens,
        "generate/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "generate/policy_version": min(s["policy_version"] for s in gen_stats),
        # Response tokens per weight version that sampled them: more than one version when a weight
        # update landed mid-generation (rollout.inflight_updates).
        "generate/tokens_by_version": _merge_counts(gen_stats, "token_versions"),
        "skipped": _merge_counts(score_stats),
        "sample": gen_stats[0]["samples"][:1],
    }
    episodes = _merge_counts(gen_stats, "episodes")
    if episodes:  # multi-turn rollouts: turns per episode, how episodes ended, tool-call outcomes
        out.update({f"episode/{k}": v for k, v in episodes.items()})
        out["episode/turns_mean"] = episodes["turns"] / max(episodes.get("kept", 0), 1)
        for k in [k for k in episodes if k.endswith("/sum") and k[:-4] + "/n" in episodes]:  # an agent's components
            out[f"episode/{k[:-4]}/mean"] = episodes[k] / max(episodes[k[:-4] + "/n"], 1)
    out.update(judge_metrics(score_stats))
    out.update({k: v for k, v in learner.items() if k != "response/length_mean"})
    return out
