"""The Ray Data source of a streamed prompt set (``data.streaming``): its files read by tasks that
claim no CPU.

Ray Data's own file readers (``read_parquet``, ``read_csv``, ``read_text``) list the files in a
task of their own that asks for one CPU, whatever the read's ``ray_remote_args`` say. In a cluster
whose CPUs the run's roles hold (every local ``rayrlhf train``: it starts the cluster with the
CPUs its roles claim) that task never starts, and the run waits for its first prompts forever.
``PromptFiles`` reads the files it is given in the order given: one read task per file, no
listing task, each task yielding blocks of at most ``block_rows`` rows, so a large file never
sits whole in memory. Parquet is read by row batches, CSV as strings (as the in-memory reader
keeps them: "007" stays "007"), JSON Lines as one ``text`` column of raw lines, parsed by the
sampler so that a broken line is counted, not fatal.
"""

from __future__ import annotations

import csv
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

import pyarrow as pa
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata

BLOCK_ROWS = 4096


class PromptFiles(Datasource):
    """``files`` (one of .parquet, .csv, .jsonl) as a Ray Data source, one read task per file."""

    def __init__(self, files: list[Path], block_rows: int = BLOCK_ROWS) -> None:
        super().__init__()
        self.files = [str(f) for f in files]
        self.block_rows = block_rows

    def get_name(self) -> str:
        return "PromptFiles"

    def estimate_inmemory_data_size(self) -> Optional[int]:
        return sum(Path(f).stat().st_size for f in self.files)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: Optional[int] = None,
                       data_context: Any = None) -> list[ReadTask]:
        return [ReadTask(partial(read_blocks, f, self.block_rows),
                         BlockMetadata(num_rows=None, size_bytes=Path(f).stat().st_size, exec_stats=None,
                                       input_files=(f,)),
                         per_task_row_limit=per_task_row_limit)
                for f in self.files]


def read_blocks(path: str, rows: int) -> Iterator[pa.Table]:
    """The file's rows in order, ``rows`` at a time."""
    suffix = Path(path).suffix
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows):
            yield pa.Table.from_batches([batch])
    elif suffix == ".csv":
        yield from _csv_blocks(path, rows)
    else:
        yield from _line_blocks(path, rows)


def _csv_blocks(path: str, rows: int) -> Iterator[pa.Table]:
    from pyarrow import csv as pacsv

    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    if not header:
        return
    types = pacsv.ConvertOptions(column_types={name: pa.string() for name in header})
    # Blocks by bytes: about a kilobyte per row is generous for prompts.
    reader = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=max(1 << 20, rows * 1024)),
                            convert_options=types)
    for batch in reader:
        if batch.num_rows:
            yield pa.Table.from_batches([batch])


def _line_blocks(path: str, rows: int) -> Iterator[pa.Table]:
    """JSON Lines as raw text lines (blank lines dropped, as Ray Data's ``read_text`` does)."""
    lines: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            lines.append(line)
            if len(lines) == rows:
                yield pa.table({"text": lines})
                lines = []
    if lines:
        yield pa.table({"text": lines})
