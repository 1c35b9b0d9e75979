"""The generator pool: a batch's prompts go out in work units, each to whichever generator is free.

A batch is cut into units of whole prompt groups (a prompt's samples never span two units, so a
group is released only when all its samples are done). A dispatcher thread in the driver keeps
each live generator busy with exactly one unit: when a unit finishes, that generator gets the
next one. A fast replica therefore takes more units than a slow one, rather than every replica
getting a fixed shard and the batch waiting for the slowest. Each finished unit is handed on at
once (to the scorer, when one is given), so scoring streams behind generation.

Units are seeded by their index in the batch, not by the generator that runs them, so the same
weights and prompts give the same samples whichever replica ran each unit, and the batch comes
back in unit order (what the learners see does not depend on timing).

A generator that dies is taken out of the rotation and its unit goes back to the front of the
queue, for the survivors to take. The pool never restarts generators itself: the caller does
(``failures``/``revive``), from its own thread, where it owns the weights a restarted generator
needs. Each generator actor runs one call at a time, so a weight sync queued on it lands between
two units, never inside one; the version of the weights that produced a unit is in its stats.
(With ``rollout.inflight_updates`` an actor has a second slot for syncs, which land between two
decoding steps of the running unit: its stats then count tokens per version.)
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

# How long the dispatcher waits on running units before it looks at its queue again (seconds).
_POLL_S = 0.2


def unit_sizes(num_prompts: int, num_generators: int, unit_prompts: int) -> list[int]:
    """Prompts per work unit. ``unit_prompts`` 0 picks one unit for a single generator (vLLM's
    batching works best on big calls) and two units per generator otherwise (each replica can
    take more or less than its share)."""
    if unit_prompts <= 0:
        units = 1 if num_generators == 1 else 2 * num_generators
        unit_prompts = -(-num_prompts // units)
    unit_prompts = max(1, unit_prompts)
    full, rest = divmod(num_prompts, unit_prompts)
    return [unit_prompts] * full + ([rest] if rest else [])


@dataclass
class Unit:
    """One generation call: whole prompt groups, run by one generator."""

    # Position in its batch: the unit's seed offset and its place in the batch's output.
    index: int
    rows: list
    group_ids: list[int]
    greedy: bool
    seed: int | None
    # (samples per prompt, temperature) when ``rows`` are plain text prompts (SPIN's own replies);
    # None: task rows, sampled as the rollout config says.
    texts: tuple[int, float] | None = None
    # The generator that ran it (the last one tried), its record and stats refs once done.
    generator: int | None = None
    exp: Any = None
    stats: Any = None
    # The stats dict, fetched by the dispatcher when the unit finished.
    result: dict | None = None
    # What ``on_done`` returned for it (e.g. the scorer's (record, stats) refs).
    handed_on: Any = None
    # The error the generator raised for it (not a death: that is a failure, and the unit runs again).
    error: BaseException | None = None
    # (generator, error) for each try whose generator died.
    failures: list = field(default_factory=list)
    # How many times its generator had been revived when the unit started on it (see ``revive``).
    life: int = 0
    # Unique in the run: where its episodes' turn-boundary snapshots are kept (``EpisodeJournal``).
    key: str = ""

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class Batch:
    """The units of one ``submit``; ``collect`` waits on it."""

    units: list[Unit]
    # Failures already reported to the caller (index into every unit's failure list).
    reported: set = field(default_factory=set)

    @property
    def done(self) -> bool:
        return all(u.done for u in self.units)


class GeneratorPool:
    """Load-based dispatch of work units over generator actors (see the module docstring).

    ``call(generator_index, unit)`` starts a unit on a generator and returns its (record, stats)
    refs; ``on_done(unit)`` (optional) runs in the dispatcher thread when a unit finishes and
    its return value is kept as ``unit.handed_on``."""

    def __init__(
        self, num_generators: int, call: Callable[[int, Unit], tuple], on_done: Callable | None = None
    ) -> None:
        self.num_generators = num_generators
        self._call = call
        self._on_done = on_done
        self._cond = threading.Condition()
        self._queue: deque[Unit] = deque()
        self._running: dict[int, Unit] = {}  # generator -> its unit
        self._down: set[int] = set()
        # Times each generator was revived: a death seen by a unit started in an earlier life was
        # already recovered by the caller (e.g. during a weight sync) and is not a new one.
        self._lives = [0] * num_generators
        self._units_run = [0] * num_generators
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._dispatch, name="rayrlhf-generator-pool", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------
    def submit(self, units: list[Unit]) -> Batch:
        """Queues a batch's units behind those already queued (earlier batches first)."""
        with self._cond:
            self._raise_if_broken()
            self._queue.extend(units)
            self._cond.notify_all()
        return Batch(units)

    def wait(self, batch: Batch) -> list[tuple[int, Unit, BaseException]]:
        """Blocks until the batch is done or a generator died; returns the deaths not yet
        reported as (generator, unit, error): each unit was re-queued, and the generators still
        in ``down()`` need a restart (one revived meanwhile does not). Empty when the batch is
        done. When every generator is down for deaths reported with another batch, returns them
        with no unit and error. Raises the error a generator raised for one of the batch's units."""
        with self._cond:
            while True:
                self._raise_if_broken()
                failed = next((u for u in batch.units if u.error is not None), None)
                if failed is not None:
                    raise failed.error
                new = [
                    (g, u, e)
                    for u in batch.units
                    for k, (g, e) in enumerate(u.failures)
                    if (u.index, k) not in batch.reported
                ]
                if new or batch.done:
                    batch.reported.update((u.index, k) for u in batch.units for k in range(len(u.failures)))
                    return new
                if len(self._down) == self.num_generators:  # all died, reported with another batch
                    return [(g, None, None) for g in sorted(self._down)]
                self._cond.wait(timeout=1.0)

    def down(self) -> set[int]:
        """The generators out of the rotation (died; waiting for ``revive``)."""
        with self._cond:
            return set(self._down)

    def revive(self, generator: int) -> None:
        """Puts a generator that the caller restarted back into the rotation."""
        with self._cond:
            self._down.discard(generator)
            self._lives[generator] += 1
            self._cond.notify_all()

    def running(self) -> dict[int, int]:
        """generator -> index of the unit it is running now."""
        with self._cond:
            return {g: u.index for g, u in self._running.items()}

    def units_run(self) -> list[int]:
        """Units each generator has finished so far (how the load spread)."""
        with self._cond:
            return list(self._units_run)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the generator pool's dispatcher failed: {self._error!r}") from self._error

    # -- the dispatcher thread -----------------------------------------------------------------
    def _dispatch(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                    self._start_units()
                    if not self._running:
                        self._cond.wait(timeout=1.0)
                        continue
                    running = {u.stats: g for g, u in self._running.items()}
                ready, _ = ray.wait(list(running), num_returns=1, timeout=_POLL_S)
                for ref in ready:
                    self._finish(running[ref])
        except BaseException as e:  # surfaced to the caller by its next submit or wait
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _start_units(self) -> None:
        """Gives every free, live generator the next queued unit (under the lock)."""
        for g in range(self.num_generators):
            if not self._queue:
                return
            if g in self._running or g in self._down:
                continue
            unit = self._queue.popleft()
            unit.generator, unit.life = g, self._lives[g]
            unit.exp, unit.stats = self._call(g, unit)
            self._running[g] = unit

    def _finish(self, g: int) -> None:
        unit = self._running[g]
        try:
            result = ray.get(unit.stats)
        except ray.exceptions.RayTaskError as e:  # the generator raised: the caller's to handle
            with self._cond:
                del self._running[g]
                unit.error = e
                self._cond.notify_all()
            return
        except ray.exceptions.RayActorError as e:
            with self._cond:
                del self._running[g]
                if unit.life == self._lives[g]:
                    self._down.add(g)
                # else the caller revived g after this unit started on it: the death it saw is
                # the one the caller already recovered from, and g stays in the rotation.
                unit.failures.append((g, e))
                unit.exp = unit.stats = None
                self._queue.appendleft(unit)  # the survivors (or g once revived) take it next
                self._cond.notify_all()
            return
        handed_on = self._on_done(unit) if self._on_done is not None else None
        with self._cond:
            del self._running[g]
            unit.handed_on = handed_on
            unit.result = {**result, "generator": g}
            self._units_run[g] += 1
            self._cond.notify_all()
