"""The Tinker service's futures (``serving/tinker/futures.py``): a model's calls run one at a time
in arrival order, a failed call fails only its own future, seq_ids must increase, a poll returns
'pending' rather than hanging, and finished results are kept within a bound."""

import asyncio

import pytest

from serving.tinker.futures import Futures, ModelQueue, UserError


def test_a_models_calls_run_in_arrival_order_and_a_failure_stays_its_own():
    async def scenario():
        queue, futures, log = ModelQueue(), Futures(), []
        release = asyncio.Event()

        def call(name, fail=False, wait=False):
            async def run():
                if wait:
                    await release.wait()
                log.append(name)
                if fail:
                    raise ValueError(f"{name} is malformed")
                return name

            return run

        ids = [
            futures.submit(queue.run(1, call("first", wait=True))),
            futures.submit(queue.run(2, call("second", fail=True))),
            futures.submit(queue.run(3, call("third"))),
        ]
        assert await futures.wait(ids[2], 0.05) == ("pending", None)  # held behind the first
        assert log == []
        release.set()
        results = [await futures.wait(i, 5) for i in ids]
        with pytest.raises(UserError, match="seq_id 3 arrived after 3"):
            queue.run(3, call("again"))
        return log, results

    log, results = asyncio.run(scenario())
    assert log == ["first", "second", "third"]
    assert results == [("done", "first"), ("error", ("second is malformed", "user")), ("done", "third")]


def test_a_server_fault_is_named_and_an_unknown_id_is_the_users():
    async def scenario():
        futures = Futures()

        async def broken():
            raise RuntimeError("the trainer died")

        rid = futures.submit(broken())
        return await futures.wait(rid, 5), await futures.wait("nope", 5)

    fault, unknown = asyncio.run(scenario())
    assert fault == ("error", ("RuntimeError: the trainer died", "server"))
    assert unknown[0] == "error" and unknown[1][1] == "user"


def test_queued_futures_are_bounded_and_finished_ones_kept_within_a_bound():
    async def scenario():
        futures = Futures(max_pending=2, max_kept=3)
        gate = asyncio.Event()

        async def held():
            await gate.wait()
            return "held"

        first = [futures.submit(held()), futures.submit(held())]
        with pytest.raises(UserError, match="2 requests are queued"):
            futures.submit(held())
        gate.set()
        await asyncio.sleep(0)
        await asyncio.gather(*futures.tasks.values())

        async def value(v):
            return v

        ids = []
        for v in range(4):
            ids.append(futures.submit(value(v)))
            await futures.wait(ids[-1], 5)
        return futures, first, ids, await futures.wait(first[0], 5)

    futures, first, ids, forgotten = asyncio.run(scenario())
    # The oldest finished results went first; the newest are still there to be polled again.
    assert list(futures.tasks) == ids and not set(first) & set(futures.tasks)
    assert forgotten[0] == "error" and "unknown request_id" in forgotten[1][0]
