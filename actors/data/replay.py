"""A small FIFO replay buffer of ``Transition`` rows with deterministic sampling.

Why not RLlib's replay buffers: they sample with Python's global ``random`` (no per-call seed,
so a resumed run cannot replay the same samples), they store fixed-width padded ``SampleBatch``
rows (token episodes differ in length; padding to the longest wastes memory and fixes the
length up front), and they are a DeveloperAPI of RLlib's old API stack; importing rllib also costs
~6 s. Here a sample is a pure function of the buffer's contents, its seed and the training step,
so a run resumed from a checkpoint (contents restored) draws exactly the batches it drew before.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from actors.data.transitions import Transition
from learners.experience import rows_by_group


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step); distinct pairs give unrelated streams (unlike
    ``seed + step``, where run 1's step 0 repeats run 0's step 1)."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ReplayBuffer:
    def __init__(self, capacity: int, seed: int = 0, whole_groups: bool = False) -> None:
        """``whole_groups``: a sample is whole groups of rows (one prompt's samples, by
        ``group_id``) rather than single rows, for a per-group baseline (``qlearn.reward_baseline
        = group_mean``) that must see every sample of a prompt."""
        if capacity < 1:
            raise ValueError(f"replay buffer capacity must be >= 1, got {capacity}")
        self.capacity, self.seed, self.whole_groups = capacity, seed, whole_groups
        self._rows: list[Transition] = []
        self.added = self.evicted = 0

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, rows: list[Transition]) -> int:
        """Appends ``rows``; returns how many rows were evicted to stay within capacity, oldest
        first (when ``rows`` alone exceed capacity, its own first rows are dropped too)."""
        merged = self._rows + list(rows)
        dropped = max(0, len(merged) - self.capacity)
        self._rows = merged[dropped:]
        self.added += len(rows)
        self.evicted += dropped
        return dropped

    def sample(self, n: int, step: int) -> list[Transition]:
        """``n`` rows drawn uniformly, without replacement when ``n <= len(self)`` and with
        replacement otherwise; with ``whole_groups``, the rows of randomly ordered groups, as many
        as fit in ``n`` rows (at least one group), none twice. The same (contents, seed, step)
        always gives the same rows."""
        return [self._rows[i] for i in self.sample_indices(n, step)]

    def sample_indices(self, n: int, step: int) -> list[int]:
        """The positions in the buffer that ``sample(n, step)`` draws."""
        if not self._rows:
            raise ValueError("cannot sample from an empty replay buffer: add transitions first")
        if n < 0:
            raise ValueError(f"sample size must be >= 0, got {n}")
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        if self.whole_groups:
            return self._whole_groups(n, g)
        size = len(self._rows)
        if n <= size:
            return torch.randperm(size, generator=g)[:n].tolist()
        return torch.randint(size, (n,), generator=g).tolist()

    def _whole_groups(self, n: int, g: torch.Generator) -> list[int]:
        """Every row of randomly ordered groups (``group_id``), as many groups as fit in ``n``
        rows (at least one), each at most once: a baseline per group sees all of its rows."""
        if not n:
            return []
        members = rows_by_group(t.group_id for t in self._rows)
        picked: list[int] = []
        for k in torch.randperm(len(members), generator=g).tolist():
            if not picked or len(picked) + len(members[k]) <= n:
                picked += members[k]
        return picked

    def stats(self) -> dict[str, Any]:
        """Size and traffic counters, and the mean behaviour version of the stored rows (compare
        with the learner's version for policy staleness; None when empty)."""
        versions = [t.behaviour_version for t in self._rows]
        return {
            "size": len(self._rows),
            "capacity": self.capacity,
            "added": self.added,
            "evicted": self.evicted,
            "mean_behaviour_version": sum(versions) / len(versions) if versions else None,
        }
