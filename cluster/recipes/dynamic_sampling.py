"""DAPO's dynamic sampling for the PPO recipe (Yu et al. 2025, "DAPO", sec. 3.2, eq. 11): a
group whose samples all scored the same has a zero group advantage and teaches nothing, so the
batch is refilled with groups of newly drawn prompts until it holds ``rollout.dynamic_sampling``
informative groups (0 < correct < G, generalised here to "not all scores equal"), within
``rollout.dynamic_sampling_max_draws`` extra draws. The learners then train on exactly that many
informative groups (fewer when the budget ran out: the shortfall is counted); the uninformative
and surplus groups are dropped, each in the ledger with its reason, and every extra draw's
prompts are issued in the ledger like the step's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Scores closer than this count as equal (a float reward that is "the same" up to rounding).
EQUAL = 1e-6


def informative_uids(units: list[list[int]], score_stats: list[dict]) -> list[int]:
    """The uids, in batch order, of groups with at least two scored samples whose scores are not
    all equal. ``units[i]``: the uids of the unit whose score stats are ``score_stats[i]``."""
    out = []
    for uids, stats in zip(units, score_stats):
        by_group: dict[int, list[float]] = {}
        for g, s in zip(stats.get("groups", []), stats.get("scores", [])):
            by_group.setdefault(int(g), []).append(float(s))
        out += [u for u in uids if len(by_group.get(u, [])) >= 2 and max(by_group[u]) - min(by_group[u]) > EQUAL]
    return out


@dataclass
class Refill:
    """What dynamic sampling did in one step."""

    target: int
    # Extra draws of prompts_per_step prompts each, and the informative groups found in all.
    draws: int = 0
    informative: list[int] = field(default_factory=list)

    @property
    def keep(self) -> list[int]:
        return self.informative[: self.target]

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/draws": float(self.draws),
            "dynamic_sampling/groups": float(len(self.keep)),
            "dynamic_sampling/shortfall": float(self.target - len(self.keep)),
        }

    def dropped_records(self, step: int, kept: dict[int, int]) -> list[dict[str, Any]]:
        """``dropped`` ledger records of the groups left out of the loss, by reason."""
        keep, informative = set(self.keep), set(self.informative)
        return [
            {
                "step": step,
                "uid": u,
                "samples": n,
                "all": True,
                "reasons": {"surplus" if u in informative else "uninformative": n},
            }
            for u, n in kept.items()
            if u not in keep
        ]


def select_groups(exp_refs: list, keep: set[int]) -> list:
    """The records with only the rows of the ``keep`` groups (units left with none are left out)."""
    import ray

    out = []
    for exp in ray.get(exp_refs):
        rows = [i for i, g in enumerate(exp.group_ids.tolist()) if g in keep]
        if rows:
            out.append(ray.put(exp.select(rows) if len(rows) < exp.batch_size else exp))
    return out
