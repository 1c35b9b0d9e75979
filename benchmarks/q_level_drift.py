"""How far a calibrated Q-learning run's state values drifted: over the action tokens of a finished
online Q run's last step (its ``data/transitions``), the final checkpoint against the initial model,
split the calibrated Q of each taken token, ``Q(s, a) = log p(a|s) - log p_ref(a|s) + V(s)``, into
the log-ratio (what sampling reads) and the level ``V(s) = logsumexp(logits) - logsumexp(logits_ref)``
(which sampling ignores). At ``qlearn.value_grad`` 0 with ``state_value: model`` no TD error trains
``V``, yet the TD errors read it; with ``state_value: reference`` they read 0 instead.

    .venv/bin/python benchmarks/q_level_drift.py runs/q3/qlearn-seed0 ... [--out docs/results/q_level_drift.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _action_terms(lm, ref, row) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-ratio, level drift) at each action token of one transitions row."""
    ids = torch.tensor(np.concatenate([row.prompt_ids, row.response_ids]).astype(np.int64))[None]
    n_prompt = len(row.prompt_ids)
    actions = (
        torch.ones(len(row.response_ids), dtype=torch.bool)
        if row.action_mask is None
        else torch.as_tensor(row.action_mask, dtype=torch.bool)
    )
    with torch.no_grad():
        a, b = (m(ids).logits[0, n_prompt - 1 : -1].float() for m in (lm, ref))
    taken = ids[0, n_prompt:, None]
    ratio = (a.log_softmax(-1) - b.log_softmax(-1)).gather(-1, taken)[:, 0]
    level = a.logsumexp(-1) - b.logsumexp(-1)
    return ratio[actions], level[actions]


def drift(run_dir: Path) -> dict:
    """The run's last step's action tokens under its last checkpoint: mean and std of both parts."""
    from transformers import AutoModelForCausalLM

    from cluster.assets import resolve_model
    from cluster.config.loading import load_config

    cfg = load_config(run_dir / "config.yaml")
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    steps = sorted((run_dir / "data" / "transitions").glob("step-*.parquet"))
    ref = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model.path), dtype=torch.float32).eval()
    lm = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    parts = [_action_terms(lm, ref, row) for row in pd.read_parquet(steps[-1]).itertuples()]
    ratio, level = (torch.cat(p) for p in zip(*parts))
    return {
        "run": str(run_dir),
        "checkpoint": checkpoint.name,
        "episodes": steps[-1].name,
        "actions": len(ratio),
        "state_value": cfg.qlearn.state_value,
        "value_grad": cfg.qlearn.value_grad,
        "log_ratio_mean": float(ratio.mean()),
        "log_ratio_std": float(ratio.std()),
        "level_mean": float(level.mean()),
        "level_std": float(level.std()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "q_level_drift.json")
    a = ap.parse_args()
    rows = [drift(r) for r in a.runs]
    a.out.write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(
            f"{r['run']} (state_value {r['state_value']}, value_grad {r['value_grad']}): {r['actions']} actions; "
            f"log-ratio {r['log_ratio_mean']:+.3f} (std {r['log_ratio_std']:.3f}); "
            f"level {r['level_mean']:+.3f} (std {r['level_std']:.3f})"
        )


if __name__ == "__main__":
    main()
