"""Tool-use transcripts written by code: demonstrations for an SFT stage before multi-turn RL.

A transcript maker turns a task row (``actors/data/tasks.py``: prompt, answer, meta) into the
conversation an agent with tools should have had: the user's prompt, the assistant's tool call,
the tool's answer (as the built-in ``tool_use`` environment would answer it), the assistant's
final answer. Rows it cannot write a transcript for give None and are counted by the caller.

Built in: ``calculator`` (the row's arithmetic expression, as reasoning-gym's arithmetic tasks
give it in ``metadata.expression`` or a ``jsonl:`` row in an ``expression`` field, sent to the
calculator; the reference answer last).
Your own: ``module:function`` taking a row and returning a list of messages or None.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from actors.imports import import_callable
from actors.agents.tools import ToolCallFormat, calculate

Messages = list[dict[str, str]]
TranscriptFn = Callable[[dict[str, Any]], "Messages | None"]


def calculator_transcript(row: dict[str, Any], fmt: ToolCallFormat = ToolCallFormat()) -> Messages | None:
    """prompt -> calculator call on the row's expression -> its answer -> the reference answer;
    None without an expression, or when the calculator disagrees with the reference (a
    demonstration must not teach a wrong final step)."""
    expression, answer = _expression(row), str(row.get("answer", "")).strip()
    if not isinstance(expression, str) or not expression.strip() or not answer:
        return None
    try:
        result = calculate(expression)  # the text the calculator tool answers with
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError, OverflowError):
        return None
    if not _same_number(result, answer):
        return None
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": f"{fmt.open_tag}{call}{fmt.close_tag}"},
        {"role": "tool", "content": fmt.wrap_response(result)},
        {"role": "assistant", "content": answer},
    ]


def _expression(row: dict[str, Any]) -> Any:
    """The row's expression: a reasoning-gym entry's ``metadata.expression``, or an
    ``expression`` field of a ``jsonl:`` row."""
    meta = row.get("meta") or {}
    entry = meta.get("entry") or {}
    return (entry.get("metadata") or {}).get("expression") or meta.get("expression") or row.get("expression")


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except ValueError:
        return a.strip() == b.strip()


BUILTIN_TRANSCRIPTS: dict[str, TranscriptFn] = {"calculator": calculator_transcript}


def resolve_transcripts(name: str) -> TranscriptFn:
    """A built-in transcript maker's name or ``module:function``; ValueError otherwise."""
    if name in BUILTIN_TRANSCRIPTS:
        return BUILTIN_TRANSCRIPTS[name]
    if ":" not in name:
        raise ValueError(
            f"transcripts {name!r} are neither built in ({', '.join(BUILTIN_TRANSCRIPTS)}) nor 'module:function'"
        )
    return import_callable(name, "transcripts")


def transcript_demonstrations(
    rows: list[dict[str, Any]], make: TranscriptFn, tools: list[dict] | None
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Conversation demonstrations (``actors/data/offline_data.py``) of the rows ``make`` writes a
    transcript for, with the tool schemas the RL stage's environment renders; the others
    counted as ``no_transcript`` (a maker that raises or returns garbage counts as
    ``transcript_error``)."""
    from actors.data.offline_data import normalise_conversation

    out: list[dict[str, Any]] = []
    skipped: dict[str, int] = {}
    for i, row in enumerate(rows):
        try:
            messages = make(row)
        except Exception:  # a user's maker failing on one row costs that row, counted
            messages, reason = None, "transcript_error"
        else:
            reason = "no_transcript"
        demo = normalise_conversation({"messages": messages, "tools": tools})[0] if messages is not None else None
        if messages is not None and demo is None:
            reason = "transcript_error"
        if demo is None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        out.append({**demo, "index": i})
    return out, skipped
