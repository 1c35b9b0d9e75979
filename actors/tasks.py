"""Prompt sources: reasoning-gym generators or a JSONL file, split into train and held-out rows.

A row is ``{"prompt": str, "answer": str, "meta": dict}``; ``meta`` travels with each sample
to the scorer, so reward functions see the task's own data (answer, difficulty, ...).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("rayrlhf.tasks")


@dataclass
class PromptSet:
    rows: list[dict[str, Any]]
    # Rows rejected while loading (missing fields, wrong types), by reason.
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)


def _row(prompt: Any, answer: Any, meta: dict, instruction: str, skipped: dict[str, int]) -> dict | None:
    if not isinstance(prompt, str) or not prompt.strip():
        skipped["empty_or_malformed_prompt"] = skipped.get("empty_or_malformed_prompt", 0) + 1
        return None
    if answer is None:
        skipped["missing_answer"] = skipped.get("missing_answer", 0) + 1
        return None
    text = f"{prompt.strip()} {instruction}".strip() if instruction else prompt.strip()
    return {"prompt": text, "answer": str(answer), "meta": {**meta, "answer": str(answer), "question": prompt, "prompt": text}}


def reasoning_gym_rows(task: str, size: int, seed: int, kwargs: dict, instruction: str) -> PromptSet:
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)
    except Exception as e:  # unknown task name or bad difficulty keys come back as various errors
        raise ValueError(f"reasoning-gym task {task!r} with {kwargs} could not be created: {e}") from e
    skipped: dict[str, int] = {}
    rows = []
    for entry in ds:
        meta = {"task": task, "task_kwargs": kwargs, "entry": entry}
        r = _row(entry.get("question"), entry.get("answer"), meta, instruction, skipped)
        if r is not None:
            rows.append(r)
    return PromptSet(rows, skipped)


def jsonl_rows(path: str, instruction: str) -> PromptSet:
    """Reads ``{"prompt": ..., "answer": ...}`` lines; malformed lines are counted and logged."""
    skipped: dict[str, int] = {}
    rows = []
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file not found: {p}")
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            skipped["malformed_json"] = skipped.get("malformed_json", 0) + 1
            log.warning("%s:%d: not valid JSON, skipped", p, i)
            continue
        if not isinstance(obj, dict):
            skipped["malformed_json"] = skipped.get("malformed_json", 0) + 1
            continue
        r = _row(obj.get("prompt"), obj.get("answer", ""), {"task": "jsonl", **{k: v for k, v in obj.items() if k not in ("prompt",)}}, instruction, skipped)
        if r is not None:
            rows.append(r)
    return PromptSet(rows, skipped)


def load_prompts(task: str, train_size: int, eval_size: int, seed: int, kwargs: dict, instruction: str) -> tuple[PromptSet, PromptSet]:
    """Train and held-out splits; held-out questions never appear in the train split."""
    if task.startswith("jsonl:"):
        everything = jsonl_rows(task[len("jsonl:"):], instruction)
        rows = list(everything.rows)
        random.Random(seed).shuffle(rows)
        held = rows[:eval_size]
        train = rows[eval_size : eval_size + train_size]
        if not train:
            raise ValueError(f"{task}: no usable training rows ({everything.skipped})")
        return PromptSet(train, everything.skipped), PromptSet(held, {})
    train = reasoning_gym_rows(task, train_size, seed, kwargs, instruction)
    train_prompts = {r["prompt"] for r in train.rows}
    held = reasoning_gym_rows(task, eval_size * 4, seed + 1_000_003, kwargs, instruction)
    held.rows = [r for r in held.rows if r["prompt"] not in train_prompts][:eval_size]
    if not train.rows:
        raise ValueError(f"task {task!r}: no usable training rows ({train.skipped})")
    return train, held
