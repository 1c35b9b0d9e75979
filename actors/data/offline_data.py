"""Offline data: preference rows (``prompt, chosen, rejected``) and demonstrations (``prompt,
response``) from JSONL or Parquet, checked, counted and encoded as ``Experience`` rows.

A row's prompt is text or chat messages (``[{"role": ..., "content": ...}, ...]``); chosen and
rejected are text or messages whose last one is the assistant's reply (then, with no ``prompt``
field, the messages before it are the prompt, as in conversational preference datasets). Rows
that cannot be used are excluded and counted by reason, never silently dropped:
``malformed_row`` (not JSON, not an object, wrong types), ``missing_field``, ``identical_pair``
(chosen == rejected) and ``too_long`` (prompt or a response over its token budget).

Demonstrations follow the same rules with one ``response`` field (text or messages), or are
whole conversations: a ``messages`` field (and optionally ``tools``, function schemas) whose every
assistant turn after the first user turn is trained, and whose other turns (tool answers, user
feedback) are context, tokenised as a multi-turn rollout tokenises them (``ChatTokens``), so an
SFT stage on transcripts and a multi-turn RL stage after it see the same token ids.

Encoded pairs are two rows of one group with the prompt's tokens first (so the learner runs the
prompt once for both, see ``learners/training/modeling.py``); the chosen row scores 1, the rejected 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from actors.data.tasks import is_messages as _is_messages
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


def _split_reply(x: Any) -> tuple[Messages | None, str | None]:
    """(context messages, reply text) of a chosen/rejected field; (None, None) if malformed."""
    if isinstance(x, str):
        return [], x
    if _is_messages(x) and x[-1]["role"] == "assistant":
        return [dict(m) for m in x[:-1]], x[-1]["content"]
    return None, None


def _prompt_messages(prompt: Any, context: Messages) -> tuple[Messages | None, str | None]:
    """The prompt as messages: the ``prompt`` field (text or messages) or, without one, the
    conversation before the reply; (None, reason) if neither is usable."""
    if prompt in (None, "", []):
        return (context, None) if context else (None, "missing_field")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}], None
    if _is_messages(prompt):
        return [dict(m) for m in prompt], None
    return None, "malformed_row"


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
    # Without a prompt field both replies must continue the same conversation.
    messages, reason = _prompt_messages(obj.get("prompt"), ctx_w if ctx_w == ctx_l else [])
    if messages is None:
        return None, reason
    if not chosen.strip() or not rejected.strip():
        return None, "missing_field"
    if chosen.strip() == rejected.strip():
        return None, "identical_pair"
    return {"prompt": messages, "chosen": chosen, "rejected": rejected}, None


def normalise_demonstration(obj: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A usable ``{"prompt": Messages, "response": str}`` (or ``{"messages", "tools"}``, a
    conversation) or (None, reason)."""
    if not isinstance(obj, dict):
        return None, "malformed_row"
    if "messages" in obj:
        return normalise_conversation(obj)
    if obj.get("response") in (None, "", []):
        return None, "missing_field"
    context, response = _split_reply(obj["response"])
    if response is None:
        return None, "malformed_row"
    messages, reason = _prompt_messages(obj.get("prompt"), context)
    if messages is None:
        return None, reason
    if not response.strip():
        return None, "missing_field"
    return {"prompt": messages, "response": response}, None


def normalise_conversation(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """A ``{"messages": Messages, "tools": list | None}`` conversation with at least one
    assistant turn after a turn of someone else, or (None, reason)."""
    messages, tools = obj.get("messages"), obj.get("tools")
    if messages in (None, []):
        return None, "missing_field"
    if not _is_messages(messages) or not (
        tools is None or (isinstance(tools, list) and all(isinstance(t, dict) for t in tools))
    ):
        return None, "malformed_row"
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0 or all(m["role"] == "system" for m in messages[:first]):
        return None, "missing_field"
    if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
        return None, "missing_field"
    return {"messages": [dict(m) for m in messages], "tools": tools or None}, None


def read_demonstrations(path: str | Path) -> PreferenceSet:
    """``prompt, response`` rows (SFT data), read and counted like ``read_preferences``."""
    return _read_rows(path, normalise_demonstration, "demonstration")


def task_demonstrations(task_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Demonstrations from task prompts (``actors/data/tasks.py`` rows): the reference answer is the
    response, the prompt is the user's turn."""
    return [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "response": str(r["answer"]), "index": i}
        for i, r in enumerate(task_rows)
        if str(r.get("answer", "")).strip()
    ]


def answer_pairs(task_rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Preference pairs from task rows with known answers (``actors/data/tasks.py``): the row's correct
    answer is chosen, another row's (different) answer to the same prompt is rejected. A reward
    model trained on them must read the prompt to tell the two apart."""
    import random

    rng = random.Random(seed)
    rows = [r for r in task_rows if str(r.get("answer", "")).strip()]
    out = []
    for i, r in enumerate(rows):
        others = [str(o["answer"]) for o in rng.sample(rows, min(len(rows), 8)) if str(o["answer"]) != str(r["answer"])]
        if others:
            out.append({"prompt": r["prompt"], "chosen": str(r["answer"]), "rejected": others[0], "index": i})
    return out


def read_preferences(path: str | Path) -> PreferenceSet:
    """Rows of JSON Lines (read line by line, so one bad line is counted, not fatal), JSON,
    Parquet or CSV files, folders of them or ``datasets`` folders (``_read_rows``)."""
    return _read_rows(path, normalise_row, "preference")


def _read_rows(path: str | Path, normalise: Any, kind: str) -> PreferenceSet:
    """Rows of one or several sources (a list, or paths separated by commas: concatenated in
    order), each a file, a folder of files or a ``datasets`` folder (``actors/data/tables.py``)."""
    from actors.data.tables import read_table

    paths = path if isinstance(path, (list, tuple)) else [x.strip() for x in str(path).split(",") if x.strip()]
    skipped: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    index = 0
    for one in paths:
        try:
            table = read_table(one)
        except FileNotFoundError:
            raise FileNotFoundError(f"{kind} file not found: {one}") from None
        for k, n in table.skipped.items():
            skipped[k] = skipped.get(k, 0) + n
        for where, obj in table.rows:
            row, reason = normalise(obj)
            if row is None:
                _count(skipped, reason, where)
            else:
                rows.append({**row, "index": index})
            index += 1
    return PreferenceSet(rows, skipped)


def split_rows(rows: list[dict[str, Any]], seed: int, n_held: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out): a shuffle seeded by ``seed``, the first ``n_held`` rows held out."""
    import random

    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[n_held:], rows[:n_held]


def write_preferences(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Writes rows (prompt messages, chosen, rejected and any extra columns, e.g. judge scores or
    reference log-probs) as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), p)
    return p


def _prompt_ids(tokenizer: Any, messages: Messages, system_prompt: str) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _reply_ids(tokenizer: Any, text: str) -> list[int]:
    """The reply's tokens and the tokenizer's EOS (the end of the assistant's turn), so the
    learner also learns where to stop."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


Segments = list[tuple[list[int], bool]]


def pad_rows(
    seqs: list[tuple[list[int], list[int]]], pad: int, masks: list[list[bool] | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids, reply ids) rows, right-padded: input_ids (B, L), attention_mask (B, L) and
    reply mask (B, L), with L the longest row (at least 1). ``masks[i]``, where given, marks the
    trained ids of row i's reply (a conversation's assistant turns); else all of it."""
    length = max([len(p) + len(r) for p, r in seqs], default=1)
    ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    att = torch.zeros(len(seqs), length, dtype=torch.bool)
    resp = torch.zeros_like(att)
    for i, (prompt, reply) in enumerate(seqs):
        ids[i, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        att[i, : len(prompt) + len(reply)] = True
        mask = masks[i] if masks is not None and masks[i] is not None else [True] * len(reply)
        resp[i, len(prompt) : len(prompt) + len(reply)] = torch.tensor(mask, dtype=torch.bool)
    return ids, att, resp


def conversation_ids(
    chat: Any, messages: Messages, tools: list[dict] | None, eos_token_id: int
) -> tuple[list[int], Segments]:
    """A conversation as a multi-turn rollout records it: the prompt's ids (up to the first
    assistant turn, with the tool list) and then each assistant turn's ids (trained, ending in
    EOS) and the ids of the turns between them (context). Turns after the last assistant turn are
    left out. ``chat``: ``actors.agents.chat_tokens.ChatTokens``."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = chat.prompt_messages(messages[:first], tools)
    segments: Segments = []
    between: Messages = []
    for m in messages[first:]:
        if m["role"] != "assistant":
            between.append(m)
            continue
        if segments:  # the template's end of the last reply, the turns since, the next generation prompt
            segments.append((chat.after_reply(between, reply_ended=True), False))
        segments.append((list(chat.tok(m["content"], add_special_tokens=False)["input_ids"]) + [eos_token_id], True))
        between = []
    return prompt, segments


def _to_experience(
    seqs: list[tuple[list[int], list[int]]],
    group_ids: list[int],
    scores: list[float],
    completions: list[str],
    meta: list[dict[str, Any]],
    pad: int,
    skipped: dict[str, int],
    masks: list[list[bool] | None] | None = None,
) -> Experience:
    """Right-padded rows of (prompt, reply) token lists; the reply (or its ``masks``) is the
    trained part."""
    n = len(seqs)
    ids, att, resp = pad_rows(seqs, pad, masks)
    return Experience(
        input_ids=ids,
        attention_mask=att,
        response_mask=resp,
        rollout_logprobs=torch.zeros(ids.shape),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        truncated=torch.zeros(n, dtype=torch.bool),
        policy_version=0,
        completions=completions,
        meta=meta,
        scores=torch.tensor(scores, dtype=torch.float32),
        skipped=dict(skipped),
    ).validate()


def encode_pairs(
    rows: list[dict[str, Any]],
    tokenizer: Any,
    *,
    max_prompt_tokens: int,
    max_response_tokens: int,
    system_prompt: str = "",
    pad_token_id: int | None = None,
) -> tuple[Experience, dict[str, int]]:
    """Pairs as one ``Experience`` (rows 2i and 2i+1: chosen and rejected of pair i, group i,
    scores 1 and 0); pairs over a token budget are counted as ``too_long`` and left out."""
    skipped: dict[str, int] = {}
    pad = pad_token_id if pad_token_id is not None else (tokenizer.pad_token_id or 0)
    seqs, completions, meta = [], [], []
    for row in rows:
        prompt = _prompt_ids(tokenizer, row["prompt"], system_prompt)
        chosen, rejected = _reply_ids(tokenizer, row["chosen"]), _reply_ids(tokenizer, row["rejected"])
        if len(prompt) > max_prompt_tokens or max(len(chosen), len(rejected)) > max_response_tokens:
            _count(skipped, "too_long", f"pair {row.get('index', len(meta) // 2)}")
            continue
        seqs += [(prompt, chosen), (prompt, rejected)]
        completions += [row["chosen"], row["rejected"]]
        meta += [{"index": row.get("index", len(meta) // 2), "preferred": p} for p in (True, False)]
    n = len(seqs) // 2
    groups = [i for i in range(n) for _ in (0, 1)]
    return _to_experience(seqs, groups, [1.0, 0.0] * n, completions, meta, pad, skipped), skipped


def encode_demonstrations(
    rows: list[dict[str, Any]],
    tokenizer: Any,
    *,
    max_prompt_tokens: int,
    max_response_tokens: int,
    system_prompt: str = "",
    pad_token_id: int | None = None,
    max_total_tokens: int = 0,
) -> tuple[Experience, dict[str, int]]:
    """Demonstrations as one ``Experience`` (one row each, its own group); rows over a token
    budget are counted as ``too_long`` and left out. A conversation's budget: the prompt, each
    assistant turn (``max_response_tokens``) and the whole row (``max_total_tokens``, 0: the
    prompt's and one turn's budget per assistant turn)."""
    skipped: dict[str, int] = {}
    pad = pad_token_id if pad_token_id is not None else (tokenizer.pad_token_id or 0)
    chat = None
    seqs, masks, completions, meta = [], [], [], []
    for row in rows:
        where = f"row {row.get('index', len(meta))}"
        if "messages" in row:
            if chat is None:
                from actors.agents.chat_tokens import ChatTokens

                chat = ChatTokens(tokenizer, system_prompt)
            prompt, segments = conversation_ids(chat, row["messages"], row.get("tools"), tokenizer.eos_token_id)
            turns = [ids for ids, trained in segments if trained]
            reply = [t for ids, _ in segments for t in ids]
            budget = max_total_tokens or max_prompt_tokens + max_response_tokens * len(turns)
            if (
                len(prompt) > max_prompt_tokens
                or max(map(len, turns)) > max_response_tokens
                or len(prompt) + len(reply) > budget
            ):
                _count(skipped, "too_long", where)
                continue
            mask = [trained for ids, trained in segments for _ in ids]
            text = "\n".join(m["content"] for m in row["messages"] if m["role"] == "assistant")
        else:
            prompt, reply = _prompt_ids(tokenizer, row["prompt"], system_prompt), _reply_ids(tokenizer, row["response"])
            if len(prompt) > max_prompt_tokens or len(reply) > max_response_tokens:
                _count(skipped, "too_long", where)
                continue
            mask, text = None, row["response"]
        seqs.append((prompt, reply))
        masks.append(mask)
        completions.append(text)
        meta.append({"index": row.get("index", len(meta))})
    n = len(seqs)
    return _to_experience(seqs, list(range(n)), [0.0] * n, completions, meta, pad, skipped, masks), skipped
