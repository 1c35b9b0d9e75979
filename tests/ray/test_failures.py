"""Surviving failures, on the real stack: the `rayrlhf train` CLI runs as its own driver on the
shared test cluster while the test kills one of its processes from outside (SIGKILL by PID), or
the whole driver, and then reads the run's per-prompt ledger.

Also: a run whose roles cannot be placed ends at once with a message naming what it asked for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cluster.console import is_own_line
from cluster.ledger import read_ledger, summarize, valid_records
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray

STEPS, PROMPTS = 6, 32
# Longer generations than the preset's, so that a kill lands inside a generate call.
RUN = ["--set", f"run.steps={STEPS}", "--set", "run.save_every=2", "--set", "run.eval_every=0",
       "--set", "run.plot=false", "--set", "model.max_new_tokens=48", "--set", f"rollout.prompts_per_step={PROMPTS}"]


def _launch(ray_cluster, run_dir: Path, *extra: str, resume: bool = False) -> subprocess.Popen:
    env = {**ray_cluster["env"], "RAY_ADDRESS": ray_cluster["address"]}
    rayrlhf = str(Path(sys.executable).parent / "rayrlhf")
    cmd = [rayrlhf, "train", "--resume", str(run_dir)] if resume else \
        [rayrlhf, "train", "configs/ppo_tiny.yaml", "--run-dir", str(run_dir), *RUN, *extra]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in rows), default=0)


def _alive_actor_pid(class_name: str) -> int:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])
    assert len(actors) == 1, actors
    return int(actors[0].pid)


def _finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _check_exactly_once(run_dir: Path) -> dict:
    summary = summarize(read_ledger(run_dir))
    p = summary["prompts"]
    assert p["issued"] == p["scored"] == STEPS * PROMPTS, p
    assert p["trained"] == STEPS * PROMPTS and p["lost"] == 0 and p["trained_twice"] == 0, p
    # The generators always held the learners' newest weights: policy version k-1 sampled step k.
    rows = [r for r in _rows(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["generate/policy_version"] for r in rows] == list(range(STEPS)), rows
    return summary


def test_a_killed_generator_is_restarted_and_its_prompts_reissued(ray_cluster, tmp_path):
    run_dir = tmp_path / "gen-kill"
    proc = _launch(ray_cluster, run_dir)
    try:
        wait_for(lambda: _steps_logged(run_dir) >= 2 or proc.poll() is not None, timeout=300)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        gen = psutil.Process(_alive_actor_pid("GeneratorWorker"))
        # Kill it inside a generate call, so that prompts are in flight.
        deadline = time.time() + 60
        while time.time() < deadline and "GeneratorWorker.generate" not in " ".join(gen.cmdline()):
            time.sleep(0.005)
        killed_in_generate = "GeneratorWorker.generate" in " ".join(gen.cmdline())
        step_at_kill = _steps_logged(run_dir)
        gen.send_signal(signal.SIGKILL)
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_in_generate and step_at_kill < STEPS
    summary = _check_exactly_once(run_dir)
    assert summary["restarts"] == {"generator": 1}, summary
    assert summary["prompts"]["reissued"] >= 1, summary  # its shard was sent again
    reissued = [r for r in valid_records(read_ledger(run_dir)) if r["event"] == "reissued"]
    assert all(r["step"] > step_at_kill for r in reissued)
    assert "generator 0 died" in out and "restarted in" in out
    # The console: rayrlhf's own lines only (progress, messages); the libraries' output is in train.log.
    lines = [line for line in out.splitlines() if line.strip()]
    assert sum("step " in line and "/6" in line for line in lines) == STEPS
    assert all(is_own_line(line) for line in lines), [line for line in lines if not is_own_line(line)][:10]
    assert not any("Warning" in line or "WARNING" in line for line in lines)
    log = (run_dir / "train.log").read_text()
    assert "Warning" in log or "WARNING" in log  # e.g. Ray's deprecation warnings, kept in the log file
    assert "generator 0 died" in log and "step 6/6" in log


def test_a_killed_learner_is_restarted_from_its_checkpoint_and_replays(ray_cluster, tmp_path):
    run_dir = tmp_path / "learner-kill"
    proc = _launch(ray_cluster, run_dir)
    try:
        wait_for(lambda: _steps_logged(run_dir) >= 3 or proc.poll() is not None, timeout=300)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        os.kill(_alive_actor_pid("RayTrainWorker"), signal.SIGKILL)
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = _check_exactly_once(run_dir)
    assert summary["restarts"] == {"learner": 1}, summary
    restart = next(r for r in read_ledger(run_dir) if r["event"] == "restart")
    # Restored from a checkpoint of this run (every 2 steps) and replayed the steps after it.
    assert "checkpoints/step_" in restart["detail"]["restored"]
    restored_step = int(restart["detail"]["restored"].rsplit("_", 1)[1])
    assert restart["detail"]["replayed"] == list(range(restored_step + 1, restart["step"]))
    assert "learner workers restarted" in out
    rewards = [r["reward/mean"] for r in _rows(run_dir) if r["step"] > 0]
    assert rewards[-1] > rewards[0] + 0.2, rewards  # it kept learning


def test_a_stopped_job_resumes_and_each_prompt_is_trained_once(ray_cluster, tmp_path):
    run_dir = tmp_path / "stop-resume"
    proc = _launch(ray_cluster, run_dir)
    try:
        wait_for(lambda: _steps_logged(run_dir) >= 3 or proc.poll() is not None, timeout=300)
        assert proc.poll() is None
        proc.kill()  # the whole job: its driver, and with it every actor and learner it owns
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped_at = _steps_logged(run_dir)
    first = read_ledger(run_dir)
    trained_before = [r for r in first if r["event"] == "trained"]
    assert trained_before and max(r["step"] for r in trained_before) == stopped_at
    out = _finish(_launch(ray_cluster, run_dir, resume=True))
    assert "resumed from" in out
    records = read_ledger(run_dir)
    resume = [r for r in records if r["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 2  # the checkpoint of step 2 (save_every=2)
    # Step 3 was trained before the stop and again after the resume: the joined ledger voids the
    # first (its update was not in the checkpoint resumed from), so each prompt counts once.
    raw = [r["uid"] for r in records if r["event"] == "trained"]
    assert len(raw) > STEPS * PROMPTS
    _check_exactly_once(run_dir)
    status = subprocess.run([str(Path(sys.executable).parent / "rayrlhf"), "status", str(run_dir)],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"step       {STEPS}/{STEPS} (finished)" in status.stdout
    assert f"{STEPS * PROMPTS} trained" in status.stdout and "0 lost, 0 trained twice" in status.stdout
    assert "resumed 1 time" in status.stdout


def test_roles_that_do_not_fit_the_cluster_fail_at_once(ray_cluster, tmp_path):
    from cluster.config import UserError, load_config
    from cluster.driver import train

    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml",
                      ["cluster.cpus_per_learner=64", f"run.output_dir={tmp_path}", "run.steps=1"])
    t0 = time.time()
    with pytest.raises(UserError) as err:
        train(cfg)
    assert time.time() - t0 < 60
    msg = str(err.value)
    assert "learner 64" in msg and "the cluster has 8 CPUs" in msg and "cluster.cpus_per_learner" in msg, msg
