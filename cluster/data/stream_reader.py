"""The Ray Data source of a streamed prompt set (``data.streaming``): its files read by tasks that
claim no CPU.

Ray Data's own file readers (``read_parquet``, ``read_csv``, ``read_text``) list the files in a
task of their own that asks for one CPU, whatever the read's ``ray_remote_args`` say. In a cluster
whose CPUs the run's roles hold (every local ``rayrlhf train``: it starts the cluster with the
CPUs its roles claim) that task never starts, and the run waits for its first prompts forever.
``PromptFiles`` reads the files it is given in the order given: one read task per file, no
listing task, each task yielding blocks of at most ``block_rows`` rows, so a large file never
sits whole in memory. Parquet is read by row batches, CSV and JSON Lines line by line with the
in-memory readers' own functions (``actors/data/tables.py``): CSV cells as strings ("007" stays "007"),
JSON Lines as one ``text`` column of raw lines, parsed by the sampler so that a broken line is
counted, not fatal.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

import pyarrow as pa
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata

from actors.data.tables import csv_rows, text_lines

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

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: Optional[int] = None, data_context: Any = None
    ) -> list[ReadTask]:
        return [
            ReadTask(
                partial(read_blocks, f, self.block_rows),
                BlockMetadata(num_rows=None, size_bytes=Path(f).stat().st_size, exec_stats=None, input_files=(f,)),
                per_task_row_limit=per_task_row_limit,
            )
            for f in self.files
        ]


def read_blocks(path: str, rows: int) -> Iterator[pa.Table]:
    """The file's rows in order, ``rows`` at a time."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(p).iter_batches(batch_size=rows):
            yield pa.Table.from_batches([batch])
    elif p.suffix == ".csv":
        names: list[str] = []
        for chunk in _chunks(csv_rows(p), rows):
            # The header's columns, all strings (a short row's missing cells are null; a long row's
            # extra cells, which csv files under no name, are dropped).
            names = names or [k for k in chunk[0] if k is not None]
            yield pa.Table.from_pylist(chunk, schema=pa.schema([(n, pa.string()) for n in names]))
    else:
        for chunk in _chunks(text_lines(p), rows):
            yield pa.table({"text": chunk})


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
