"""Named points where a role can be held open from outside, for fault-injection runs: a kill that
must land inside a call (a generator killed with its prompts in flight) is aimed at a role held at
such a point, not timed against it.

Off unless ``RAYRLHF_FAULT_POINTS`` names a folder in the role's environment (set it where the
cluster is started: Ray's workers inherit the raylet's environment). Then a role that passes point
``NAME`` (``"GeneratorWorker.generate"``: the class and the method it is in) while
``<folder>/NAME.arm`` exists claims that arm (one role per arm: it is renamed away), writes its
pid to ``<folder>/NAME.held`` and waits there until ``<folder>/NAME.release`` appears, or until
it is killed, which is the point of holding it. Unset (the default), a point costs one
environment lookup.

The suite's failure tests arm these points (``tests/helpers/kills.py``); an operator can use
them the same way to rehearse a role's death on a staging cluster.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

ENV = "RAYRLHF_FAULT_POINTS"
POLL_S = 0.05  # a held role sleeps: the hold is for a kill that follows within moments


def fault_point(name: str) -> None:
    """Holds the calling role at ``name`` if that point is armed (see the module doc)."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    base = Path(folder) / name
    mine = base.with_name(f"{name}.claimed.{os.getpid()}.{threading.get_ident()}")
    try:
        os.rename(f"{base}.arm", mine)  # atomic: of several roles passing at once, one holds
    except FileNotFoundError:
        return
    publish_pid(Path(f"{base}.held"), via=mine)
    release = Path(f"{base}.release")
    while not release.exists():
        time.sleep(POLL_S)


def publish_pid(path: Path, via: Path | None = None) -> None:
    """Writes this process's pid to ``path`` whole: into ``via`` (a name of this thread's own),
    then renamed, so a reader or a kill between two writes never sees a partial file."""
    via = via or path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
    via.write_text(str(os.getpid()))
    os.replace(via, path)


def arm(folder: str | Path, name: str) -> Path:
    """Arms ``name`` in ``folder`` (its stale held and release files removed first); returns the
    path of the held file to wait for."""
    base = Path(folder) / name
    base.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".held", ".release"):
        Path(f"{base}{suffix}").unlink(missing_ok=True)
    Path(f"{base}.arm").touch()
    return Path(f"{base}.held")


def held_pid(held: Path) -> int | None:
    """The pid a held role wrote, or None while nothing holds there."""
    try:
        return int(held.read_text())
    except (FileNotFoundError, ValueError):
        return None


def disarm(folder: str | Path, name: str) -> None:
    """Removes an arm no role claimed and lets go of a role still held there: what arms a point
    disarms it when it is done, so that no later call is held by a leftover arm."""
    base = Path(folder) / name
    Path(f"{base}.arm").unlink(missing_ok=True)
    Path(f"{base}.held").unlink(missing_ok=True)
    Path(f"{base}.release").touch()
