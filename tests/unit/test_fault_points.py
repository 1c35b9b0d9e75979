"""A role's fault point holds it only while armed, one role per arm, until released or killed
(cluster/roles/fault_points.py): what the failure tests aim their kills at."""

from __future__ import annotations

import os
import threading

from cluster.roles.fault_points import ENV, arm, disarm, fault_point, held_pid
from tests.conftest import wait_for


def test_an_unset_or_unarmed_point_returns_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    arm(tmp_path, "Role.method")
    fault_point("Role.method")  # no folder configured: the arm is not even looked at
    monkeypatch.setenv(ENV, str(tmp_path))
    fault_point("Role.other")  # configured, but this point is not armed
    assert (tmp_path / "Role.method.arm").exists() and not (tmp_path / "Role.method.held").exists()


def test_an_armed_point_holds_one_caller_until_released(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    held = arm(tmp_path, "Role.method")
    first = threading.Thread(target=fault_point, args=("Role.method",), daemon=True)
    first.start()
    assert wait_for(lambda: held_pid(held), timeout=30) == os.getpid()
    assert not (tmp_path / "Role.method.arm").exists()  # claimed: the next caller passes
    fault_point("Role.method")
    assert first.is_alive()  # still held: nothing released it
    disarm(tmp_path, "Role.method")
    first.join(timeout=30)
    assert not first.is_alive() and held_pid(held) is None


def test_arming_again_clears_the_last_holds_files(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    disarm(tmp_path, "Role.method")  # a release left from an earlier hold
    held = arm(tmp_path, "Role.method")
    caller = threading.Thread(target=fault_point, args=("Role.method",), daemon=True)
    caller.start()
    wait_for(lambda: held_pid(held), timeout=30)
    assert caller.is_alive()  # the old release did not let it through
    disarm(tmp_path, "Role.method")
    caller.join(timeout=30)
    assert not caller.is_alive()
