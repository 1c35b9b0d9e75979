"""A stateful OpenEnv environment built with ``openenv-core``'s own classes, and its server.

``ThreeTurns``: the model replies three times; after the first and second replies it hears
"Turn 2." / "Turn 3."; after the third the episode ends with the digit density of the FIRST
reply as its one reward (credit crosses two observations, as in ``environments.py``'s
``DigitsAcrossTurns``). Its state lives in the instance, as in every OpenEnv environment: an
instance that was never reset answers its first step as the issue's held-out environment did,
ending at once with reward 0, so a client that lost the session would be seen.

Test hooks, by environment variable of the server process (a path prefix each):
- ``OPENENV_TEST_GATHER=<n>:<prefix>``: the first ``n`` resets wait until ``n`` sessions are open at
  once (then ``<prefix>.gathered`` holds the peak), so a client that cannot hold ``n`` at once
  never gets past them.
- ``OPENENV_TEST_HOLD=<prefix>:<first>:<count>``: of the episodes whose reset is the server's
  ``first``-th to ``first + count - 1``-th, the odd-numbered ones wait at their second step (for
  ever: the test kills the server there); once all of them wait and all the even-numbered ones
  have ended, ``<prefix>.held`` is written.

Serve it with ``python -m tests.helpers.openenv_envs PORT [MAX_SESSIONS]``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from actors.rewards.functions import digit_density

TURNS = 3


class TurnAction(Action):
    message: str


class TurnObservation(Observation):
    prompt: str = ""


class _Gather:
    """The first ``n`` resets meet here (see the module docstring)."""

    def __init__(self) -> None:
        n, _, prefix = os.environ.get("OPENENV_TEST_GATHER", "0:").partition(":")
        self.n, self.prefix = int(n), prefix
        self.cv = threading.Condition()
        self.open = self.peak = self.arrived = 0

    def opened(self, delta: int) -> None:
        with self.cv:
            self.open += delta
            self.peak = max(self.peak, self.open)
            self.cv.notify_all()

    def meet(self) -> None:
        with self.cv:
            if self.arrived >= self.n:
                return
            self.arrived += 1
            self.cv.wait_for(lambda: self.open >= self.n, timeout=3600)
            if self.arrived == self.n:
                Path(self.prefix + ".gathered").write_text(str(self.peak))


GATHER = _Gather()


class _Hold:
    """The episodes of a range of resets that wait at their second step (see the docstring)."""

    def __init__(self) -> None:
        prefix, first, count = (os.environ.get("OPENENV_TEST_HOLD", "") + "::").split(":")[:3]
        self.prefix, self.first, self.count = prefix, int(first or 0), int(count or 0)
        self.lock = threading.Lock()
        self.resets = self.waiting = self.ended = 0

    def number(self) -> int:
        with self.lock:
            self.resets += 1
            return self.resets

    def held(self, number: int) -> bool:
        return bool(self.prefix) and self.first <= number < self.first + self.count and number % 2 == 1

    def mark(self, number: int, waiting: bool) -> None:
        """One more held episode waiting, or one more of the others ended."""
        if not (self.prefix and self.first <= number < self.first + self.count):
            return
        with self.lock:
            self.waiting += waiting
            self.ended += not waiting
            odd = len([k for k in range(self.first, self.first + self.count) if k % 2 == 1])
            if self.waiting == odd and self.ended == self.count - odd:
                Path(self.prefix + ".held").touch()


HOLD = _Hold()


class ThreeTurns(Environment[TurnAction, TurnObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.first: str | None = None
        self.number = 0
        GATHER.opened(+1)
        self._closed = False

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        prompt: str = "",
        answer: str = "",
        **kwargs: Any,
    ) -> TurnObservation:
        GATHER.meet()
        self._state = State(episode_id=episode_id, step_count=0)
        self.first, self.number = "", HOLD.number()
        return TurnObservation(prompt=prompt or "Write some numbers.", done=False, reward=None)

    def step(self, action: TurnAction, timeout_s: Optional[float] = None, **kwargs: Any) -> TurnObservation:
        if self.first is None:  # never reset: what a stateless route would give
            return TurnObservation(prompt="", done=True, reward=0.0)
        self._state.step_count += 1
        n = self._state.step_count
        if n == 1:
            self.first = action.message or " "
        if n == 2 and HOLD.held(self.number):
            HOLD.mark(self.number, waiting=True)
            while True:  # until the test kills this server
                time.sleep(0.05)
        if n < TURNS:
            return TurnObservation(prompt=f"Turn {n + 1}.", done=False, reward=0.0)
        HOLD.mark(self.number, waiting=False)
        return TurnObservation(prompt="", done=True, reward=digit_density([""], [self.first])[0])

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            GATHER.opened(-1)


def app(max_sessions: int = 64):
    from openenv.core.env_server.http_server import create_app

    return create_app(ThreeTurns, TurnAction, TurnObservation, max_concurrent_envs=max_sessions)


if __name__ == "__main__":
    import uvicorn

    port = int(sys.argv[1])
    uvicorn.run(app(int(sys.argv[2]) if len(sys.argv) > 2 else 64), host="127.0.0.1", port=port, log_level="warning")


def start_server(port: int, max_sessions: int = 64, env: dict | None = None):
    """The environment's server in a process of its own (the tests kill it), once it answers
    ``GET /health``; raises if the process ends first."""
    import subprocess

    import requests

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.openenv_envs", str(port), str(max_sessions)],
        cwd=root,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(root)},
    )
    while proc.poll() is None:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).ok:
                return proc
        except requests.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError(f"the OpenEnv test server exited with {proc.returncode} before it answered")
