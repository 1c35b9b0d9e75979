"""Killing a run's processes from outside while it runs (SIGKILL by PID), for the failure tests:
the run is a `rayrlhf train` subprocess on the shared test cluster. A kill meant to land inside a
call is aimed at a role held there (its fault point, ``cluster/roles/fault_points.py``), so it
lands there however slow the host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from cluster.roles.fault_points import ENV, arm, disarm, held_pid
from tests.conftest import wait_for
from tests.helpers.timeouts import scaled

FAULT_POINTS = os.environ[ENV]  # set by tests/conftest.py for every cluster the suite starts


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
    actors = alive_actors(lambda a: a["ActorClassName"] == class_name and a["JobID"] == jobs[0])
    assert len(actors) == 1, actors
    return int(actors[0]["Pid"])


def alive_actors(which) -> list[dict]:
    """The live actors of this process's cluster that ``which(row)`` picks (rows of Ray's GCS actor
    table: ``Name``, ``ActorClassName``, ``JobID``, ``Pid``, ``ActorID``)."""
    from ray._private.state import state

    return [a for a in state.actor_table(None).values() if a["State"] == "ALIVE" and which(a)]


def _run_actor(proc: subprocess.Popen, class_name: str) -> int | None:
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    try:
        return run_actor_pid(proc, class_name)
    except AssertionError:
        return None


def kill_role(proc: subprocess.Popen, class_name: str, method: str | None, run_dir: Path) -> int:
    """SIGKILLs the run's actor of ``class_name`` and returns its pid: held inside ``method`` at
    that method's fault point (``cluster/roles/fault_points.py``: armed here, the role holds there
    until it is killed), or at once when ``method`` is None. Waits for events only (the actor's
    entry in the GCS, the role's held file), each guarded by a scaled deadline."""
    describe = lambda: run_state(run_dir)  # noqa: E731
    if method is None:
        pid = wait_for(lambda: _run_actor(proc, class_name), timeout=300, describe=describe)
        os.kill(pid, signal.SIGKILL)
        return pid
    name = f"{class_name}.{method}"
    held = arm(FAULT_POINTS, name)
    try:
        pid = wait_for(lambda: _ended(proc) or held_pid(held), timeout=300, describe=describe)
        assert pid != -1, f"the run ended before a call reached {name}: " + proc.communicate()[0][-3000:]
        # The role held there is this run's actor of that class (not a leftover of another run).
        assert pid == run_actor_pid(proc, class_name), (pid, name)
        os.kill(pid, signal.SIGKILL)
    finally:
        disarm(FAULT_POINTS, name)  # whatever happened, no later call is held by this arm
    return pid


def _ended(proc: subprocess.Popen) -> int:
    return -1 if proc.poll() is not None else 0


def kill_during_run(
    proc: subprocess.Popen, run_dir: Path, kills: list, after_kill: Any = None
) -> tuple[list[tuple[int, int]], str]:
    """For each (ready, class_name, method) in turn: waits for ``ready()`` with the run still going,
    then SIGKILLs the run's actor held inside ``method`` (at once when None: ``kill_role``), then
    calls ``after_kill()`` if given. Returns, for each kill, the pid killed and the steps logged
    when it was aimed; and the finished run's output."""
    landed = []
    try:
        for ready, class_name, method in kills:
            wait_for(lambda: ready() or proc.poll() is not None, timeout=300, describe=lambda: run_state(run_dir))
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            step = steps_logged(run_dir)
            landed.append((kill_role(proc, class_name, method, run_dir), step))
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
