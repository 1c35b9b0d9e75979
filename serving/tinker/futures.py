"""The Tinker API's futures: every training or sampling call answers at once with a request id,
and ``retrieve_future`` long-polls for the result (the SDK re-polls a ``try_again`` answer
immediately, so the wait happens here, not in the client).

A model's calls run one at a time in the order they arrived (``ModelQueue``): the SDK sends a
training client's next call only once the previous one has its id, so arrival order is its
``seq_id`` order, which is checked. A failed call fails its own future and never the next one.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Awaitable, Callable


class UserError(ValueError):
    """A request's own fault (the API's error category ``user``); anything else is ``server``."""


class Futures:
    """Request id to task. Finished results are kept for re-polls (the SDK polls again after a
    dropped connection) up to ``max_kept``, oldest dropped first; a dropped id answers 'unknown'."""

    def __init__(self, max_pending: int = 256, max_kept: int = 4096) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self.max_pending, self.max_kept = max_pending, max_kept

    def _forget_oldest_done(self) -> None:
        done = [rid for rid, t in self.tasks.items() if t.done()]  # dicts keep insertion order
        for rid in done[: max(0, len(self.tasks) - self.max_kept)]:
            del self.tasks[rid]

    def pending(self) -> int:
        return sum(1 for t in self.tasks.values() if not t.done())

    def submit(self, work: Awaitable[Any]) -> str:
        if self.pending() >= self.max_pending:
            close = getattr(work, "close", None)
            if close:
                close()
            raise UserError(f"{self.max_pending} requests are queued already; retry once some have completed")
        self._forget_oldest_done()
        request_id = uuid.uuid4().hex
        self.tasks[request_id] = asyncio.ensure_future(work)
        return request_id

    async def wait(self, request_id: str, poll_s: float) -> tuple[str, Any]:
        """('pending', None) after ``poll_s``, ('done', result) or ('error', (message, category))."""
        task = self.tasks.get(request_id)
        if task is None:
            return "error", (f"unknown request_id {request_id!r}", "user")
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if not done:
            return "pending", None
        error = task.exception()
        if error is None:
            return "done", task.result()
        category = "user" if isinstance(error, ValueError) else "server"
        return "error", (f"{type(error).__name__}: {error}" if category == "server" else str(error), category)


class ModelQueue:
    """One model's calls, one at a time in arrival order, with their ``seq_id`` s increasing."""

    def __init__(self) -> None:
        self.tail: asyncio.Future | None = None
        self.last_seq = -1

    def run(self, seq_id: int | None, call: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
        if seq_id is not None:
            if seq_id <= self.last_seq:
                raise UserError(f"seq_id {seq_id} arrived after {self.last_seq}; a model's calls are ordered")
            self.last_seq = seq_id
        before = self.tail

        async def in_turn() -> Any:
            if before is not None:
                await asyncio.wait({before})  # its failure is its own future's
            return await call()

        task = asyncio.ensure_future(in_turn())
        self.tail = task
        return task
