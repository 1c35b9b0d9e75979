"""Driving one vLLM engine step by step, so that other threads' work lands between two steps.

``EngineLoop.run`` is what ``LLM.generate`` does (enqueue, then step until done), holding the
engine lock for one step at a time. Another thread meanwhile can hand over a call (a weight load:
``between_steps``), which the driving thread runs before its next step, or send requests of its
own (a sync probe), which ride along in the running loop instead of waiting for it to end. A
thread waiting for the lock goes first: the driving loop steps aside for it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Protocol


class EngineLoop:
    def __init__(self, llm: Any) -> None:
        self.llm = llm
        # One engine step, request insertion or weight load at a time.
        self._engine = threading.Lock()
        # Guarded by ``_engine``: whether a thread is driving the engine loop, and the requests of
        # other threads riding along in it (external request id -> their waiter).
        self._driving = False
        self._riders: dict[str, _Riders] = {}
        # Calls other threads handed to the driving thread (run before its next step).
        self._handed: deque[_Handed] = deque()
        # Threads waiting for ``_engine`` (the driving loop steps aside for them: a plain lock
        # would let it take the lock back at once, step after step).
        self._waiting = 0
        self._count = threading.Lock()
        self.closed = False
        # Attach each finished request's MoE routes (``CompletionOutput.routed_experts``), taken
        # from the worker's route capture (``actors/rollout/vllm_ext.py``) as it finishes.
        self.capture_routes = False

    @property
    def generating(self) -> bool:
        """Whether a thread is driving the engine (a request sent now rides along in its loop)."""
        return self._driving

    def between_steps(self, fn: Callable[[], Any]) -> None:
        """Runs ``fn`` under the engine lock: now if no generation runs, else on the driving thread
        before its next step (e.g. a weight load: the engine's repacked weights are best made on
        the thread that runs them); returns once it ran."""
        with self.turn():
            if not self._driving:
                fn()
                return
            handed = _Handed(fn)
            self._handed.append(handed)
        handed.wait()

    def run(self, prompts: list[dict], params) -> list:
        """The finished ``RequestOutput`` of each prompt, in order. Drives the engine step by step
        (what ``LLM.generate`` does), releasing the engine lock between steps so that a weight
        load can land; if another thread is already driving it, rides along in its loop."""
        with self.turn():
            ids = [_external_id(r) for r in self.llm.enqueue(prompts, params, use_tqdm=False)]
            riders = None
            if self._driving:
                riders = _Riders(ids)
                self._riders.update({i: riders for i in ids})
            else:
                self._driving = True
        if riders is not None:
            return riders.wait()
        mine = _Outputs()
        self._drive(mine)
        return [mine.outputs[i] for i in ids]

    def stream(self, feed: "Feed") -> None:
        """Drives the engine while ``feed`` has work: before each step the requests it has ready
        (``feed.ready()``) are enqueued, each finished output goes to ``feed.finished``, and while
        the engine is idle but the feed still expects requests (a multi-turn rollout whose
        trajectories wait for their environments), ``feed.wait`` blocks until one is ready. So
        every trajectory's next turn joins the running batch as soon as it exists (continuous
        batching), never waiting for the slowest trajectory's turn. Loads and probes land between
        steps as in ``run``."""
        while True:
            with self.turn():
                if not self._driving:  # a probe driving its own loop finishes first
                    self._driving = True
                    break
            time.sleep(0.001)
        self._drive(feed)

    def _drive(self, sink: "Feed") -> None:
        """Steps the engine until no request is left (the sink's and any riders') and the sink
        expects no more."""
        keys: dict[str, Any] = {}
        try:
            while True:
                idle = False
                with self._engine:
                    while self._handed:  # weight loads handed over, between two steps
                        self._handed.popleft().run()
                    for key, prompt, params in sink.ready():
                        keys[_external_id(self.llm.enqueue([prompt], params, use_tqdm=False)[0])] = key
                    if not self.llm.llm_engine.has_unfinished_requests():
                        if not sink.expecting():
                            self._driving = False
                            break
                        idle = True
                    else:
                        for out in self.llm.llm_engine.step():
                            if out.finished and self.capture_routes:
                                attach_routes(self.llm, out)
                            if out.finished:
                                riders = self._riders.pop(out.request_id, None)
                                if riders is not None:
                                    riders.finish(out)
                                else:
                                    sink.finished(keys.pop(out.request_id, out.request_id), out)
                if idle:
                    sink.wait(0.05)
                while self._waiting:  # a load or a rider goes first
                    time.sleep(0.0005)
        except BaseException as e:
            with self._engine:
                self._driving = False
                for riders in set(self._riders.values()):
                    riders.fail(e)
                self._riders.clear()
                while self._handed:
                    self._handed.popleft().fail(e)
            raise

    def close(self, shutdown: Callable[[], Any]) -> None:
        """Runs ``shutdown`` (the engine's) between two steps, once (a later close does nothing);
        every later turn is an error."""
        if self.closed:
            return
        with self.turn():
            self.closed = True
            shutdown()

    @contextmanager
    def turn(self):
        """The engine lock, taken between two steps of a running loop."""
        with self._count:
            self._waiting += 1
        try:
            self._engine.acquire()
        finally:
            with self._count:
                self._waiting -= 1
        try:
            if self.closed:
                raise RuntimeError("this vLLM engine was closed (Generator.close); build a new Generator")
            yield
        finally:
            self._engine.release()


def attach_routes(llm: Any, out: Any) -> None:
    """Sets each completion's ``routed_experts`` from the worker's capture (and frees it there).
    vLLM runs the ``n`` samples of a request as child requests ``{index}_{id}``."""
    keys = [out.request_id] if len(out.outputs) == 1 else [f"{c.index}_{out.request_id}" for c in out.outputs]
    routes = llm.collective_rpc("rayrlhf_take_routes", args=(keys,))[0]
    for key, comp in zip(keys, out.outputs):
        comp.routed_experts = routes.get(key)


def _external_id(request_id: str) -> str:
    """The id ``RequestOutput`` reports for a request ``LLM.enqueue`` returned: vLLM appends a
    random suffix to its counter id internally."""
    return request_id.split("-", 1)[0]


class Feed(Protocol):
    """Requests for ``EngineLoop.stream`` that appear while the engine runs."""

    def ready(self) -> list[tuple[Any, dict, Any]]:
        """(key, prompt, sampling params) of each request to enqueue now (called under the engine
        lock: must not block)."""

    def finished(self, key: Any, output: Any) -> None:
        """A request's finished ``RequestOutput`` (on the driving thread: must not block)."""

    def expecting(self) -> bool:
        """Whether more requests may still come."""

    def wait(self, timeout: float) -> None:
        """Blocks up to ``timeout`` seconds for a request to become ready."""


class _Outputs:
    """The plain ``run``'s feed: nothing more comes; the finished outputs by request id."""

    def __init__(self) -> None:
        self.outputs: dict[str, Any] = {}

    def ready(self) -> list:
        return []

    def finished(self, key: Any, output: Any) -> None:
        self.outputs[key] = output

    def expecting(self) -> bool:
        return False

    def wait(self, timeout: float) -> None:
        pass


class _Waiter:
    """What a thread waits on while the driving thread works for it; fails with the loop."""

    what = "the engine loop"

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.done = threading.Event()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def _wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.what} failed: {self.error!r}") from self.error


class _Handed(_Waiter):
    """Work another thread handed to the driving thread (a weight load)."""

    what = "the handed-over weight load"

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # the caller re-raises it
            self.error = e
        self.done.set()

    def wait(self) -> None:
        self._wait()


class _Riders(_Waiter):
    """Requests another thread added to a running engine loop, and their outputs once finished."""

    what = "the engine loop these requests rode in"

    def __init__(self, ids: list[str]) -> None:
        super().__init__()
        self.ids = ids
        self.outputs: dict[str, Any] = {}

    def finish(self, output) -> None:
        self.outputs[output.request_id] = output
        if len(self.outputs) == len(self.ids):
            self.done.set()

    def wait(self) -> list:
        self._wait()
        return [self.outputs[i] for i in self.ids]
