"""Prompt sets larger than memory, streamed with Ray Data (``data.streaming``).

The train rows are read as the run draws them: each epoch reads the source's files in a seeded
order with Ray Data (``cluster/data/stream_reader.py``: read tasks that claim no CPU, blocks of rows),
the order preserved, through a seeded shuffle buffer. The stream is a pure function of (files,
seed, epoch), so the sampler's whole state is its raw position in the stream (``consumed``: rows
read, usable or not, over all epochs): a resumed run reopens the epoch and skips to that row,
and continues exactly where the interrupted one stopped. A prompt's id and uid are its raw
position. Only the rows of the last draws are held (``StreamingPrompts.rows``); malformed rows are
counted as they are read.

The held-out prompts come from ``data.eval_task`` or are the source's first ``data.eval_size``
usable rows in file order (read from its first file at load time); the stream skips those.
Nothing touches Ray before the run's cluster is up: the source is opened at its first draw.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Iterator

from actors.data.tasks import FileKeys, PromptSet, file_row, tag_source

log = logging.getLogger("rayrlhf.streaming")

STREAM_SUFFIXES = (".parquet", ".jsonl", ".csv")
_END = object()


def stream_files(spec: str) -> list[Path]:
    """The files of a streamed source (a file or a folder of one format), checked at load time."""
    from actors.data.tables import data_files, source_path

    p, split = source_path(spec)
    if not p.exists():
        raise FileNotFoundError(f"data file or folder not found: {p}")
    files = [p] if p.is_file() else data_files(p, split, STREAM_SUFFIXES)
    suffixes = {f.suffix for f in files}
    if not files or len(suffixes) != 1 or not suffixes <= set(STREAM_SUFFIXES):
        raise ValueError(
            f"{p}: data.streaming reads one format of {', '.join(STREAM_SUFFIXES)} files (found "
            f"{sorted(suffixes) or 'none'})"
        )
    return files


class StreamingPrompts:
    """The train side of a streamed source: ``rows`` maps a drawn prompt id to its row."""

    def __init__(
        self,
        files: list[Path],
        keys: FileKeys,
        instruction: str,
        seed: int,
        held: set[str],
        shuffle_buffer: int,
        name: str = "",
    ) -> None:
        self.files, self.keys, self.instruction, self.seed, self.name = files, keys, instruction, seed, name
        self.held, self.shuffle_buffer = held, shuffle_buffer
        self.rows: dict[int, dict[str, Any]] = {}
        self.skipped: dict[str, int] = {}
        self.raw_rows: int | None = None  # counted on first use (Ray Data; Parquet from its metadata)
        self.counting = True  # off while a reopened stream skips rows it has counted before

    def __len__(self) -> int:
        return self.count()

    def count(self) -> int:
        if self.raw_rows is None:
            if self.files[0].suffix == ".parquet":  # from the files' metadata, nothing read
                import pyarrow.parquet as pq

                self.raw_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
            else:
                self.raw_rows = self._dataset(self.files).count()
            if not self.raw_rows:
                raise ValueError(f"{self.files[0]}: no rows to stream")
        return self.raw_rows

    def _dataset(self, files: list[Path]) -> Any:
        import ray.data

        from cluster.data.stream_reader import PromptFiles

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # the stream must be the same on resume
        ctx.enable_progress_bars = False
        # Reads claim no CPU (the run's roles hold the cluster's) and run two at a time; Ray Data's
        # own file readers would wait for a CPU to list the files (cluster/data/stream_reader.py).
        return ray.data.read_datasource(
            PromptFiles(files), ray_remote_args={"num_cpus": 0}, concurrency=2, override_num_blocks=len(files)
        )

    def epoch_stream(self, epoch: int) -> Iterator[dict[str, Any] | None]:
        """The epoch's raw rows in order: each a prompt row, or None where the row is unusable
        (counted) or held out."""
        files = list(self.files)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(files)
        rng = random.Random(self.seed * 7_919 + epoch)
        buffer: list[Any] = []
        for raw in self._dataset(files).iter_rows():
            buffer.append(raw)
            if len(buffer) >= self.shuffle_buffer:
                yield self._convert(buffer.pop(rng.randrange(len(buffer))))
        rng.shuffle(buffer)
        for raw in buffer:
            yield self._convert(raw)

    def _convert(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        if self.files[0].suffix == ".jsonl":
            try:
                raw = json.loads(raw["text"])
            except ValueError:
                raw = None
            if not isinstance(raw, dict):
                if self.counting:
                    self.skipped["malformed_row"] = self.skipped.get("malformed_row", 0) + 1
                return None
        row = file_row(raw, self.keys, self.instruction, self.skipped if self.counting else {})
        if row is None or row["prompt"] in self.held:
            return None
        return tag_source([row], self.name or self.files[0].stem)[0]


class StreamingSampler:
    """``PromptSampler``'s interface over a ``StreamingPrompts`` (see the module doc)."""

    def __init__(self, source: StreamingPrompts, per_step: int, consumed: int = 0) -> None:
        self.source, self.per_step = source, per_step
        self._consumed = consumed
        self._stream: Iterator | None = None  # positioned at self._consumed when set

    @property
    def consumed(self) -> int:
        return self._consumed

    @consumed.setter
    def consumed(self, value: int) -> None:  # a step's prompts handed back (stale batches): reopen there
        if value != self._consumed:
            self.close()
            self._consumed = value

    def _open(self) -> Iterator:
        epoch, pos = divmod(self._consumed, self.source.count())
        stream = self.source.epoch_stream(epoch)
        self.source.counting = False  # rows before the position were counted when first read
        try:
            for _ in range(pos):  # skip to the row: the stream is the same on every read
                next(stream)
        finally:
            self.source.counting = True
        return stream

    def next_with_uids(self) -> tuple[list[int], list[int]]:
        ids = self.next()
        return ids, list(ids)

    def next(self) -> list[int]:
        out: list[int] = []
        barren = 0  # raw rows since the last usable one
        while len(out) < self.per_step:
            if self._stream is None:
                self._stream = self._open()
            row = next(self._stream, _END)
            if row is _END:  # fewer rows than counted: the next epoch starts
                self._consumed = (self._consumed // self.source.count() + 1) * self.source.count()
                self._stream = None
                continue
            position = self._consumed
            self._consumed += 1
            if self._consumed % self.source.count() == 0:
                self._stream = None
            if row is None:
                barren += 1
                if barren > self.source.count():
                    raise ValueError(f"data.streaming: a whole epoch without a usable row ({self.source.skipped})")
                continue
            barren = 0
            out.append(position)
            self.source.rows[position] = row
        for old in [k for k in self.source.rows if k < out[0] - 8 * self.per_step]:
            del self.source.rows[old]  # only recent draws are held
        return out

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self._consumed}

    def close(self) -> None:
        """Stops the open epoch's reader (before the cluster goes)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def make_sampler(train_set: Any, per_step: int, seed: int, state: dict[str, int]) -> Any:
    """The sampler of a recipe's train set: a ``StreamingSampler`` for a streamed one."""
    from cluster.data.prompts import PromptSampler

    if isinstance(train_set, StreamingPrompts):
        return StreamingSampler(train_set, per_step, **state)
    return PromptSampler(len(train_set.rows), per_step, seed, **state)


def streaming_sets(
    spec: str,
    keys: FileKeys,
    instruction: str,
    seed: int,
    eval_size: int,
    eval_rows: list | None,
    shuffle_buffer: int,
    name: str = "",
) -> tuple[StreamingPrompts, PromptSet]:
    """The streamed train set and the held-out rows (``eval_rows``, or the first ``eval_size``
    usable rows of the first file)."""
    from actors.data.tables import iter_rows

    files = stream_files(spec)
    if eval_rows is None:  # the first usable rows of the first file, read no further
        eval_rows, skipped = [], {}
        for obj in iter_rows(files[0]) if eval_size else ():
            row = file_row(obj, keys, instruction, skipped)
            if row is not None:
                eval_rows.append(row)
            if len(eval_rows) == eval_size:
                break
    held = {r["prompt"] for r in eval_rows}
    return StreamingPrompts(files, keys, instruction, seed, held, shuffle_buffer, name), PromptSet(list(eval_rows))
