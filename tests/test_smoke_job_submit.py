"""Smoke test of the real entry point: `ray job submit ... -- rayrlhf train ...` against the
running test cluster (dashboard on 127.0.0.1); the job joins that cluster."""

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.smoke


def test_ray_job_submit_runs_the_cli(ray_cluster, tmp_path):
    url = f"{ray_cluster['dashboard']}/api/version"
    # The dashboard answers only requests carrying the cluster's token.
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(url, timeout=30)
    token = Path(ray_cluster["env"]["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert "ray_version" in json.loads(r.read())
    out_dir = tmp_path / "runs"
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [
        ray_bin, "job", "submit", "--address", ray_cluster["dashboard"], "--working-dir", str(ROOT), "--",
        "rayrlhf", "train", "configs/ppo_tiny.yaml", "--set", "run.steps=2", "--set", f"run.output_dir={out_dir}",
        "--set", "run.name=smoke", "--set", "run.eval_every=2",
    ]
    proc = subprocess.run(cmd, env=ray_cluster["env"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "succeeded" in log, log[-4000:]
    # The job joined the running cluster rather than starting its own.
    assert "Connecting to existing Ray cluster" in log or "Connected to Ray cluster" in log, log[-4000:]
    assert "step 2/2" in log
    runs = list(out_dir.glob("smoke-*"))
    assert len(runs) == 1
    rows = [json.loads(l) for l in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the starting policy's evaluation
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    assert "before training: held-out greedy accuracy" in log and "(first evaluation) ->" in log
    assert (runs[0] / "curves.png").is_file()
    assert (runs[0] / "checkpoints" / "step_00002" / "model.safetensors").is_file()


def test_cli_rejects_a_wrong_config_key_before_starting_anything(tmp_path):
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "rayrlhf"), "train", "configs/ppo_tiny.yaml", "--set", "ppo.learning_rate=1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "ppo.learning_rate" in proc.stderr and "valid keys" in proc.stderr


@pytest.mark.parametrize("override, words", [
    ("data.task=jsonl:/nonexistent/prompts.jsonl", "prompt file not found"),
    ("data.task=no_such_task", "no_such_task"),
    ("reward.function=no_such_module:score", "cannot import module"),
    ("model.path=/nonexistent/model", "neither a built-in asset"),
])
def test_cli_reports_user_errors_in_one_line(tmp_path, override, words):
    """What the user named must exist: one clear line and exit code 2, no traceback, nothing started."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "rayrlhf"), "train", "configs/ppo_tiny.yaml", "--set", override,
         "--set", f"run.output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rayrlhf:")]
    assert len(lines) == 1 and words in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_cli_resume_refuses_a_changed_model(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((ROOT / "configs" / "ppo_tiny.yaml").read_text())
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "rayrlhf"), "train", "--resume", str(run), "--set", "model.path=smollm2-135m"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 2 and "cannot resume with a different model.path" in proc.stderr, proc.stderr
