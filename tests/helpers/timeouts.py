"""The suite's one clock setting. Every deadline a test sets on a call meant to succeed (a wait for
an event, a subprocess, a server's start) is a guard against a hang, not a speed check, and passes
through ``scaled``: ``RAYRLHF_TEST_TIMEOUT_SCALE`` (default 3, generous for a loaded 2-core host
where steps run 3x slower than on a quiet one) multiplies them all. Deadlines that a test exercises
on purpose (a tool or environment meant to hang) are the code's settings, not these."""

from __future__ import annotations

import os


def _scale() -> float:
    raw = os.environ.get("RAYRLHF_TEST_TIMEOUT_SCALE", "3")
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"RAYRLHF_TEST_TIMEOUT_SCALE must be a positive number, not {raw!r}") from None
    if not value > 0:
        raise SystemExit(f"RAYRLHF_TEST_TIMEOUT_SCALE must be a positive number, not {raw!r}")
    return value


SCALE = _scale()


def scaled(seconds: float) -> float:
    """``seconds`` times the suite's timeout scale."""
    return seconds * SCALE


def hold(prefix: str, guard_s: float) -> None:
    """A point held open for a test: writes this process's pid to ``<prefix>.held``, then waits until
    ``<prefix>.release`` exists (at once if it already does), for at most ``scaled(guard_s)``
    (a guard: the test releases the hold or kills the process holding it)."""
    import time
    from pathlib import Path

    from cluster.roles.fault_points import publish_pid

    release = Path(prefix + ".release")
    if release.exists():
        return
    # The holder's pid, for a test that kills it there: many of its threads may reach the hold
    # at once, and the test may kill it between any two of their writes.
    publish_pid(Path(prefix + ".held"))
    deadline = time.monotonic() + scaled(guard_s)
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
