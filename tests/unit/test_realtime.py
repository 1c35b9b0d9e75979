"""Real-time scheduling of a learner's threads during an update (cluster/roles/realtime.py)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from cluster.roles import realtime
from cluster.roles.realtime import realtime_threads


@pytest.fixture(autouse=True)
def fresh_refusals(monkeypatch):
    monkeypatch.setattr(realtime, "_refused", set())


class Sleeper:
    """A thread that waits until told to stop, so its scheduling policy can be read."""

    def __init__(self):
        self.ready, self.stop = threading.Event(), threading.Event()
        self.tid = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self):
        self.tid = threading.get_native_id()
        self.ready.set()
        self.stop.wait(30)

    def join(self):
        self.stop.set()
        self.thread.join(10)


def _policy(tid: int) -> tuple[int, int]:
    return os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority


@pytest.mark.skipif(not realtime.throttled(), reason="needs the kernel's real-time throttling")
def test_every_thread_is_real_time_inside_the_block_and_ordinary_after(caplog):
    before = Sleeper()  # stands for an OpenMP pool thread started before the update
    me = threading.get_native_id()
    permitted = realtime.permitted()
    assert _policy(me) == (os.SCHED_OTHER, 0)  # the probe put the calling thread back
    try:
        with caplog.at_level(logging.WARNING, "rayrlhf.realtime"):
            with realtime_threads() as applied:
                during = Sleeper()  # a thread started inside the update inherits the policy
                inside = {tid: _policy(tid) for tid in (me, before.tid, during.tid)}
        after = {tid: _policy(tid) for tid in (me, before.tid, during.tid)}
    finally:
        before.join()
        during.join()
    assert applied is permitted
    if permitted:
        assert set(inside.values()) == {(os.SCHED_FIFO, realtime.PRIORITY)}
        assert not caplog.records
    else:  # nothing changed, and the user is told why
        assert set(inside.values()) == {(os.SCHED_OTHER, 0)}
        assert "not permitted" in caplog.text
    assert set(after.values()) == {(os.SCHED_OTHER, 0)}


def test_a_refused_policy_is_undone_everywhere_and_logged_once(monkeypatch, caplog):
    calls: list[tuple[int, int]] = []

    def refuse_the_second_thread(tid, policy, param):
        if policy == os.SCHED_FIFO and len([c for c in calls if c[1] == os.SCHED_FIFO]) == 1:
            raise PermissionError(1, "Operation not permitted")
        calls.append((tid, policy))

    monkeypatch.setattr(realtime, "throttled", lambda: True)
    monkeypatch.setattr(realtime, "_thread_ids", lambda: [11, 12, 13])
    monkeypatch.setattr(os, "sched_setscheduler", refuse_the_second_thread)
    with caplog.at_level(logging.WARNING, "rayrlhf.realtime"):
        for _ in range(2):
            with realtime_threads() as applied:
                assert applied is False
    # Thread 11 was made real-time, then put back when thread 12 refused; 13 was never touched.
    assert calls[:2] == [(11, os.SCHED_FIFO), (11, os.SCHED_OTHER)]
    assert all(tid == 11 for tid, _ in calls)
    assert caplog.text.count("not permitted") == 1  # once per process, not once per update


def test_nothing_changes_when_disabled_or_when_the_kernel_does_not_throttle(monkeypatch, tmp_path, caplog):
    def never(*_):
        raise AssertionError("no scheduling policy may be set")

    monkeypatch.setattr(os, "sched_setscheduler", never)
    with realtime_threads(enabled=False) as applied:
        assert applied is False
    unthrottled = tmp_path / "sched_rt_runtime_us"
    unthrottled.write_text("-1\n")
    monkeypatch.setattr(realtime, "RT_RUNTIME_FILE", unthrottled)
    assert realtime.throttled() is False
    with caplog.at_level(logging.WARNING, "rayrlhf.realtime"):
        with realtime_threads() as applied:
            assert applied is False
    assert "does not throttle" in caplog.text
    unthrottled.write_text("950000\n")
    assert realtime.throttled() is True


def test_the_learner_spec_carries_the_option():
    from cluster.config import Config
    from cluster.roles.learner_spec import learner_spec

    assert learner_spec(Config(), "/m", 0).realtime is False
    on = Config.model_validate({"cluster": {"realtime_learners": True}})
    assert learner_spec(on, "/m", 0).realtime is True
