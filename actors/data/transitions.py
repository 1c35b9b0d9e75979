"""Offline Q-learning transitions: token-level episodes stored as Parquet, one row per sampled
response, each response token an action.

A row holds the prompt (the state the episode starts from), the response tokens (the actions;
a multi-turn episode's observation tokens between its turns are kept in place and marked as no
actions by ``action_mask``),
one reward per response token and whether the episode ended at its last token (``done``) or was
cut at a length limit (the learner bootstraps past such a cut with ``qlearn.bootstrap_truncated``;
by default a response's last token ends its episode, its reward having been given for the cut text). Rows carry the policy version
and, when known, the log-probs of the policy that sampled them, so off-policy corrections and
staleness checks work on data written long ago. Lists are stored unpadded, so a file does not
fix a sequence length; ``transitions_to_experience`` pads a batch of rows for the learner.

Reading never drops a row silently: unusable rows are excluded and counted by reason
(``empty_response``, ``empty_prompt``, ``length_mismatch``, ``nan_reward``, ``nan_logprob``,
``token_out_of_range``, ``bad_meta``, ``null_field``). A file without a required column, or with
a column of an unusable type, is an error (``TransitionsError``), not a pile of skipped rows.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from learners.experience import Experience

log = logging.getLogger("rayrlhf.transitions")

TRANSITION_SCHEMA = pa.schema(
    [
        # Prompt tokens, chat template included: the state the episode starts from.
        ("prompt_ids", pa.list_(pa.int32())),
        # Response tokens: the actions, one per step.
        ("response_ids", pa.list_(pa.int32())),
        # Reward of each response token (same length as response_ids).
        ("rewards", pa.list_(pa.float32())),
        # True: the episode ended at the last response token (EOS); False: cut at a length limit
        # (with qlearn.bootstrap_truncated the learner bootstraps past the cut).
        ("done", pa.bool_()),
        # Weight version of the policy that sampled the response.
        ("behaviour_version", pa.int64()),
        # The sampler's log-prob of each response token; null when unknown.
        ("behaviour_logprobs", pa.list_(pa.float32())),
        # Index of the prompt in its dataset; samples of one prompt share it.
        ("group_id", pa.int64()),
        # Response text, for logs and text-based rewards.
        ("completion", pa.string()),
        # JSON object of the row's task metadata (question, answer, ...).
        ("meta", pa.string()),
        # Which response tokens are actions (a multi-turn episode's observations between its turns are
        # not); null: every one.
        ("action_mask", pa.list_(pa.bool_())),
    ]
)
# Columns a file must have; the others default (behaviour_logprobs null, completion "", meta {}).
REQUIRED_COLUMNS = ("prompt_ids", "response_ids", "rewards", "done", "behaviour_version", "group_id")
# Types columns are read as: wide enough that a bad value is counted per row, not a cast error.
_READ_TYPES = {
    "prompt_ids": pa.list_(pa.int64()),
    "response_ids": pa.list_(pa.int64()),
    "rewards": pa.list_(pa.float64()),
    "behaviour_logprobs": pa.list_(pa.float64()),
}


class TransitionsError(ValueError):
    """A transitions file that cannot be read as a whole (missing column, wrong type)."""


@dataclass
class Transition:
    # Prompt tokens, chat template included.
    prompt_ids: list[int]
    # Response tokens (the actions).
    response_ids: list[int]
    # Reward of each response token, len(rewards) == len(response_ids).
    rewards: list[float]
    # The episode ended at the last response token (False: cut at a length limit).
    done: bool
    # Weight version of the policy that sampled the response.
    behaviour_version: int
    # The sampler's log-prob of each response token, or None when unknown.
    behaviour_logprobs: list[float] | None
    # Index of the prompt in its dataset (samples of one prompt share it).
    group_id: int
    # Response text.
    completion: str = ""
    # Task metadata (JSON-able).
    meta: dict[str, Any] = field(default_factory=dict)
    # Which response tokens are actions (None: all; a multi-turn episode's observations are not).
    action_mask: list[bool] | None = None


def _add(skipped: dict[str, int], reason: str, n: int = 1) -> None:
    skipped[reason] = skipped.get(reason, 0) + n


def _warn(skipped: dict[str, int], where: Any) -> None:
    if skipped:
        log.warning(
            "%s: skipped %d transitions (%s)",
            where,
            sum(skipped.values()),
            ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())),
        )


def transitions_from_experience(exp: Experience) -> tuple[list[Transition], dict[str, int]]:
    """One transition per row of ``exp``; rows with no response tokens are left out and counted
    as ``empty_response``. Rewards are ``exp.token_rewards`` at the response positions or, when
    it is None, ``exp.scores`` at the last response token."""
    if exp.token_rewards is None and exp.scores is None:
        raise ValueError("experience has neither token_rewards nor scores: transitions need rewards")
    rows: list[Transition] = []
    skipped: dict[str, int] = {}
    for i in range(exp.batch_size):
        resp, att = exp.response_mask[i], exp.attention_mask[i]
        acts = resp.nonzero().flatten()
        if len(acts) == 0:
            _add(skipped, "empty_response")
            continue
        # Everything from the first action to the last real token: a multi-turn episode's
        # observations lie between its turns' actions.
        start, end = int(acts.min()), int(att.nonzero().max()) + 1
        actions = resp[start:end].tolist()
        if exp.token_rewards is not None:
            rewards = exp.token_rewards[i, start:end].tolist()
        else:
            rewards = [0.0] * (end - start)
            rewards[int(acts.max()) - start] = float(exp.scores[i])
        rows.append(
            Transition(
                prompt_ids=exp.input_ids[i, :start].tolist(),
                response_ids=exp.input_ids[i, start:end].tolist(),
                rewards=rewards,
                done=not bool(exp.truncated[i]),
                behaviour_version=int(exp.policy_version),
                behaviour_logprobs=exp.rollout_logprobs[i, start:end].tolist(),
                group_id=int(exp.group_ids[i]),
                completion=exp.completions[i],
                meta=dict(exp.meta[i]),
                action_mask=None if all(actions) else actions,
            )
        )
    _warn(skipped, "experience export")
    return rows, skipped


def write_transitions(transitions: list[Transition], path: str | Path) -> Path:
    """One Parquet file, written to a temporary name and renamed, so readers (and a directory
    read) never see a half-written file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    records = [{**t.__dict__, "meta": json.dumps(t.meta)} for t in transitions]
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(pa.Table.from_pylist(records, schema=TRANSITION_SCHEMA), tmp)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return p


def export_experience(exp: Experience, path: str | Path) -> dict[str, Any]:
    """``transitions_from_experience`` then ``write_transitions``: {"rows": n, "skipped": {...}}."""
    rows, skipped = transitions_from_experience(exp)
    write_transitions(rows, path)
    return {"rows": len(rows), "skipped": skipped}


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.glob("*.parquet"), key=lambda f: f.name)
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"transitions file or directory not found: {path}")


def _columns(file: Path) -> dict[str, list[Any]]:
    table = pq.read_table(file)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise TransitionsError(f"{file}: missing required column(s) {', '.join(missing)}")
    cols: dict[str, list[Any]] = {}
    for f in TRANSITION_SCHEMA:
        if f.name not in table.column_names:
            cols[f.name] = [None] * table.num_rows
            continue
        try:
            cols[f.name] = table.column(f.name).cast(_READ_TYPES.get(f.name, f.type)).to_pylist()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise TransitionsError(
                f"{file}: column {f.name} is {table.schema.field(f.name).type}, expected {f.type} ({e})"
            ) from e
    return cols


def _finite(xs: list[Any]) -> bool:
    return all(x is not None and math.isfinite(x) for x in xs)


def _check(r: dict[str, Any], vocab_size: int | None) -> tuple[Transition | None, str | None]:
    """A usable transition from one row's values, or (None, reason)."""
    if any(r[k] is None for k in ("done", "behaviour_version", "group_id")):
        return None, "null_field"
    prompt, response, rewards = r["prompt_ids"] or [], r["response_ids"] or [], r["rewards"] or []
    lps = r["behaviour_logprobs"]
    if not response:
        return None, "empty_response"
    if not prompt:
        return None, "empty_prompt"
    actions = r.get("action_mask")
    if (
        len(rewards) != len(response)
        or (lps is not None and len(lps) != len(response))
        or (actions is not None and len(actions) != len(response))
    ):
        return None, "length_mismatch"
    if actions is not None and (None in actions or not any(actions)):
        return None, "empty_response"
    if not _finite(rewards):
        return None, "nan_reward"
    if lps is not None and not _finite(lps):
        return None, "nan_logprob"
    if any(t is None or t < 0 or (vocab_size is not None and t >= vocab_size) for t in prompt + response):
        return None, "token_out_of_range"
    try:
        meta = json.loads(r["meta"]) if r["meta"] else {}
    except json.JSONDecodeError:
        return None, "bad_meta"
    if not isinstance(meta, dict):
        return None, "bad_meta"
    return Transition(
        prompt,
        response,
        rewards,
        bool(r["done"]),
        int(r["behaviour_version"]),
        lps,
        int(r["group_id"]),
        r["completion"] or "",
        meta,
        actions,
    ), None


def read_transitions(path: str | Path, vocab_size: int | None = None) -> tuple[list[Transition], dict[str, int]]:
    """Transitions of a ``.parquet`` file or of every ``*.parquet`` in a directory (in file-name
    order, so a run reads them in the same order each time), and the rows excluded by reason."""
    rows: list[Transition] = []
    skipped: dict[str, int] = {}
    for file in _files(Path(path)):
        cols = _columns(file)
        for values in zip(*cols.values()):
            row, reason = _check(dict(zip(cols, values)), vocab_size)
            if row is None:
                _add(skipped, reason)
            else:
                rows.append(row)
    _warn(skipped, path)
    return rows, skipped


def transitions_to_experience(rows: list[Transition], pad_token_id: int, max_len: int | None = None) -> Experience:
    """Right-padded ``Experience`` of transitions: per-token rewards at the response positions,
    ``scores`` their sum, ``truncated`` = not done. Rows longer than ``max_len`` tokens (prompt
    plus response) are left out and counted as ``too_long`` in the record's ``skipped``."""
    if not rows:
        raise ValueError("cannot build an experience record from zero transitions")
    skipped: dict[str, int] = {}
    if max_len is not None:
        kept = [t for t in rows if len(t.prompt_ids) + len(t.response_ids) <= max_len]
        if len(kept) < len(rows):
            _add(skipped, "too_long", len(rows) - len(kept))
            _warn(skipped, "transitions_to_experience")
        if not kept:
            raise ValueError(f"all {len(rows)} transitions are longer than max_len={max_len}")
        rows = kept
    n, length = len(rows), max(len(t.prompt_ids) + len(t.response_ids) for t in rows)
    ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    att = torch.zeros(n, length, dtype=torch.bool)
    resp = torch.zeros_like(att)
    rewards, logprobs = torch.zeros(n, length), torch.zeros(n, length)
    for i, t in enumerate(rows):
        p, end = len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)
        ids[i, :end] = torch.tensor(t.prompt_ids + t.response_ids)
        att[i, :end] = True
        resp[i, p:end] = True if t.action_mask is None else torch.tensor(t.action_mask, dtype=torch.bool)
        rewards[i, p:end] = torch.tensor(t.rewards)
        if t.behaviour_logprobs is not None:
            logprobs[i, p:end] = torch.tensor(t.behaviour_logprobs)
    return Experience(
        input_ids=ids,
        attention_mask=att,
        response_mask=resp,
        rollout_logprobs=logprobs,
        group_ids=torch.tensor([t.group_id for t in rows], dtype=torch.long),
        truncated=torch.tensor([not t.done for t in rows], dtype=torch.bool),
        policy_version=min(t.behaviour_version for t in rows),
        completions=[t.completion for t in rows],
        meta=[dict(t.meta) for t in rows],
        scores=rewards.sum(dim=1),
        token_rewards=rewards,
        skipped=skipped,
    ).validate()
