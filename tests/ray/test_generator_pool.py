"""The generator pool's dispatch on real Ray actors (stand-ins that sleep instead of running
vLLM, so the timing is controlled): work goes by load, finished units are handed on while others
still run, a dead replica's unit goes to a survivor, and the batch comes back in unit order.
The pool inside real PPO runs with real vLLM generators: tests/ray/test_async.py and
tests/ray/test_multinode.py (2 generators), tests/ray/test_failures.py (a generator killed)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

from cluster.roles.rollout_pool import GeneratorPool, Unit

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
class _Replica:
    """Answers a unit after ``delay`` seconds, like GeneratorWorker.generate's (record, stats)."""

    def __init__(self, delay: float, die_on_call: int = -1, raise_on_call: int = -1, die_once: str = "") -> None:
        self.delay, self.die_on_call, self.raise_on_call, self.calls = delay, die_on_call, raise_on_call, 0
        # A marker file: the first call of any incarnation dies mid-unit once, when the file
        # ``<die_once>.go`` appears (the test decides when), leaving the marker behind.
        self.die_once = die_once

    def ping(self) -> int:
        return os.getpid()

    def generate(self, rows, group_ids, greedy, seed):
        self.calls += 1
        if self.die_once and not os.path.exists(self.die_once):
            while not os.path.exists(self.die_once + ".go"):
                time.sleep(0.01)
            open(self.die_once, "w").close()
            os._exit(1)
        if self.calls == self.die_on_call:
            os._exit(1)
        if self.calls == self.raise_on_call:
            raise ValueError(f"bad rows {rows}")
        time.sleep(self.delay)
        return {"groups": group_ids, "seed": seed}, {
            "groups": group_ids,
            "seed": seed,
            "policy_version": 0,
            "finished_at": time.time(),
        }


def _units(n: int, per_unit: int = 2) -> list[Unit]:
    return [
        Unit(k, [f"row{k}"] * per_unit, [k * per_unit + j for j in range(per_unit)], False, 100 + k) for k in range(n)
    ]


def _pool(replicas, on_done=None) -> GeneratorPool:
    return GeneratorPool(
        len(replicas),
        lambda g, u: replicas[g].generate.options(num_returns=2).remote(u.rows, u.group_ids, u.greedy, u.seed),
        on_done=on_done,
    )


def test_units_go_to_whichever_replica_is_free_and_come_back_in_unit_order(ray_cluster):
    fast, slow = _Replica.remote(0.05), _Replica.remote(0.6)
    handed_on: list[tuple[int, float]] = []
    pool = _pool([fast, slow], on_done=lambda u: handed_on.append((u.index, time.time())) or u.index)
    try:
        batch = pool.submit(_units(8))
        assert pool.wait(batch) == [] and batch.done
        units = batch.units
        # Load, not fixed shards: the fast replica took most units (fixed halves would give it 4
        # and leave the batch waiting 4 x 0.6 s for the slow one).
        by_gen = pool.units_run()
        assert sum(by_gen) == 8 and by_gen[0] >= 6, by_gen
        # Unit order and unit seeds, whoever ran them; every result names its generator.
        assert [u.result["groups"] for u in units] == [u.group_ids for u in units]
        assert [u.result["seed"] for u in units] == [100 + k for k in range(8)]
        assert {u.result["generator"] for u in units} == {0, 1}
        assert ray.get([u.exp for u in units])[3]["groups"] == [6, 7]
        # Streaming: each unit was handed on when it finished, the first ones before the last finished.
        assert sorted(i for i, _ in handed_on) == list(range(8))
        assert [u.handed_on for u in units] == list(range(8))
        assert min(t for _, t in handed_on) < max(u.result["finished_at"] for u in units)
    finally:
        pool.close()


def test_a_dead_replica_is_reported_once_and_its_unit_taken_by_a_survivor(ray_cluster):
    doomed = _Replica.options(max_restarts=0).remote(0.2, die_on_call=2)
    survivor = _Replica.remote(0.2)
    pool = _pool([doomed, survivor])
    try:
        batch = pool.submit(_units(6))
        died = pool.wait(batch)
        assert len(died) == 1 and died[0][0] == 0 and isinstance(died[0][2], ray.exceptions.RayActorError)
        lost_unit = died[0][1]
        assert pool.down() == {0}
        # Nothing is lost: the survivor runs the dead replica's unit and the rest of the batch.
        assert pool.wait(batch) == [] and batch.done
        assert lost_unit.result["generator"] == 1 and lost_unit.failures[0][0] == 0
        assert [u.result["groups"] for u in batch.units] == [u.group_ids for u in batch.units]
        assert pool.units_run() == [1, 5]
        # A revived slot is used again (here a fresh replica stands in for the restarted one).
        pool.revive(0)
        assert pool.down() == set()
    finally:
        pool.close()


def test_a_death_the_caller_already_recovered_from_is_not_a_new_one(ray_cluster, tmp_path):
    # In async mode a weight sync can find a generator dead and restart it (``revive``) while
    # the pool still has a unit running on the dead process; that unit's failure must re-queue
    # the unit without taking the restarted generator out of the rotation again (it would be
    # restarted, and counted against rollout.max_restarts, twice). The order of events is forced:
    # the pool's dispatcher is held in ``on_done`` (the survivor's first unit) while replica 0
    # dies, Ray restarts it and the caller revives it; only then does the pool see the death.
    marker = str(tmp_path / "died")
    doomed = _Replica.options(max_restarts=1).remote(0.05, die_once=marker)
    survivor = _Replica.remote(0.05)
    entered, release = threading.Event(), threading.Event()

    def hold_first(unit):
        if not entered.is_set():
            entered.set()
            release.wait(timeout=120)
        return unit.index

    pool = _pool([doomed, survivor], on_done=hold_first)
    try:
        batch = pool.submit(_units(4))
        assert entered.wait(timeout=60), "the survivor never finished a unit"
        assert 0 in pool.running()  # replica 0's unit is in flight, the dispatcher held
        open(marker + ".go", "w").close()  # replica 0's process dies now
        _answered_after_restart(doomed, marker)
        pool.revive(0)  # the caller's recovery, before the pool has seen the death
        release.set()
        died = []
        while not batch.done:
            died += pool.wait(batch)
        assert [g for g, _, _ in died] == [0] and isinstance(died[0][2], ray.exceptions.RayActorError)
        assert pool.down() == set()  # nothing left to restart
        assert all(u.result for u in batch.units) and sum(pool.units_run()) == 4
        assert batch.units[died[0][1].index].failures[0][0] == 0
    finally:
        release.set()
        pool.close()


def _answered_after_restart(replica, marker: str, timeout: float = 60) -> None:
    """Waits until ``replica`` died (its marker written) and its restarted process answers."""
    deadline = time.time() + timeout
    while not os.path.exists(marker):
        assert time.time() < deadline, "replica 0 never died"
        time.sleep(0.01)
    while True:
        try:
            ray.get(replica.ping.remote(), timeout=30)
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            assert time.time() < deadline, "replica 0 was not restarted"
            time.sleep(0.05)


def test_an_error_a_replica_raises_reaches_the_caller_and_the_pool_goes_on(ray_cluster):
    pool = _pool([_Replica.remote(0.05, raise_on_call=2)])
    try:
        batch = pool.submit(_units(3))
        with pytest.raises(ValueError, match="bad rows"):
            pool.wait(batch)
        assert pool.down() == set()  # not a death: nothing to restart
        again = pool.submit(_units(2))
        assert pool.wait(again) == [] and all(u.result for u in again.units)
    finally:
        pool.close()
