"""Rows of the data files users bring, as plain dicts: JSON, JSON Lines, Parquet and CSV files,
folders of them (shards, concatenated in name order) and folders written by the ``datasets``
package's ``save_to_disk`` (a ``DatasetDict``'s ``train`` split, or ``folder#split``).

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


def looks_like_path(spec: str) -> bool:
    """A data source named as a file or folder (rather than a reasoning-gym task name)."""
    base = spec.split("#", 1)[0]
    return "/" in base or base.startswith("~") or base.endswith(SUFFIXES) or Path(base).exists()


def read_table(spec: str | Path) -> Table:
    """The rows of a file, a folder of files or a ``datasets`` folder (``path#split`` picks a
    split). Raises ``FileNotFoundError`` for a missing path, ``ValueError`` for a format it
    cannot read (one line each)."""
    base, _, split = str(spec).partition("#")
    p = Path(base).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data file or folder not found: {p}")
    if p.is_dir() and _is_saved_dataset(p):
        return Table(list(_saved_dataset_rows(p, split)))
    if split:
        raise ValueError(f"{spec}: '#{split}' picks a split of a datasets folder (save_to_disk); {p} is not one")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES))
    if not files:
        raise ValueError(f"{p}: no {', '.join(SUFFIXES)} files in this folder")
    table = Table([])
    for f in files:
        part = _read_file(f)
        table.rows.extend(part.rows)
        for k, n in part.skipped.items():
            table.skipped[k] = table.skipped.get(k, 0) + n
    return table


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
        with p.open(newline="") as f:
            return Table([(f"{p}:{i}", dict(r)) for i, r in enumerate(csv.DictReader(f), 2)])
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
    checked.skipped = {k: table.skipped.get(k, 0) + checked.skipped.get(k, 0)
                       for k in {**table.skipped, **checked.skipped}}
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
        raise ValueError(f"{p} is a datasets folder (save_to_disk): install the 'datasets' package to read it") from None
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
