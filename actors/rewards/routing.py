"""Rule rewards as weighted sums of functions, and routed by the row's source.

``routes`` maps a source (the value of ``meta[source_key]``, e.g. verl's ``data_source``) to its
components ``(function, weight, kwargs)``; the key ``None`` holds the components of every row
(``reward.components``). A sample's reward is the weighted sum of its components; a component
that fails for a sample (raised, NaN) fails that sample as one function would (``Scorer``), and
a sample whose source has no route is dropped and counted (``reward_unmapped_source``), never
scored 0.

Each component's and each source's sum and count go to ``last_metrics``
(``reward/component/<name>/sum`` and ``/n``, ``reward/source/<value>/...``): shards add them
up and the step row shows their means (``cluster/metrics.judge_metrics``).
"""

from __future__ import annotations

import logging
from typing import Any

from actors.rewards.scorer import Scorer, TextScorer
from actors.data.tables import column

log = logging.getLogger("rayrlhf.reward_routing")

Component = tuple[str, float, dict]
# The route of every row (``routes[None]``), kept under a key no source value takes.
_EVERY = "\0every"


def component_names(routes: dict[str, list[Component]]) -> dict[tuple[str, int], str]:
    """A metric name per (route, position): the function's own name (its values are logged
    unweighted, so one function under several weights is one metric), numbered where one
    function appears with different arguments."""
    names: dict[tuple[str, int], str] = {}
    seen: dict[tuple, str] = {}
    for route, comps in routes.items():
        for i, (fn, _, kw) in enumerate(comps):
            key = (fn, repr(sorted(kw.items())))
            if key not in seen:
                base = fn.rsplit(":", 1)[-1]
                taken = sum(1 for v in seen.values() if v == base or v.startswith(base + "_"))
                seen[key] = base if not taken else f"{base}_{taken + 1}"
            names[(route, i)] = seen[key]
    return names


class RoutedScorer(TextScorer):
    """Weighted sums of rule functions, per source (see module doc)."""

    def __init__(
        self, routes: dict[str | None, list[Component]], source_key: str = "data_source", on_error: str = "skip"
    ) -> None:
        if not routes or any(not comps for comps in routes.values()):
            raise ValueError("every reward route needs at least one function")
        self.routes = {(_EVERY if r is None else str(r)): comps for r, comps in routes.items()}
        self.source_key, self.on_error = source_key, on_error
        self.names = component_names(self.routes)
        # One Scorer per component: each isolates its own failures per sample.
        self.scorers = {
            (r, i): Scorer(fn, kw, on_error) for r, comps in self.routes.items() for i, (fn, _, kw) in enumerate(comps)
        }
        self.last_metrics = {}

    def route_of(self, meta: dict[str, Any]) -> str | None:
        if _EVERY in self.routes:
            return _EVERY
        value = column(meta, self.source_key) if isinstance(meta, dict) else None
        return None if value is None or str(value) not in self.routes else str(value)

    def score_texts(
        self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]
    ) -> tuple[list[float | None], dict[str, int]]:
        values: list[float | None] = [0.0] * len(completions)
        counts: dict[str, int] = {}
        metrics: dict[str, float] = {}
        by_route: dict[str, list[int]] = {}
        for i, m in enumerate(meta):
            route = self.route_of(m)
            if route is None:
                values[i] = None
                counts["reward_unmapped_source"] = counts.get("reward_unmapped_source", 0) + 1
                log.warning(
                    "no reward for source %r (%s=%r): sample skipped",
                    None if not isinstance(m, dict) else column(m, self.source_key),
                    "reward.by_source key",
                    self.source_key,
                )
            else:
                by_route.setdefault(route, []).append(i)
        for route, rows in by_route.items():
            self._score_route(route, rows, prompts, completions, meta, values, counts, metrics)
        self.last_metrics = metrics
        return values, {k: v for k, v in counts.items() if v}

    def _score_route(
        self,
        route: str,
        rows: list[int],
        prompts: list[str],
        completions: list[str],
        meta: list[dict],
        values: list[float | None],
        counts: dict[str, int],
        metrics: dict[str, float],
    ) -> None:
        """Adds each component's weighted values to ``values`` (None where one failed)."""
        comps = self.routes[route]
        for i, (_, weight, _) in enumerate(comps):
            got, failed = self.scorers[(route, i)].score_texts(
                [prompts[j] for j in rows], [completions[j] for j in rows], [meta[j] for j in rows]
            )
            for k, n in failed.items():
                counts[k] = counts.get(k, 0) + n
            name = f"reward/component/{self.names[(route, i)]}"
            for j, v in zip(rows, got):
                if v is None:
                    values[j] = None
                    continue
                metrics[f"{name}/sum"] = metrics.get(f"{name}/sum", 0.0) + v
                metrics[f"{name}/n"] = metrics.get(f"{name}/n", 0.0) + 1
                if values[j] is not None:
                    values[j] += weight * v
        if route != _EVERY:
            done = [values[j] for j in rows if values[j] is not None]
            metrics[f"reward/source/{route}/sum"] = float(sum(done))
            metrics[f"reward/source/{route}/n"] = float(len(done))
