"""Prompt sources: reasoning-gym generators or data files (``actors/data/tables.py``), split into train
and held-out rows.

A row is ``{"prompt": str, "answer": str, "meta": dict}``; ``meta`` travels with each sample
to the scorer, so reward functions see the task's own data (answer, difficulty, a file's other
columns, ...). A file prompt given as chat messages keeps them in ``meta["messages"]``: the
generator renders those through the chat template instead of one user message.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

from actors.data.tables import column

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
    return {
        "prompt": text,
        "answer": str(answer),
        "meta": {**meta, "answer": str(answer), "question": prompt, "prompt": text},
    }


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


#: Where the reference answer of a file row is looked for when ``data.answer_key`` is empty: the
#: plain key, verl's layout, and the usual names elsewhere (OpenRLHF's ``--label_key`` default).
ANSWER_KEYS = ("answer", "reward_model.ground_truth", "ground_truth", "label", "solution")


@dataclass
class FileKeys:
    """Which columns of a data file hold the prompt (text, or chat messages) and the answer."""

    prompt: str = "prompt"
    answer: str = ""  # empty: the first of ANSWER_KEYS present, else no answer ("")


def is_messages(x: Any) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in x)
    )


def _message_row(messages: list[dict], answer: Any, meta: dict, skipped: dict[str, int]) -> dict | None:
    """A prompt given as chat messages: used as it is (no instruction appended); its last user
    message is the row's prompt text (what scorers and logs read)."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users or not users[-1].strip() or messages[-1]["role"] == "assistant":
        skipped["empty_or_malformed_prompt"] = skipped.get("empty_or_malformed_prompt", 0) + 1
        return None
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = users[-1].strip()
    return {
        "prompt": text,
        "answer": str(answer),
        "meta": {**meta, "answer": str(answer), "question": text, "prompt": text, "messages": messages},
    }


def file_row(obj: dict[str, Any], keys: FileKeys, instruction: str, skipped: dict[str, int]) -> dict | None:
    """One data-file row as a prompt row, or None (counted in ``skipped`` by reason)."""
    prompt = column(obj, keys.prompt)
    if keys.answer:
        answer = column(obj, keys.answer)
    else:
        answer = next((v for v in (column(obj, k) for k in ANSWER_KEYS) if v is not None), "")
    # A row's own "messages" column would be taken for the prompt's messages (prompt_token_ids):
    # it travels as "source_messages".
    meta = {
        "task": "file",
        **{("source_messages" if k == "messages" else k): v for k, v in obj.items() if k != keys.prompt},
    }
    if not is_messages(prompt):
        return _row(prompt, answer, meta, instruction, skipped)
    if answer is None:
        skipped["missing_answer"] = skipped.get("missing_answer", 0) + 1
        return None
    return _message_row(prompt, answer, meta, skipped)


def file_rows(spec: str, instruction: str, keys: FileKeys | None = None) -> PromptSet:
    """Prompt rows of a data file or folder (``actors/data/tables.py``: JSON, JSONL, Parquet, CSV,
    ``datasets`` folders); the columns besides the prompt travel in ``meta`` to the reward
    function. Unusable rows are counted by reason and logged."""
    from actors.data.tables import read_table

    keys = keys or FileKeys()
    table = read_table(spec)
    skipped = dict(table.skipped)
    rows = []
    for where, obj in table.rows:
        r = file_row(obj, keys, instruction, skipped)
        if r is None:
            log.warning(
                "%s: row without a usable %r prompt or %r answer, skipped", where, keys.prompt, keys.answer or "answer"
            )
        else:
            rows.append(r)
    return PromptSet(rows, skipped)


def is_file_task(task: str) -> bool:
    """``data.task`` names a data file or folder (``jsonl:path`` is the older spelling)."""
    from actors.data.tables import looks_like_path

    return task.startswith("jsonl:") or looks_like_path(task)


def load_prompts(
    task: str, train_size: int, eval_size: int, seed: int, kwargs: dict, instruction: str, keys: FileKeys | None = None
) -> tuple[PromptSet, PromptSet]:
    """Train and held-out splits; held-out questions never appear in the train split. A file's
    rows are shuffled (seeded) and its first ``eval_size`` held out."""
    if is_file_task(task):
        everything = file_rows(task, instruction, keys)
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


def prompt_token_ids(
    tokenizer: Any, text: str, meta: dict | None = None, system_prompt: str = "", chat_template: bool = True
) -> list[int]:
    """The ids a reply is sampled after: the chat template over the row's own messages
    (``meta["messages"]``) or over the system prompt and the text as one user message, with the
    generation prompt added; with ``chat_template=False`` the text's own tokens (a base model's
    raw prompt). ``rayrlhf data inspect`` shows exactly these ids."""
    messages = (meta or {}).get("messages")
    if not chat_template:
        if messages:
            raise ValueError("a prompt given as chat messages needs the chat template (data.chat_template=true)")
        return list(tokenizer.encode(text, add_special_tokens=True))
    if not messages:
        messages = [{"role": "user", "content": text}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + list(messages)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def weighted_counts(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders, ties to the earlier
    source), so the counts always sum to ``total``."""
    if total <= 0 or not weights:
        return [0] * len(weights)
    w = sum(weights)
    exact = [total * x / w for x in weights]
    counts = [int(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def tag_source(rows: list[dict[str, Any]], name: str, override: bool = False) -> list[dict[str, Any]]:
    """Sets each row's ``meta["data_source"]`` (kept where the row has its own, unless ``override``)."""
    for r in rows:
        if override or r["meta"].get("data_source") in (None, ""):
            r["meta"]["data_source"] = name
    return rows
