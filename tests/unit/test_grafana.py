"""The Grafana dashboard (configs/grafana/rayrlhf_dashboard.json) matches the Ray metrics the
driver exports (cluster.ops.telemetry.METRICS): every metric has a panel, every ``ray_rayrlhf_*`` name
in a query is one of them, and queries use only that metric's tags (plus ``run``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster.ops.telemetry import METRICS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "rayrlhf_dashboard.json"
# Cumulative counts exported as gauges: graphed through rate() / increase().
CUMULATIVE = {name for name, (desc, _) in METRICS.items() if "(cumulative)" in desc}
STATS = {"rayrlhf_step", "rayrlhf_policy_version"}

METRIC_NAME = re.compile(r"\bray_(rayrlhf_[A-Za-z0-9_]+)")
SELECTOR = re.compile(r"\bray_(rayrlhf_[A-Za-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"[^\"]*\"\s*$")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels_of(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return [p for p in out if p.get("type") != "row"]


def metrics_in(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def test_dashboard_loads_with_its_variables(dashboard):
    assert dashboard["schemaVersion"] >= 36  # Grafana 10+
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    run = variables["run"]
    assert run["type"] == "query"
    query = run["query"]["query"] if isinstance(run["query"], dict) else run["query"]
    assert query.replace(" ", "") == "label_values(ray_rayrlhf_step,run)"
    assert run["datasource"]["uid"] == "${datasource}"


def test_every_panel_queries_prometheus(dashboard):
    panels = panels_of(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["type"] in ("timeseries", "stat"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            expr = t.get("expr", "")
            assert expr.strip(), f"{p['title']}: target {t['refId']} has no PromQL expr"
            for open_, close in ("()", "{}", "[]"):
                assert expr.count(open_) == expr.count(close), f"{p['title']}: unbalanced {open_}{close} in {expr}"
            # Every selector filters by the run variable.
            for _, matchers in SELECTOR.findall(expr):
                assert re.search(r'\brun\s*=~\s*"\$run"', matchers), f"{p['title']}: {expr}"
            assert len(METRIC_NAME.findall(expr)) == len(SELECTOR.findall(expr)), (
                f"{p['title']}: a ray_rayrlhf_* name without a label selector in {expr}"
            )


def test_queries_name_only_exported_metrics_and_tags(dashboard):
    for p in panels_of(dashboard):
        for t in p["targets"]:
            expr = t["expr"]
            names = metrics_in(expr)
            assert names, f"{p['title']}: no ray_rayrlhf_* metric in {expr}"
            unknown = names - set(METRICS)
            assert not unknown, f"{p['title']}: ray_{sorted(unknown)} not in cluster.ops.telemetry.METRICS"
            allowed = {"run"}.union(*(METRICS[n][1] for n in names))
            used = set()
            for _, matchers in SELECTOR.findall(expr):
                for m in filter(str.strip, matchers.split(",")):
                    match = MATCHER.match(m)
                    assert match, f"{p['title']}: cannot read matcher {m!r}"
                    used.add(match.group(1))
            for grouping in GROUPING.findall(expr):
                used.update(filter(None, (label.strip() for label in grouping.split(","))))
            used.update(LEGEND_LABEL.findall(t.get("legendFormat", "")))
            assert used <= allowed, f"{p['title']}: tags {sorted(used - allowed)} are not tags of {sorted(names)}"


def test_every_metric_has_a_panel_of_the_right_kind(dashboard):
    shown: dict[str, list[dict]] = {}
    for p in panels_of(dashboard):
        for name in set().union(*(metrics_in(t["expr"]) for t in p["targets"])):
            shown.setdefault(name, []).append(p)
    missing = set(METRICS) - set(shown)
    assert not missing, f"no panel for {sorted(missing)}"
    for name in STATS:
        assert any(p["type"] == "stat" for p in shown[name]), name
    for name, panels in shown.items():
        exprs = [t["expr"] for p in panels for t in p["targets"] if name in metrics_in(t["expr"])]
        windowed = [e for e in exprs if re.search(r"\b(rate|increase|irate)\s*\(", e)]
        if name in CUMULATIVE:
            assert windowed, f"{name} is a cumulative count: graph its rate() or increase()"
        else:
            assert not windowed, f"{name} is a plain gauge: rate()/increase() of it means nothing"
        for e in windowed:
            assert re.search(r"\[\s*(\$__rate_interval|\$__interval|\$__range|\d+[smhd])\s*\]", e), e
