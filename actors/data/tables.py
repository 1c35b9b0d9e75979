"""Rows of the data files users bring, as plain dicts: JSON, JSON Lines, Parquet and CSV files,
folders of them (shards, concatenated in name order) and folders written by the ``datasets``
package's ``save_to_disk`` (a ``DatasetDict``'s ``train`` split, or ``folder#split``; likewise a folder whose file names carry
splits, e.g. verl's ``train.parquet`` / ``test.parquet``).

Each row comes with where it was read (``file:line`` or ``file[i]``), so a reader further on can
count and log a row it cannot use by place. A line that is not JSON, or a JSON value that is not
an object, is counted here (``malformed_row``), never fatal. Nested columns are reached with
dotted keys (``reward_model.ground_truth``, verl's layout) by ``column``.

Every prompt, preference and demonstration source of a run is read through here, so every
layout works for every kind of data.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("rayrlhf.tables")

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass
class Table:
    # (where, row) in source order.
    rows: list[tuple[str, dict[str, Any]]]
    # Rows that are not objects (or not JSON), by reason.
    skipped: dict[str, int] = field(default_factory=dict)


def source_path(spec: str | Path) -> tuple[Path, str]:
    """(path, split) of a source spec: ``path``, ``path#split``, or the older ``jsonl:path``."""
    spec = str(spec)
    base, _, split = (spec[len("jsonl:") :] if spec.startswith("jsonl:") else spec).partition("#")
    return Path(base).expanduser(), split


def looks_like_path(spec: str) -> bool:
    """A data source named as a file or folder (rather than a reasoning-gym task name)."""
    base = spec.split("#", 1)[0]
    return "/" in base or base.startswith("~") or base.endswith(SUFFIXES) or Path(base).exists()


def read_table(spec: str | Path) -> Table:
    """The rows of a file, a folder of files or a ``datasets`` folder (``path#split`` picks a
    split). Raises ``FileNotFoundError`` for a missing path, ``ValueError`` for a format it
    cannot read (one line each)."""
    p, split = source_path(spec)
    if not p.exists():
        raise FileNotFoundError(f"data file or folder not found: {p}")
    if p.is_dir() and _is_saved_dataset(p):
        return Table(list(_saved_dataset_rows(p, split)))
    if split and p.is_file():
        raise ValueError(f"{spec}: '#{split}' picks a split of a folder; {p} is one file")
    files = [p] if p.is_file() else data_files(p, split)
    table = Table([])
    for f in files:
        part = _read_file(f)
        table.rows.extend(part.rows)
        for k, n in part.skipped.items():
            table.skipped[k] = table.skipped.get(k, 0) + n
    return table


_SPLITS = ("train", "test", "validation", "valid", "val", "eval", "dev")
# Files that describe a dataset rather than hold its rows.
_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")


def data_files(folder: Path, split: str = "", suffixes: tuple[str, ...] = SUFFIXES) -> list[Path]:
    """A folder's data files in name order, hidden ones (``.ipynb_checkpoints``, ``_...``) and
    dataset metadata left out. Where file names carry a split (``train.parquet``,
    ``data/test-00000.parquet``) only ``split``'s files (default ``train``), so a folder of splits
    never trains on its test rows."""
    files = sorted(
        f
        for f in folder.rglob("*")
        if f.is_file()
        and f.name.endswith(suffixes)
        and f.name not in _METADATA
        and not any(part.startswith((".", "_")) for part in f.relative_to(folder).parts)
    )
    if not files:
        raise ValueError(f"{folder}: no {', '.join(suffixes)} files in this folder")
    splits = {f: _split_of(f.relative_to(folder)) for f in files}
    if not any(splits.values()):
        if split:
            raise ValueError(f"{folder}#{split}: no file name in this folder names a split")
        return files
    want = split or "train"
    picked = [f for f in files if splits[f] == want]
    if not picked:
        named = sorted({s for s in splits.values() if s})
        raise ValueError(
            f"{folder}: no {want!r} files (splits here: {', '.join(named)}); pick one with {folder}#<split>"
        )
    return picked


def _split_of(relative: Path) -> str | None:
    tokens = re.split(r"[-_./]", str(relative.with_suffix("")).lower())
    return next((t for t in tokens if t in _SPLITS), None)


def column(row: dict[str, Any], key: str) -> Any:
    """``row[key]``, where a dotted key walks into nested objects; None when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _read_file(p: Path) -> Table:
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return Table([(f"{p}[{i}]", r) for i, r in enumerate(pq.read_table(p).to_pylist())])
    if p.suffix == ".csv":
        return Table([(f"{p}:{i}", dict(r)) for i, r in enumerate(csv_rows(p), 2)])
    if p.suffix == ".json":
        text = p.read_text()
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:  # `.json` written by `datasets`/pandas is often JSON Lines
            return _json_lines(p, text)
        if isinstance(whole, dict) and isinstance(whole.get("data"), list):
            whole = whole["data"]
        if not isinstance(whole, list):
            raise ValueError(f"{p}: a .json file must hold a list of row objects (or JSON Lines)")
        return _objects([(f"{p}[{i}]", r) for i, r in enumerate(whole)])
    if p.suffix == ".jsonl":
        return _json_lines(p, p.read_text())
    raise ValueError(f"{p}: unsupported data file (use {', '.join(SUFFIXES)})")


def iter_rows(p: Path) -> Iterator[dict[str, Any]]:
    """One file's object rows, read lazily (JSON Lines and CSV line by line, Parquet batch by
    batch): the first rows of a file too large to load. Malformed rows are passed over."""
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(p).iter_batches(batch_size=256):
            yield from batch.to_pylist()
    elif p.suffix == ".csv":
        yield from csv_rows(p)
    elif p.suffix == ".jsonl":
        for line in text_lines(p):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                yield obj
    else:
        yield from (r for _, r in _read_file(p).rows)


def csv_rows(p: Path) -> Iterator[dict[str, Any]]:
    """A CSV file's rows, every cell a string ("007" stays); a BOM (Excel's CSV) is not the first
    column's name."""
    with p.open(newline="", encoding="utf-8-sig") as f:
        yield from csv.DictReader(f)


def text_lines(p: Path) -> Iterator[str]:
    """A JSON Lines file's non-blank lines, line endings stripped, read lazily."""
    with p.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                yield line.rstrip("\r\n")


def _json_lines(p: Path, text: str) -> Table:
    table = Table([])
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            table.rows.append((f"{p}:{i}", json.loads(line)))
        except json.JSONDecodeError:
            _count(table.skipped, "malformed_row", f"{p}:{i} is not valid JSON")
    checked = _objects(table.rows)
    checked.skipped = {
        k: table.skipped.get(k, 0) + checked.skipped.get(k, 0) for k in {**table.skipped, **checked.skipped}
    }
    return checked


def _objects(rows: list[tuple[str, Any]]) -> Table:
    table = Table([])
    for where, r in rows:
        if isinstance(r, dict):
            table.rows.append((where, r))
        else:
            _count(table.skipped, "malformed_row", f"{where} is not an object")
    return table


def _count(skipped: dict[str, int], reason: str, what: str) -> None:
    skipped[reason] = skipped.get(reason, 0) + 1
    log.warning("%s, skipped", what)


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()


def _saved_dataset_rows(p: Path, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{p} is a datasets folder (save_to_disk): install the 'datasets' package to read it"
        ) from None
    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        name = split or ("train" if "train" in loaded else (next(iter(loaded)) if len(loaded) == 1 else ""))
        if name not in loaded:
            raise ValueError(f"{p}: pick a split with '{p}#<split>' (splits: {', '.join(loaded)})")
        loaded, where = loaded[name], f"{p}#{name}"
    elif split:
        raise ValueError(f"{p} holds one dataset, not splits: drop '#{split}'")
    else:
        where = str(p)
    for i, r in enumerate(loaded):
        yield f"{where}[{i}]", r
