"""Preference data: ``prompt, chosen, rejected`` rows from JSONL or Parquet, checked, counted and
encoded as pairs of ``Experience`` rows.

A row's prompt is text or chat messages (``[{"role": ..., "content": ...}, ...]``); chosen and
rejected are text or messages whose last one is the assistant's reply (then, with no ``prompt``
field, the messages before it are the prompt, as in conversational preference datasets). Rows
that cannot be used are excluded and counted by reason, never silently dropped:
``malformed_row`` (not JSON, not an object, wrong types), ``missing_field``, ``identical_pair``
(chosen == rejected) and ``too_long`` (prompt or a response over its token budget).

Encoded pairs are two rows of one group with the prompt's tokens first (so the learner runs the
prompt once for both, see ``learners/modeling.py``); the chosen row scores 1, the rejected 0.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from learners.experience import Experience

log = logging.getLogger("rayrlhf.preferences")

Messages = list[dict[str, str]]


@dataclass
class PreferenceSet:
    # {"prompt": Messages, "chosen": str, "rejected": str, "index": int (row in the source file)}
    rows: list[dict[str, Any]]
    # Rows excluded, by reason.
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)


def _count(skipped: dict[str, int], reason: str, where: str) -> None:
    skipped[reason] = skipped.get(reason, 0) + 1
    log.warning("%s: %s, skipped", where, reason.replace("_", " "))


def _is_messages(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in x
    )


def _split_reply(x: Any) -> tuple[Messages | None, str | None]:
    """(context messages, reply text) of a chosen/rejected field; (None, None) if malformed."""
    if isinstance(x, str):
        return [], x
    if _is_messages(x) and x[-1]["role"] == "assistant":
        return [dict(m) for m in x[:-1]], x[-1]["content"]
    return None, None


def normalise_row(obj: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A usable ``{"prompt": Messages, "chosen": str, "rejected": str}`` or (None, reason)."""
    if not isinstance(obj, dict):
        return None, "malformed_row"
    if any(obj.get(k) in (None, "", []) for k in ("chosen", "rejected")):
        return None, "missing_field"
    ctx_w, chosen = _split_reply(obj["chosen"])
    ctx_l, rejected = _split_reply(obj["rejected"])
    if chosen is None or rejected is None:
        return None, "malformed_row"
    prompt = obj.get("prompt")
    if prompt in (None, "", []):
        if not ctx_w or ctx_w != ctx_l:
            return None, "missing_field"
        messages = ctx_w
    elif isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif _is_messages(prompt):
        messages = [dict(m) for m in prompt]
    else:
        return None, "malformed_row"
    if not chosen.strip() or not rejected.strip():
        return None, "missing_field"
    if chosen.strip() == rejected.strip():
        return None, "identical_pair"
    return {"prompt": messages, "chosen": chosen, "rejected": rejected}, None


def read_preferences(path: str | Path) -> PreferenceSet:
    """Rows of a ``.jsonl`` file (read line by line, so one bad line is counted, not fatal) or a
    ``.parquet`` file (pyarrow)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"preference file not found: {p}")
    skipped: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        raw = pq.read_table(p).to_pylist()
        source = [(f"{p}[{i}]", obj) for i, obj in enumerate(raw)]
    else:
        source = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                source.append((f"{p}:{i}", json.loads(line)))
            except json.JSONDecodeError:
                _count(skipped, "malformed_row", f"{p}:{i}")
    for index, (where, obj) in enumerate(source):
        row, reason = normalise_row(obj)
        if row is None:
            _count(skipped, reason, where)
            continue
        rows.append({**row, "index": index})
    return PreferenceSet(rows, skipped)


def write_preferences(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Writes rows (prompt messages, chosen, rejected and any extra columns, e.g. judge scores or
    reference log-probs) as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), p)
    return p


def encode_pairs(rows: list[dict[str, Any]], tokenizer: Any, *, max_prompt_tokens: int, max_response_tokens: int,
                 system_prompt: str = "", pad_token_id: int | None = None) -> tuple[Experience, dict[str, int]]:
    """Pairs as one ``Experience`` (rows 2i and 2i+1: chosen and rejected of pair i, group i);
    pairs over a token budget are counted as ``too_long`` and left out.

    Each response ends with the tokenizer's EOS (the end of the assistant's turn), so the
    learner also learns where to stop."""
    skipped: dict[str, int] = {}
    pad = pad_token_id if pad_token_id is not None else (tokenizer.pad_token_id or 0)
    seqs: list[tuple[list[int], list[int], list[int]]] = []
    kept: list[dict[str, Any]] = []
    for row in rows:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + row["prompt"]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        prompt = list(prompt)
        replies = [tokenizer(row[k], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                   for k in ("chosen", "rejected")]
        if len(prompt) > max_prompt_tokens or max(len(r) for r in replies) > max_response_tokens:
            _count(skipped, "too_long", f"pair {row.get('index', len(kept))}")
            continue
        seqs.append((prompt, replies[0], replies[1]))
        kept.append(row)
    n = len(seqs)
    length = max([len(p) + max(len(w), len(l_)) for p, w, l_ in seqs], default=1)
    ids = torch.full((2 * n, length), pad, dtype=torch.long)
    att = torch.zeros(2 * n, length, dtype=torch.bool)
    resp = torch.zeros_like(att)
    for i, (prompt, *replies) in enumerate(seqs):
        for j, reply in enumerate(replies):
            r = 2 * i + j
            ids[r, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
            att[r, : len(prompt) + len(reply)] = True
            resp[r, len(prompt) : len(prompt) + len(reply)] = True
    exp = Experience(
        input_ids=ids, attention_mask=att, response_mask=resp, rollout_logprobs=torch.zeros(2 * n, length),
        group_ids=torch.arange(n).repeat_interleave(2), truncated=torch.zeros(2 * n, dtype=torch.bool),
        policy_version=0,
        completions=[row[k] for row in kept for k in ("chosen", "rejected")],
        meta=[{"index": row.get("index", i), "preferred": k == "chosen"} for i, row in enumerate(kept)
              for k in ("chosen", "rejected")],
        scores=torch.tensor([1.0, 0.0] * n), skipped=dict(skipped),
    )
    return exp.validate(), skipped
