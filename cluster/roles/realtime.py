"""Real-time scheduling of a process's threads for the length of a block (``cluster.realtime_learners``).

Why: on a small CPU node a learner's update runs one OpenMP thread per core, and every matrix
multiply waits for the slower of them. Every Ray worker process on the node wakes its main thread
every 10 ms (Ray's signal check), idle or not, and a run has about ten of them (generator, scorer,
learner channel, Ray Train's controller and helpers). Each wake-up that lands on a learner thread
stalls the whole update: measured on 2 cores, the same real GRPO batches took 1.12-1.20x as long in a
Ray Train worker as in a plain process, and from no gain to 0.83x the update's time (varying by
hour) with the learner's threads under ``SCHED_FIFO`` (docs/benchmarks.md). A ``SCHED_FIFO`` thread is not preempted by ordinary
(``SCHED_OTHER``) threads, so the wake-ups wait until the update's threads sleep.

Safety: the kernel's real-time throttling (``kernel.sched_rt_runtime_us``, 95% of each second by
default) keeps the remaining share for everything else; with throttling off (-1) nothing is
changed. The policy applies only inside the block (an update), never while the process idles.
Setting it needs ``CAP_SYS_NICE`` or an ``RLIMIT_RTPRIO`` of at least the priority; without either,
nothing is changed and the caller is told so (one log line per process).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

log = logging.getLogger("rayrlhf.realtime")

RT_RUNTIME_FILE = Path("/proc/sys/kernel/sched_rt_runtime_us")
# The lowest real-time priority: above every ordinary thread, below the kernel's own RT threads.
PRIORITY = 1

_refused: set[str] = set()  # reasons already logged in this process


def throttled() -> bool:
    """Whether the kernel caps real-time threads' share of each period (else they could starve the
    node). Unknown (no procfs entry, not Linux): treated as not throttled."""
    try:
        return int(RT_RUNTIME_FILE.read_text().strip()) >= 0
    except (OSError, ValueError):
        return False


def permitted(priority: int = PRIORITY) -> bool:
    """Whether this process may run threads under ``SCHED_FIFO`` at ``priority`` (root,
    ``CAP_SYS_NICE`` or ``RLIMIT_RTPRIO``). Probed on the calling thread, whose policy is put back."""
    if not hasattr(os, "sched_setscheduler"):
        return False
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except PermissionError:
        return False
    os.sched_setscheduler(0, policy, param)
    return True


def _thread_ids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def _set_policy(tids: list[int], policy: int, priority: int) -> list[int]:
    """Sets ``policy`` on each thread that still exists; returns those it was set on. Raises
    PermissionError (after undoing its changes) when the process may not set it."""
    done = []
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(priority))
            done.append(tid)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            _set_policy(done, os.SCHED_OTHER, 0)  # lowering a policy is always permitted
            raise
    return done


def _refuse(reason: str) -> None:
    if reason not in _refused:
        _refused.add(reason)
        log.warning("cluster.realtime_learners: left at ordinary scheduling (%s)", reason)


@contextmanager
def realtime_threads(enabled: bool = True, priority: int = PRIORITY) -> Iterator[bool]:
    """Every thread of this process runs ``SCHED_FIFO`` at ``priority`` inside the block, and
    ``SCHED_OTHER`` again after it (threads started inside the block too). Yields whether the
    policy was applied: False when not ``enabled``, not permitted, not supported, or when the
    kernel does not throttle real-time threads."""
    if not enabled:
        yield False
        return
    if not hasattr(os, "sched_setscheduler") or not Path("/proc/self/task").is_dir():
        _refuse("this platform has no per-thread scheduling policy")
        yield False
        return
    if not throttled():
        _refuse(f"the kernel does not throttle real-time threads ({RT_RUNTIME_FILE} is not >= 0)")
        yield False
        return
    try:
        applied = _set_policy(_thread_ids(), os.SCHED_FIFO, priority)
    except PermissionError:
        _refuse("not permitted: needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at least 1")
        applied = []
    try:
        yield bool(applied)
    finally:
        if applied:
            # Threads made inside the block inherited the policy: reset every thread of the process.
            _set_policy(_thread_ids(), os.SCHED_OTHER, 0)
