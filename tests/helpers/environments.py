"""Environments for tests, named in configs as ``tests.helpers.environments:<factory>``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from actors.agents.environments import Step
from actors.rewards.functions import digit_density
from tests.helpers.timeouts import hold


class DigitsAcrossTurns:
    """Two turns: the model replies, hears "Again.", replies again; the episode's one reward,
    given after the second reply, is the digit density of the FIRST reply. Credit has to cross
    the observation to reach the tokens that earned it."""

    def __init__(self, observation: str = "Again.", scored_turn: int = 1, hold: str = "", log: str = "") -> None:
        self.observation, self.first, self.scored_turn, self.hold = observation, "", scored_turn, hold
        self.log, self.prompt = log, ""

    def reset(self, row: dict) -> str:
        self.first, self.prompt = "", row["prompt"]
        return row["prompt"]

    def step(self, action: str) -> Step:
        if not self.first:
            self.first = action or " "
            return Step(self.observation, 0.0, False, {})
        self._held()
        reward = digit_density([""], [self.first if self.scored_turn == 1 else action])[0]
        if self.log:  # the environment's own record of each episode's reward, for outcome checks
            with open(self.log, "a") as f:  # one short line per write: appends do not interleave
                f.write(json.dumps({"prompt": self.prompt, "first": self.first, "reward": reward}) + "\n")
        return Step(None, reward, True, {})

    def _held(self) -> None:
        """With ``hold`` (a path prefix), once ``<hold>.arm`` exists: the second reply's step
        waits, having touched ``<hold>.held``, until ``<hold>.release`` exists — a moment at which
        a test knows episodes are between their turns. Once released it never waits again."""
        if self.hold and Path(self.hold + ".arm").exists():
            hold(self.hold, 120)


class Unreliable:
    """Misbehaves by the row's answer digit: 1 raises in reset, 2 raises in step, 3 hangs in step,
    4 returns a NaN reward, 5 returns garbage; any other digit ends well after one turn."""

    def __init__(self, hang_s: float = 30.0) -> None:
        self.hang_s, self.mode = hang_s, 0

    def reset(self, row: dict) -> str:
        self.mode = int(str(row["answer"])[-1])
        if self.mode == 1:
            raise RuntimeError("reset failed")
        return row["prompt"]

    def step(self, action: str):
        if self.mode == 2:
            raise RuntimeError("step failed")
        if self.mode == 3:
            time.sleep(self.hang_s)
        if self.mode == 4:
            return Step(None, math.nan, True, {})
        if self.mode == 5:
            return "garbage"
        return Step(None, 1.0, True, {})
