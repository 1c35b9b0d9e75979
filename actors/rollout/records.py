"""The records a rollout hands on: each sampled row (``Sampled``), its tokens' weight versions,
and the batch of rows as the ``Experience`` record the learners read (``to_experience``).

Every rollout strategy (single replies in ``actors/rollout/generator.py``, multi-turn episodes in
``actors/agents/episodes.py``, agent programs in ``actors/agents/agent_endpoint.py``) ends in these rows; the
generator turns them into the record. This module imports no strategy, so they all import it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from learners.experience import Experience

# The route value of a token the learner routes by design (a multi-turn row's observations).
from learners.training.routing import OBSERVED


class Sampled(NamedTuple):
    """One record row as sampled: the prompt's ids, then the response's (a multi-turn episode's
    include the observations between its turns, ``action`` False there)."""

    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    truncated: bool
    text: str
    meta: dict
    group: int
    versions: list[int | None]
    action: list[bool] | None = None
    # (len(prompt) + len(response), layers, k) int16 experts per token, -1 where none
    # (``actors/rollout/vllm_ext.py:RouteCaptureExtension``), OBSERVED at a multi-turn row's
    # observations (``row_routes``); None: not recorded.
    routes: torch.Tensor | None = None


class Rollout(NamedTuple):
    """What a multi-turn strategy hands the generator: its rows, the episodes it dropped by
    reason (``Experience.skipped``) and the batch's counters."""

    rows: list[Sampled]
    dropped: dict[str, int]
    counts: dict[str, float]


def token_versions(spans, n: int) -> list[int | None]:
    """Each of ``n`` output tokens' weight version from vLLM's ``CompletionOutput.weight_versions``
    spans (labels are the generator's versions as strings); None where no span covers it."""
    out: list[int | None] = [None] * n
    for span in spans or []:
        for k in range(span.start, min(span.end, n)):
            out[k] = int(span.version)
    return out


def to_experience(rows: list[Sampled], skipped: dict[str, int], pad_token_id: int, version: int) -> Experience:
    """The rows as one right-padded record; ``version``: the weights' version for tokens no
    version span covers. ``skipped`` gains the count of truncated rows."""
    length = max(len(row.prompt) + len(row.response) for row in rows)
    b = len(rows)
    input_ids = torch.full((b, length), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, length), dtype=torch.bool)
    response = torch.zeros((b, length), dtype=torch.bool)
    logprobs = torch.zeros((b, length), dtype=torch.float32)
    versions = torch.zeros((b, length), dtype=torch.long)
    for i, row in enumerate(rows):
        n_p, n_r = len(row.prompt), len(row.response)
        input_ids[i, : n_p + n_r] = torch.tensor(row.prompt + row.response, dtype=torch.long)
        attention[i, : n_p + n_r] = True
        acts = torch.ones(n_r, dtype=torch.bool) if row.action is None else torch.tensor(row.action, dtype=torch.bool)
        response[i, n_p : n_p + n_r] = acts
        logprobs[i, n_p : n_p + n_r] = torch.tensor(row.logprobs, dtype=torch.float32) * acts
        vs = torch.tensor([version if v is None else v for v in row.versions], dtype=torch.long)
        versions[i, n_p : n_p + n_r] = vs * acts
    truncated = torch.tensor([row.truncated for row in rows], dtype=torch.bool)
    skipped = dict(skipped, truncated=int(truncated.sum()))
    routes = _stacked_routes(rows, length)
    sampled = versions[response]
    oldest = int(sampled.min()) if len(sampled) else version
    # One version throughout (no update landed mid-generation): the scalar says it all.
    mixed = bool(len(sampled)) and int(sampled.max()) != oldest
    return Experience(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response,
        rollout_logprobs=logprobs,
        group_ids=torch.tensor([row.group for row in rows], dtype=torch.long),
        truncated=truncated,
        policy_version=oldest,
        completions=[row.text for row in rows],
        meta=[row.meta for row in rows],
        token_versions=versions if mixed else None,
        routes=routes,
        skipped=skipped,
    ).validate()


def _stacked_routes(rows: list[Sampled], length: int) -> torch.Tensor | None:
    """(B, length, layers, k) int16 routes of the rows, -1 where a row has none; None if no row has."""
    like = next((row.routes for row in rows if row.routes is not None), None)
    if like is None:
        return None
    out = torch.full((len(rows), length, *like.shape[1:]), -1, dtype=torch.int16)
    for i, row in enumerate(rows):
        if row.routes is not None:
            n = min(len(row.routes), length)
            out[i, :n] = row.routes[:n]
    return out


def padded_routes(routed: Any, length: int) -> torch.Tensor | None:
    """vLLM's ``CompletionOutput.routed_experts`` (positions x layers x k; no route for the last
    token, which no pass computes) as ``length`` rows of int16, -1 where none."""
    if routed is None:
        return None
    routed = torch.as_tensor(routed).to(torch.int16)
    out = torch.full((length, *routed.shape[1:]), -1, dtype=torch.int16)
    n = min(len(routed), length)
    out[:n] = routed[:n]
    return out


def share_prompt_routes(routes: list[torch.Tensor | None], prompt_len: int) -> None:
    """In place: the samples of one prompt share its tokens, and the engine computed them once
    (its prefix cache serves the others), so a prompt position one sample lacks takes the route
    of a sample that has it: the keys and values every sample attended to were computed there."""
    have = [r for r in routes if r is not None]
    if len(have) < 2:
        return
    prompt = torch.stack([r[:prompt_len] for r in have])  # (n, P, layers, k)
    known = (prompt >= 0).all(-1)  # (n, P, layers)
    first = known.float().argmax(0)  # the first sample that has each (position, layer)
    best = prompt.gather(0, first[None, :, :, None].expand(1, *prompt.shape[1:])).squeeze(0)
    for r in have:
        missing = (r[:prompt_len] < 0).any(-1)
        r[:prompt_len][missing] = best[missing]


def row_routes(calls: list[Any], prompt_len: int, action: list[bool]) -> torch.Tensor | None:
    """(prompt_len + len(action), layers, k) int16 routes of a multi-turn row from the routes of
    each engine call that sampled part of it (``CompletionOutput.routed_experts``, over the call's
    whole context and reply, -1 where its prefix cache served a position), in call order.

    A position takes the route of the first call that computed it: the turn whose tokens were
    sampled after it (a later call recomputes it only where the cache had dropped it). A turn's
    last sampled token gets its route from the next call, which computes it first; an episode's
    last token has none, as in a single reply. Observation tokens (``action`` False) are
    OBSERVED: the learner routes them. None when no call returned routes (a dense model, or
    turns sampled before a resume, whose snapshots carry none: those tokens fall back, counted)."""
    have = [r for r in calls if r is not None]
    if not have:
        return None
    length = prompt_len + len(action)
    out: torch.Tensor | None = None
    for routed in have:
        r = padded_routes(routed, length)
        out = torch.full_like(r, -1) if out is None else out
        fill = (out < 0).any(-1, keepdim=True) & (r >= 0).all(-1, keepdim=True)
        out = torch.where(fill, r, out)
    observed = torch.zeros(length, dtype=torch.bool)
    observed[prompt_len:] = ~torch.tensor(action, dtype=torch.bool)
    out[observed] = OBSERVED
    return out


def share_group_prompt_routes(rows: list[Sampled]) -> None:
    """``share_prompt_routes`` over each set of rows that sampled one prompt (same group, same
    prompt ids): multi-turn rows whose first call the engine's prefix cache served."""
    by_prompt: dict[tuple, list[torch.Tensor]] = {}
    for row in rows:
        if row.routes is not None:
            by_prompt.setdefault((row.group, tuple(row.prompt)), []).append(row.routes)
    for (_, prompt), routes in by_prompt.items():
        share_prompt_routes(routes, len(prompt))
