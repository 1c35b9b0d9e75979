"""Generator.close: an in-process engine shut down on purpose leaves the next engine working.

vLLM keeps one parallel state per process; a new engine reuses it and an engine's shutdown tears it
down. An engine merely dropped shuts down whenever the garbage collector reaches it, under any
engine built since (the suite's engines per test module met this, at random: 'pipeline model
parallel group is not initialized'). Needs no other engine alive in this process: every module's
in-process engine is closed at its module's end.
"""

import gc

import pytest


def test_a_closed_engine_leaves_the_next_engine_working(tiny_model_path, caplog):
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from actors.rollout.generator import Generator, warn_if_engine_open
    from tests.helpers.engines import engine_config

    first = Generator(engine_config(tiny_model_path, 64))
    assert first.generate(["Count: 1 2"], max_new_tokens=4, temperature=0.0).batch_size == 1
    assert model_parallel_is_initialized()
    caplog.clear()
    with caplog.at_level("WARNING", logger="rayrlhf.generator"):
        warn_if_engine_open()  # what building a second engine now would log
    ours = [r.getMessage() for r in caplog.records if r.name == "rayrlhf.generator" and r.levelname == "WARNING"]
    assert len(ours) == 1 and ours[0].startswith("1 vLLM engine(s) of this process still open")
    first.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="rayrlhf.generator"):
        warn_if_engine_open()
    assert not [r for r in caplog.records if r.name == "rayrlhf.generator" and r.levelname == "WARNING"]  # closed: safe
    assert not model_parallel_is_initialized()  # released now, not whenever the engine is collected
    first.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        first.generate(["Count: 1 2"], max_new_tokens=4)

    second = Generator(engine_config(tiny_model_path, 64))
    del first
    gc.unfreeze()  # (vLLM freezes the heap at an engine build and unfreezes it at a shutdown)
    gc.collect()  # a first engine shut down twice would tear the second's parallel state down here
    assert model_parallel_is_initialized()
    greedy = second.generate(["Count: 1 2"], max_new_tokens=4, temperature=0.0)
    assert greedy.batch_size == 1 and greedy.response_lengths().item() >= 1
    second.close()
