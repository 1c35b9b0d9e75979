"""Reading and comparing runs' outputs in tests: metrics rows, a crashed copy of a finished run,
and the check that a resumed run ended as the uninterrupted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from learners.base import load_model_weights


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def crashed_copy(run_dir: Path, after_step: int, dest: Path) -> Path:
    """A copy of a finished run as a crash right after step ``after_step``'s checkpoint would have
    left it: every file of the later steps is still there (metrics rows, ledger records, exported
    data), only their checkpoints are not. A resume must ignore the rest."""
    shutil.copytree(run_dir, dest)
    for folder in (dest / "checkpoints").glob("step_*"):
        if int(folder.name.split("_")[1]) > after_step:
            shutil.rmtree(folder)
    return dest


def assert_same_run(
    resumed: Path,
    straight: Path,
    keys: tuple[str, ...],
    ids_key: str | None,
    final: str,
    atol: float = 1e-5,
    weight_atol: float | None = None,
) -> None:
    """The resumed run logged the same steps, drew the same units in the same order, logged the same
    ``keys`` (rewards or losses) within ``atol`` and ended with the same weights (within
    ``weight_atol``, default ``atol``) as the uninterrupted one."""
    got, want = rows(resumed), rows(straight)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    if ids_key:
        assert [r.get(ids_key) for r in got] == [r.get(ids_key) for r in want]
    for key in keys:
        steps = [r["step"] for r in want if r.get(key) is not None]
        assert steps and steps == [r["step"] for r in got if r.get(key) is not None], key
        values = [r[key] for r in got if r.get(key) is not None]
        assert values == pytest.approx([r[key] for r in want if r.get(key) is not None], abs=atol), key
    a = load_model_weights(Path(resumed) / "checkpoints" / final)
    b = load_model_weights(Path(straight) / "checkpoints" / final)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(
            a[k], b[k], atol=atol if weight_atol is None else weight_atol, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}"
        )
