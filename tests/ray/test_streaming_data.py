"""Prompts streamed with Ray Data on the shared cluster: a source of many blocks is read as it is
drawn (not loaded: a shard rewritten mid-run is drawn as rewritten), each epoch is a seeded reshuffle of every usable row, broken rows are counted,
and a sampler reopened at any position continues the stream exactly (what a resumed run does)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.data.tasks import FileKeys
from cluster.data.streaming import StreamingSampler, streaming_sets

pytestmark = pytest.mark.ray


def _parquet_folder(tmp_path, files=6, rows=20):
    folder = tmp_path / "big"
    folder.mkdir()
    for f in range(files):
        pq.write_table(
            pa.Table.from_pylist([{"prompt": f"q{f}-{i}", "answer": str(i)} for i in range(rows)]),
            folder / f"part-{f:03d}.parquet",
            row_group_size=5,
        )
    return folder


def _draw(sampler, steps, positions=None):
    out = []
    for _ in range(steps):
        out.append([sampler.source.rows[i]["prompt"] for i in sampler.next()])
        if positions is not None:
            positions.append(sampler.consumed)
    return out


def _hold_every_free_cpu(rounds=20):
    """Placement groups holding every CPU the shared cluster has free. An earlier module's actor
    may still be releasing its CPU when the first group is made, so each round claims what has
    come free since, once the cluster's resource view has caught up with the last group."""
    import time

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    groups = []
    for _ in range(rounds):
        before = ray.available_resources().get("CPU", 0)
        free = int(before)
        if free < 1:
            time.sleep(1.0)  # a CPU released just now shows in the next view
            if ray.available_resources().get("CPU", 0) < 1:
                break
            continue
        group = placement_group([{"CPU": 1}] * free)
        if not ray.wait([group.ready()], timeout=60)[0]:
            remove_placement_group(group)  # the view counted CPUs something else took meanwhile
            continue
        groups.append(group)
        for _ in range(100):  # the view follows a ready group a moment later
            if ray.available_resources().get("CPU", 0) <= before - free:
                break
            time.sleep(0.1)
    return groups


def test_a_stream_is_reshuffled_each_epoch_and_resumes_at_the_exact_row(ray_cluster, tmp_path):
    folder = _parquet_folder(tmp_path)
    train, held = streaming_sets(str(folder), FileKeys(), "", 0, 5, None, 8)
    assert [r["prompt"] for r in held.rows] == [f"q0-{i}" for i in range(5)]  # the first file's first rows
    sampler = StreamingSampler(train, 8)
    positions = [0]
    first = _draw(sampler, 1, positions)
    rest = _draw(sampler, 15, positions)  # 16 draws x 8 = 128 rows: the first epoch (115 usable) and the next's start
    stream = [p for d in first + rest for p in d]
    epoch0 = stream[:115]
    assert sorted(epoch0) == sorted(f"q{f}-{i}" for f in range(6) for i in range(20) if not (f == 0 and i < 5))
    assert epoch0[:20] != sorted(epoch0[:20])  # shuffled, not the file order
    assert stream[115:128] != epoch0[:13]  # the next epoch is another order
    assert sampler.consumed == 128 + 5  # raw rows, the held-out ones included
    # Reopened at a position mid-epoch and across the epoch boundary, the stream continues exactly.
    for at_draw in (5, 14):
        again = StreamingSampler(train, 8, consumed=positions[at_draw])
        assert _draw(again, 2) == (first + rest)[at_draw : at_draw + 2], at_draw


def test_the_files_are_read_as_drawn_so_a_shard_rewritten_mid_run_is_drawn_as_rewritten(ray_cluster, tmp_path):
    """Read as drawn, not loaded: the rows each epoch draws come from the files as they are when
    that epoch reads them. A shard rewritten after the first epoch is drawn (same row count, new
    prompts) gives the second epoch its new rows and none of its old ones; a source held in
    memory would draw the old ones again. (Within an epoch Ray Data reads ahead of the draws as
    far as its memory budget lets it, so what a shard holds mid-epoch is not checked.)"""
    folder = _parquet_folder(tmp_path, files=4, rows=10)
    train, _ = streaming_sets(str(folder), FileKeys(), "", 0, 0, None, 4)
    sampler = StreamingSampler(train, 8)
    epoch0 = [p for d in _draw(sampler, 5) for p in d]  # 40 rows: the whole first epoch
    assert sorted(epoch0) == sorted(f"q{f}-{i}" for f in range(4) for i in range(10))
    pq.write_table(
        pa.Table.from_pylist([{"prompt": f"new2-{i}", "answer": str(i)} for i in range(10)]),
        folder / "part-002.parquet",
    )
    epoch1 = [p for d in _draw(sampler, 5) for p in d]
    want = sorted(f"q{f}-{i}" for f in (0, 1, 3) for i in range(10)) + [f"new2-{i}" for i in range(10)]
    assert sorted(epoch1) == sorted(want), epoch1


def test_broken_jsonl_lines_are_counted_as_they_stream(ray_cluster, tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"input": f"p{i}", "label": str(i)}) for i in range(6)] + [
        "{broken",
        json.dumps([1]),
        json.dumps({"input": ""}),
    ]
    path.write_text("\n".join(lines) + "\n")
    train, _ = streaming_sets(str(path), FileKeys("input", "label"), "", 1, 0, None, 4)
    sampler = StreamingSampler(train, 6)
    got = _draw(sampler, 1)[0]
    assert sorted(got) == [f"p{i}" for i in range(6)]
    assert train.skipped == {"malformed_row": 2, "empty_or_malformed_prompt": 1}
    assert all(train.rows[i]["meta"]["data_source"] == "p" for i in train.rows)


def test_the_stream_reads_while_the_runs_roles_hold_every_cpu_of_the_cluster(ray_cluster, tmp_path):
    """A local ``rayrlhf train`` starts its cluster with the CPUs its roles claim. Ray Data's own
    file readers list the files in a task that asks for a CPU, which would then never start: the
    stream claims none."""
    import threading

    import ray
    from ray.util.placement_group import remove_placement_group

    folder = _parquet_folder(tmp_path, files=3, rows=4)
    held = _hold_every_free_cpu()
    try:
        assert ray.available_resources().get("CPU", 0) < 1
        train, _ = streaming_sets(str(folder), FileKeys(), "", 0, 0, None, 2)
        out = {}
        reader = threading.Thread(target=lambda: out.update(draw=_draw(StreamingSampler(train, 12), 1)[0]), daemon=True)
        reader.start()
        reader.join(timeout=300)  # a guard against the hang, not a speed check: it reads in seconds
        assert sorted(out.get("draw", [])) == sorted(f"q{f}-{i}" for f in range(3) for i in range(4))
    finally:
        for group in held:
            remove_placement_group(group)
