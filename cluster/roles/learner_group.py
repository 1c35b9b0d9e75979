"""Learners as one long-lived Ray Train ``TorchTrainer`` job fed through a channel actor.

Starting a Ray Train worker group costs 12-20 s on a small machine; paying it per step would
dominate a PPO iteration. So ``fit()`` runs once, in a background thread of the driver, and
its training loop lives for the whole run: it takes experience ObjectRefs from the channel,
trains, and answers with metrics and a reference to the packed new weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import ray

from cluster.roles.learner_spec import LearnerSpec, report_gap_s, worker_scaling
from cluster.roles.learner_worker import learner_loop

log = logging.getLogger("rayrlhf.learner")


@ray.remote(num_cpus=0)
class LearnerChannel:
    """Driver -> every rank (one inbox each) and rank 0 -> driver (one outbox)."""

    def __init__(self, world: int) -> None:
        self.inboxes = [asyncio.Queue() for _ in range(world)]
        self.outbox: asyncio.Queue = asyncio.Queue()

    async def put(self, item: dict) -> None:
        for q in self.inboxes:
            await q.put(item)

    async def get(self, rank: int) -> dict:
        return await self.inboxes[rank].get()

    async def report(self, item: dict) -> None:
        await self.outbox.put(item)

    async def result(self) -> dict:
        return await self.outbox.get()


# Ray Train 2.60's switch for its preemption watcher (``ray.train.v2._internal.constants``).
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Environment variables rank 0 reports in its ``ready`` message.


def trainer_class() -> type:
    """Ray Train's ``TorchTrainer``, less the Ray Data callback when the run gives it no datasets
    (the learners take experience from the channel): that callback starts a ``DatasetManager``
    actor for every learner group even with none to manage, about 1.5 s of a core to start per
    run. Falls back to the plain class if a Ray version moves the callback."""
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks import DatasetsCallback
    except ImportError:  # not Ray Train v2 as pinned: its defaults as they are
        return TorchTrainer

    class LearnerTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    return LearnerTrainer


class _Restarted(Exception):
    """The learner workers started again (Ray Train restarted the group after a failure)."""


class LearnerGroup:
    """Driver-side handle: start once, ``learn(step, exp_refs)`` per iteration, ``stop()``.

    Surviving a lost learner: Ray Train restarts the worker group (``FailureConfig``) and runs the
    worker function again from the top. The group then restores the last checkpoint this run
    wrote (or the state it started from), replays the training items sent since (their
    experience is still in the object store) without weight syncs, and sends the interrupted
    item again: the learners end in the state an uninterrupted run would have reached, and every
    batch is in the weights once."""

    def __init__(self, spec: LearnerSpec, storage_dir: Path) -> None:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig

        self.spec = spec
        self.max_failures = max_failures = spec.max_failures
        # Ray Train's preemption watcher (an extra actor per worker group, polling every node every
        # 5 s) tells workers that a node is about to go; this loop does not act on that (a lost
        # worker restarts the group from the last checkpoint either way). The driver's value
        # reaches Train's controller; a user's own setting wins.
        os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
        self.channel = LearnerChannel.remote(spec.num_learners)
        workers = worker_scaling(spec)
        self.trainer = trainer_class()(
            learner_loop,
            train_loop_config={"spec": spec, "channel": self.channel},
            scaling_config=ScalingConfig(**workers["scaling"]),
            torch_config=TorchConfig(backend=workers["backend"]),
            # A fresh name per start: Ray Train would otherwise treat a resumed run's learners as a
            # restart of the old Train run. The run's own checkpoints are what a resume reads.
            run_config=RunConfig(
                name=f"learner-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
                storage_path=str(Path(storage_dir).resolve()),
                failure_config=FailureConfig(max_failures=max_failures),
                worker_runtime_env={"env_vars": workers["env_vars"]},
            ),
        )
        self.error: BaseException | None = None
        self.epoch = 0
        # What a restarted group restores (None: the state it builds from) and the training items
        # sent after it, replayed in order.
        self.checkpoint: str | None = spec.resume_from
        self.history: list[dict] = []
        self.restarts = 0
        self._ready: dict | None = None  # rank 0's ready report, once received
        self._last_report = 0.0  # when the last step that reported to Ray Train replied
        # (step the driver was at, items replayed) per restart, for the run's ledger and log.
        self.restart_log: list[dict] = []
        self.thread = threading.Thread(target=self._fit, name="rayrlhf-learner", daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as e:  # kept for the driver, which re-raises it with context
            self.error = e

    def _next(self, deadline: float) -> dict:
        ref = self.channel.result.remote()
        while True:
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                return ray.get(ref)
            if not self.thread.is_alive():
                raise RuntimeError(f"learner group stopped: {self.error!r}")
            if time.time() > deadline:
                raise TimeoutError(f"no answer from the learners after {deadline - self._t_wait:.0f}s")

    def _reply(self, timeout_s: float) -> dict:
        """The current epoch's next reply; a new ``ready`` means the group restarted."""
        self._t_wait = time.time()
        deadline = self._t_wait + timeout_s
        while True:
            item = self._next(deadline)
            if item.get("ready"):
                raise _Restarted()
            if item.get("epoch") != self.epoch:
                continue  # from before a restart
            if "error" in item:
                if self.restarts < self.max_failures:
                    log.warning(
                        "learner failed at step %s (%s); waiting for Ray Train to restart it",
                        item.get("step"),
                        item["error"],
                    )
                    continue
                raise RuntimeError(f"learner failed at step {item.get('step')}: {item['error']}")
            return item

    def _begin(self, restore: str | None, timeout_s: float = 600) -> dict:
        self.epoch += 1
        self.channel.put.remote({"begin": self.epoch, "restore": restore})
        return self._reply(timeout_s)

    def _send(self, item: dict, timeout_s: float) -> dict:
        self.channel.put.remote({**item, "epoch": self.epoch})
        return self._reply(timeout_s)

    def _call(self, item: dict, timeout_s: float, replayable: bool = False) -> dict:
        """Sends one item and returns its reply, recovering from any number of restarts (up to
        ``max_failures``) on the way. ``replayable``: a training item, replayed after a restart."""
        while True:
            try:
                reply = self._send(item, timeout_s)
                break
            except _Restarted:
                self._recover(item.get("step"), timeout_s)
        if replayable:
            self.history.append(item)
        if reply.get("saved"):
            self.checkpoint, self.history = reply["saved"], []
        return reply

    def _recover(self, step: Any, timeout_s: float) -> None:
        """After a restart: restore, then replay the training items since the last checkpoint."""
        self.restarts += 1
        if self.restarts > self.max_failures:
            raise RuntimeError(
                f"the learner workers restarted {self.restarts} times (cluster.learner_max_failures="
                f"{self.max_failures})"
            )
        print(
            f"[rayrlhf] learner workers restarted at step {step} (restart {self.restarts} of at most "
            f"{self.max_failures}): restoring {self.checkpoint or 'the starting weights'} and replaying "
            f"{len(self.history)} step(s) since",
            flush=True,
        )
        try:
            restore = self.checkpoint if self.checkpoint != self.spec.resume_from else None
            self._begin(restore)
            for past in self.history:
                self._send({**past, "sync": False, "save_dir": None, "report": False}, timeout_s)
        except _Restarted:  # it failed again while recovering: start over
            return self._recover(step, timeout_s)
        self.restart_log.append(
            {"step": step, "replayed": [p.get("step") for p in self.history], "restored": self.checkpoint}
        )

    def wait_ready(self, timeout_s: float = 600) -> dict:
        """Rank 0's ready report (``nodes``: every rank's Ray node); a second call returns it again."""
        if self._ready is not None:
            return self._ready
        while True:
            info = self._next(time.time() + timeout_s)
            if info.get("ready"):
                break
        begun = self._begin(None, timeout_s)
        self._ready = {**info, "version": begun["version"]}
        return self._ready

    def learn(
        self, step: int, exp_refs: list, save_dir: str | None = None, sync: bool = True, timeout_s: float = 3600
    ) -> dict:
        """One update; ``sync=False`` skips packing weights for generators (offline recipes)."""
        # The worker reports right after its reply, so the time since the last reporting reply is
        # a lower bound of the gap between the two reports.
        report = time.time() - self._last_report >= report_gap_s()
        reply = self._call(
            {"step": step, "exp_refs": list(exp_refs), "save_dir": save_dir, "sync": sync, "report": report},
            timeout_s,
            replayable=True,
        )
        if report:
            self._last_report = time.time()
        return reply

    def save(self, step: int, save_dir: str, timeout_s: float = 600) -> dict:
        """Writes a checkpoint of the learners' current state (no update)."""
        return self._call({"step": step, "save_dir": save_dir, "save_only": True}, timeout_s)

    def evaluate(self, step: int, exp_refs: list, timeout_s: float = 3600) -> dict[str, float]:
        """The learners' held-out metrics on a batch (``Learner.evaluate``), no update."""
        return self._call({"step": step, "exp_refs": list(exp_refs), "evaluate": True}, timeout_s)["metrics"]

    def weights_digest(self, timeout_s: float = 600) -> dict:
        """``rank_spread`` (the largest difference between two ranks' trainable weights) and
        ``trainable`` (rank 0's, one flat vector, by reference)."""
        return self._call({"digest": True}, timeout_s)

    def weights_group(self, op: str, timeout_s: float = 600, **kw: Any) -> dict:
        """The collective transport's learner side (``_weights_group``): open, join, broadcast."""
        return self._call({"weights_group": op, **kw}, timeout_s)

    def current_weights(self, timeout_s: float = 600) -> dict:
        """The learners' current weights, packed (for a generator that restarted): ``{"weights": [ref], "version"}``."""
        return self._call({"weights_only": True}, timeout_s)

    def stop(self, timeout_s: float = 60) -> None:
        try:
            ray.get(self.channel.put.remote({"stop": True}), timeout=10)
        except Exception:  # the channel may already be gone after a failure
            pass
        self.thread.join(timeout=timeout_s)
