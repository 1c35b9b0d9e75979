"""The one experience record that crosses every process boundary.

Generators create it, the scorer and the reference fill in their fields, learners consume
it. It travels as a Ray ObjectRef, so the driver never holds its tensors. Every per-token
tensor is (B, L) and aligned with ``input_ids``: position t holds the quantity for token
``input_ids[:, t]`` (its log-prob given the tokens before it, its value, ...). Prompt and
padding positions hold 0 and are excluded by ``response_mask``.

The record is algorithm-neutral on purpose: PPO uses values and GAE, GRPO-style estimators
use ``group_ids``, DPO pairs two rows of one group, Q-learning reads rewards per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

_TOKEN_FIELDS = ("rollout_logprobs", "ref_logprobs", "values", "token_rewards", "token_versions")


class ExperienceError(ValueError):
    """An experience record whose fields do not fit together."""


def rows_by_group(group_ids: Iterable[int]) -> list[list[int]]:
    """The row indices of each group (all samples of one prompt), groups in order of first
    appearance, rows in order: ``[7, 3, 7, 5, 3] -> [[0, 2], [1, 4], [3]]``."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(int(g), []).append(i)
    return list(groups.values())


@dataclass
class Experience:
    # (B, L) int64: prompt tokens then response tokens, right-padded with pad_token_id.
    input_ids: torch.Tensor
    # (B, L) bool: True at real (non-padding) tokens, prompt and response.
    attention_mask: torch.Tensor
    # (B, L) bool: True at response tokens the loss trains on (prompt and padding False).
    response_mask: torch.Tensor
    # (B, L) float32: the generator's log-prob of each response token when it was sampled.
    rollout_logprobs: torch.Tensor
    # (B,) int64: index of the prompt in the dataset; samples of one prompt share it (a group).
    group_ids: torch.Tensor
    # (B,) bool: response hit the length limit without emitting EOS.
    truncated: torch.Tensor
    # int: weight version of the generator that sampled this batch (for staleness checks); with
    # weight updates in flight, the oldest version that sampled any of its tokens.
    policy_version: int
    # Response texts, for scorers and logs (B entries).
    completions: list[str]
    # Per-row JSON-able task metadata for reward functions (question, answer, ...).
    meta: list[dict[str, Any]]
    # (B,) float32: task reward of each response; filled by the scorer.
    scores: torch.Tensor | None = None
    # (B, L) float32: the frozen reference policy's log-probs; filled by the reference.
    ref_logprobs: torch.Tensor | None = None
    # (B, L) float32: critic values; filled by the learner when it uses a critic.
    values: torch.Tensor | None = None
    # (B, L) float32: reward of each response token (Q-learning; offline transitions carry them).
    # None: the sequence's ``scores`` entry is its only reward, given at its last response token.
    token_rewards: torch.Tensor | None = None
    # (B, L) int64: the weight version that sampled each response token (0 elsewhere); differs
    # within a row when a weight update landed mid-generation (``rollout.inflight_updates``).
    # None: every token was sampled by ``policy_version``.
    token_versions: torch.Tensor | None = None
    # (B, L, layers, k) int16: the experts the generator's MoE layers routed each token to
    # (``train.routing_replay``), -1 where none was recorded (padding, a prefix-cache hit, the
    # last token, which no pass computed). None: a dense model, or routes not recorded.
    routes: torch.Tensor | None = None
    # Counters of samples dropped or flagged on the way (bad reward, over-long prompt, ...).
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def response_lengths(self) -> torch.Tensor:
        """(B,) number of response tokens per row."""
        return self.response_mask.sum(dim=1)

    def validate(self) -> "Experience":
        """Checks shapes, dtypes and finiteness once, where the record is built or extended."""
        b, length = self.input_ids.shape if self.input_ids.dim() == 2 else (None, None)
        if b is None:
            raise ExperienceError(f"input_ids must be (B, L), got shape {tuple(self.input_ids.shape)}")
        if self.input_ids.dtype != torch.long:
            raise ExperienceError(f"input_ids must be int64, got {self.input_ids.dtype}")
        for name in ("attention_mask", "response_mask", *_TOKEN_FIELDS):
            t = getattr(self, name)
            if t is None:
                continue
            if tuple(t.shape) != (b, length):
                raise ExperienceError(f"{name} must have shape {(b, length)}, got {tuple(t.shape)}")
        for name in ("attention_mask", "response_mask"):
            if getattr(self, name).dtype != torch.bool:
                raise ExperienceError(f"{name} must be bool")
        if bool((self.response_mask & ~self.attention_mask).any()):
            raise ExperienceError("response_mask marks padding positions")
        if self.token_versions is not None:
            if self.token_versions.dtype != torch.long:
                raise ExperienceError("token_versions must be int64")
            sampled = self.token_versions[self.response_mask]
            if len(sampled) and int(sampled.min()) < self.policy_version:
                raise ExperienceError(
                    f"token_versions hold version {int(sampled.min())}, older than the "
                    f"record's policy_version {self.policy_version}"
                )
        if self.routes is not None and (
            self.routes.dim() != 4 or tuple(self.routes.shape[:2]) != (b, length) or self.routes.dtype != torch.int16
        ):
            raise ExperienceError(f"routes must be int16 (B, L, layers, k) with (B, L) = {(b, length)}")
        for name in ("group_ids", "truncated", "scores"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (b,):
                raise ExperienceError(f"{name} must have shape ({b},), got {tuple(t.shape)}")
        for name in ("rollout_logprobs", "ref_logprobs", "values", "token_rewards", "scores"):
            t = getattr(self, name)
            if t is not None and not bool(torch.isfinite(t).all()):
                raise ExperienceError(f"{name} holds NaN or inf")
        if len(self.completions) != b or len(self.meta) != b:
            raise ExperienceError(f"completions/meta must have {b} entries")
        return self

    def select(self, index: torch.Tensor | list[int]) -> "Experience":
        """Rows ``index`` (a subset or reordering), all fields kept consistent."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.input_ids.device)
        rows = idx.tolist()
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[idx]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in rows]
            else:
                out[f.name] = v
        return Experience(**out)

    def to(self, device: torch.device | str) -> "Experience":
        """The record with every tensor on ``device`` (where a learner computes); itself when
        they already are."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def trimmed(self) -> "Experience":
        """The same rows without the trailing columns that are padding in every row (rows are
        right-padded, so a length-sorted micro-batch sheds most of its padding)."""
        used = self.attention_mask.any(0).nonzero()
        length = int(used.max()) + 1 if len(used) else 1
        if length == self.seq_len:
            return self
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name)[:, :length]
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor) and getattr(self, f.name).dim() >= 2
            },
        )

    @staticmethod
    def concat(parts: list["Experience"], pad_token_id: int = 0) -> "Experience":
        """Stacks records (e.g. one per generator), right-padding to the longest sequence."""
        if not parts:
            raise ExperienceError("cannot concatenate zero experience records")
        if len(parts) == 1:
            return parts[0]
        length = max(p.seq_len for p in parts)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(Experience):
            vals = [getattr(p, f.name) for p in parts]
            if f.name == "token_versions" and any(v is not None for v in vals):
                # A part without them was sampled by its policy_version throughout.
                vals = [v if v is not None else p.policy_version * p.response_mask.long() for v, p in zip(vals, parts)]
            if f.name == "routes" and any(v is not None for v in vals):
                vals = [_routes_or_missing(v, p, next(x for x in vals if x is not None)) for v, p in zip(vals, parts)]
            if f.name == "policy_version":
                out[f.name] = min(vals)
            elif f.name == "skipped":
                merged: dict[str, int] = {}
                for d in vals:
                    for k, n in d.items():
                        merged[k] = merged.get(k, 0) + n
                out[f.name] = merged
            elif isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            elif vals[0] is None or any(v is None for v in vals):
                out[f.name] = None
            elif vals[0].dim() >= 2:
                fill = {"input_ids": pad_token_id, "routes": -1}.get(f.name, 0)
                trailing = (0, 0) * (vals[0].dim() - 2)
                out[f.name] = torch.cat(
                    [torch.nn.functional.pad(v, (*trailing, 0, length - v.shape[1]), value=fill) for v in vals]
                )
            else:
                out[f.name] = torch.cat(vals)
        return Experience(**out)

    def shard_rows(self, rank: int, world: int) -> list[int]:
        """This data-parallel rank's rows: whole groups (all samples of a prompt) dealt
        round-robin in order of first appearance, so each rank's rows are a fixed function of the
        batch. No padding: shards may differ in size, even be empty (learners reduce gradients
        and counts across ranks, see ``learners/training/distributed.py``)."""
        if world == 1:
            return list(range(self.batch_size))
        groups = rows_by_group(self.group_ids.tolist())
        return [i for k, members in enumerate(groups) if k % world == rank for i in members]

    def fields(self) -> dict[str, Any]:
        """Every field by name (what ``Experience(**fields)`` rebuilds, e.g. after ``torch.save``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "Experience":
        return dataclasses.replace(self, **changes)


def _routes_or_missing(routes: torch.Tensor | None, part: Experience, like: torch.Tensor) -> torch.Tensor:
    """A part's routes, or all-missing ones (-1) shaped like ``like`` for a part without any."""
    if routes is not None:
        return routes
    return torch.full((part.batch_size, part.seq_len, *like.shape[2:]), -1, dtype=like.dtype)
