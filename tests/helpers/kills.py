"""Killing a run's processes from outside while it runs (SIGKILL by PID), for the failure tests:
the run is a `rayrlhf train` subprocess on the shared test cluster."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import wait_for
from tests.helpers.timeouts import scaled


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in rows), default=0)


def run_state(run_dir: Path, lines: int = 15) -> str:
    """What a run was doing, for a timeout's message: its steps logged and its log's last lines."""
    log = run_dir / "train.log"
    tail = log.read_text(errors="replace").splitlines()[-lines:] if log.is_file() else ["(no train.log yet)"]
    return f"{steps_logged(run_dir)} steps logged in {run_dir}; train.log ends:\n" + "\n".join(tail)


def run_actor_pid(proc: subprocess.Popen, class_name: str) -> int:
    """The process of the run's own actor of that class (the run's Ray job: its driver is ``proc``).
    Read from the GCS tables of this process's cluster (Ray's own ``ray._private.state``, which
    ``ray.nodes()`` reads too): the state API (``ray.util.state``) needs a dashboard, which the
    shared test cluster does not run."""
    from ray._private.state import state

    jobs = [j["JobID"] for j in state.job_table() if int(j["DriverPid"]) == proc.pid and not j["IsDead"]]
    assert len(jobs) == 1, jobs
    actors = [
        a
        for a in state.actor_table(None).values()
        if a["ActorClassName"] == class_name and a["State"] == "ALIVE" and a["JobID"] == jobs[0]
    ]
    assert len(actors) == 1, actors
    return int(actors[0]["Pid"])


def kill_inside(proc: subprocess.Popen, class_name: str, method: str | None) -> bool:
    """SIGKILLs the run's actor (waiting for it to exist), inside a call of ``method`` if one
    starts within three (scaled) minutes; ``method`` None: at once (True)."""

    def alive() -> int | None:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            return run_actor_pid(proc, class_name)
        except AssertionError:
            return None

    actor = psutil.Process(wait_for(alive, timeout=300))
    if method is None:
        actor.send_signal(signal.SIGKILL)
        return True
    deadline = time.time() + scaled(180)
    while time.time() < deadline and f"{class_name}.{method}" not in " ".join(actor.cmdline()):
        time.sleep(0.002)
    inside = f"{class_name}.{method}" in " ".join(actor.cmdline())
    actor.send_signal(signal.SIGKILL)
    return inside


def kill_during_run(
    proc: subprocess.Popen, run_dir: Path, kills: list, after_kill: Any = None
) -> tuple[list[tuple[bool, int]], str]:
    """For each (ready, class_name, method) in turn: waits for ``ready()`` with the run still going,
    then SIGKILLs the run's actor inside a call of ``method`` (at once when None), then calls
    ``after_kill()`` if given. Returns, for each kill, whether it landed inside such a call and the steps logged
    then; and the finished run's output."""
    landed = []
    try:
        for ready, class_name, method in kills:
            wait_for(lambda: ready() or proc.poll() is not None, timeout=300, describe=lambda: run_state(run_dir))
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            step = steps_logged(run_dir)
            landed.append((kill_inside(proc, class_name, method), step))
            if after_kill is not None:
                after_kill()
        return landed, finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    out, _ = proc.communicate(timeout=scaled(timeout))
    assert proc.returncode == 0, out[-4000:]
    return out
