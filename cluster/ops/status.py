"""``rayrlhf status RUN_DIR``: where a run stands, from its files alone (no cluster needed).

Step and the last figures from ``metrics.jsonl``, the newest complete checkpoint, and the prompt
ledger's counts (issued, trained, dropped by reason, lost, trained twice, restarts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.ops.ledger import LEDGER_FILE, read_ledger, summarize
from cluster.run_context import latest_checkpoint


def run_status(run_dir: str | Path) -> dict[str, Any]:
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run} is not a run directory (no config.yaml)")
    rows = []
    if (run / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    total = (cfg.get("run") or {}).get("steps")
    last = rows[-1] if rows else {}
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    ckpt = latest_checkpoint(run)
    out: dict[str, Any] = {
        "run_dir": str(run.resolve()),
        "algorithm": (cfg.get("run") or {}).get("algorithm", "ppo"),
        "step": last.get("step", 0),
        "steps": total,
        "finished": bool(total) and last.get("step", 0) >= total,
        "reward_mean": last.get("reward/mean"),
        "loss": last.get("loss/total"),
        "eval_accuracy": {
            "first": evals[0]["eval/accuracy"],
            "last": evals[-1]["eval/accuracy"],
            "step": evals[-1]["step"],
        }
        if evals
        else None,
        "last_checkpoint": str(ckpt) if ckpt else None,
        "elapsed_s": last.get("time/elapsed_s"),
    }
    if (run / LEDGER_FILE).is_file():
        summary = summarize(read_ledger(run))
        out["ledger"] = summary
    return out


def format_status(s: dict[str, Any]) -> str:
    lines = [
        f"run        {s['run_dir']} ({s['algorithm']})",
        f"step       {s['step']}/{s['steps']}" + (" (finished)" if s["finished"] else ""),
    ]
    if s["reward_mean"] is not None:
        lines.append(f"reward     {s['reward_mean']:.3f} (last step)")
    if s["loss"] is not None:
        lines.append(f"loss       {s['loss']:.4f} (last step)")
    if s["eval_accuracy"]:
        e = s["eval_accuracy"]
        lines.append(f"held-out   {e['first']:.3f} (first evaluation) -> {e['last']:.3f} (step {e['step']})")
    lines.append(f"checkpoint {s['last_checkpoint'] or 'none yet'}")
    if s.get("elapsed_s"):
        lines.append(f"elapsed    {s['elapsed_s']:.0f}s")
    led = s.get("ledger")
    if led:
        p = led["prompts"]
        unit = led.get("unit", "prompt")
        scored = f"{p['scored']} scored, " if unit == "prompt" else ""  # only prompts get rewards
        lines.append(
            f"{unit + 's':<10} {p['issued']} issued, {scored}{p['trained']} trained, {p['dropped']} dropped, "
            f"{p['pending']} pending, {p['lost']} lost, {p['trained_twice']} trained twice, "
            f"{p['reissued']} reissued"
        )
        if led["samples_dropped"]:
            lines.append(
                "dropped    " + ", ".join(f"{k} {v}" for k, v in sorted(led["samples_dropped"].items())) + " (samples)"
            )
        parts = [f"{k} {v}" for k, v in sorted(led["restarts"].items())]
        if led["resumes"]:
            parts.append(f"resumed {led['resumes']} time(s)")
        if parts:
            lines.append("restarts   " + ", ".join(parts))
        if led["lost_uids"]:
            lines.append(f"lost uids  {led['lost_uids']}")
    return "\n".join(lines)


def main(run_dir: str, as_json: bool = False) -> int:
    try:
        s = run_status(run_dir)
    except FileNotFoundError as e:
        print(f"rayrlhf: {e}")
        return 2
    print(json.dumps(s, indent=2) if as_json else format_status(s))
    return 0
