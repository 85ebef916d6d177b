"""The Grafana dashboards follow the project's conventions and read only metrics that exist.

Conventions (shared/style.md): a fixed uid, a current schemaVersion, a `${datasource}` variable and
no hard-coded datasource uid, `job` and `rank` variables from label_values() (multi-select with
All), every query filtered with job=~"$job" / rank=~"$rank", `$__rate_interval` in rate queries,
exemplars on the latency panels. Every series a query reads is one the contract names (or one the
project's recording rules record), so a typo fails here rather than as an empty panel.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .dashboard_queries import (
    CONTRACT_METRICS,
    REPO_ROOT,
    dashboard_paths,
    dashboard_queries,
    known_series,
    load_dashboard,
    panels,
    recording_rule_names,
    selectors,
    substitute,
)

EXPECTED = {
    "communication.json": "tensorplay-communication",
    "stragglers-join.json": "tensorplay-stragglers-join",
}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE_FUNCTIONS = ("rate", "irate", "increase", "delta", "idelta", "deriv", "changes", "resets")
PATHS = dashboard_paths()
IDS = [p.name for p in PATHS]


def _variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def _targets(dashboard: dict):
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def _variable_query(variable: dict) -> str:
    query = variable["query"]
    return query["query"] if isinstance(query, dict) else query


def test_the_two_dashboards_are_there():
    assert {p.name: load_dashboard(p)["uid"] for p in PATHS} == EXPECTED


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_dashboard_header(path: Path):
    dashboard = load_dashboard(path)
    assert dashboard["uid"] == EXPECTED[path.name] and len(dashboard["uid"]) <= 40
    assert dashboard["schemaVersion"] >= 39
    assert dashboard.get("id") is None, "provisioned dashboards carry no database id"
    assert dashboard["title"].startswith("tensorplay / ")
    assert "tensorplay" in dashboard["tags"]
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for p in panels(dashboard) if p not in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = [p["title"] for p in panels(dashboard)]
    assert len(titles) == len(set(titles)), "panel titles must be unique"
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_variables(path: Path):
    variables = _variables(load_dashboard(path))
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    for name in ("job", "rank"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == DATASOURCE
        assert variable["multi"] is True and variable["includeAll"] is True
        query = _variable_query(variable)
        assert re.fullmatch(rf"label_values\((\w+)(\{{.*\}})?, {name}\)", query), query
        for selector in selectors(query[len("label_values("):query.rindex(",")]):
            assert selector.metric in known_series()
    # The rank list follows the job selection.
    assert 'job=~"$job"' in _variable_query(variables["rank"])


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_no_hard_coded_datasource(path: Path):
    def walk(node, where):
        if isinstance(node, dict):
            if "datasource" in node:
                assert node["datasource"] == DATASOURCE, f"{where}: datasource {node['datasource']!r}"
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{where}[{index}]")

    dashboard = load_dashboard(path)
    walk(dashboard, path.name)
    for panel, target in _targets(dashboard):
        assert panel["datasource"] == DATASOURCE and target["datasource"] == DATASOURCE, panel["title"]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_queries_filter_and_use_rate_interval(path: Path):
    dashboard = load_dashboard(path)
    for panel in panels(dashboard):
        assert panel.get("targets"), f"{panel['title']}: no query"
    for panel, target in _targets(dashboard):
        expr, title = target["expr"], panel["title"]
        found = selectors(expr)
        assert found, f"{title}: reads no series"
        for selector in found:
            assert selector.matchers.get("job") == ("=~", "$job"), f"{title}: {selector.metric} not filtered by job"
            if not selector.metric.startswith("job:"):  # job-level recordings have no rank label
                assert selector.matchers.get("rank") == ("=~", "$rank"), f"{title}: {selector.metric} not filtered by rank"
            if selector.range is not None:
                assert selector.range == "$__rate_interval", f"{title}: range [{selector.range}]"
        for function in RATE_FUNCTIONS:
            for _ in re.finditer(rf"\b{function}\s*\(", expr):
                assert "[$__rate_interval]" in expr, f"{title}: {function}() without $__rate_interval"


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_queries_read_only_known_series(path: Path):
    known = known_series()
    for panel, target in _targets(load_dashboard(path)):
        for selector in selectors(target["expr"]):
            assert selector.metric in known, f"{panel['title']}: unknown series {selector.metric}"


def test_every_contract_metric_is_on_a_dashboard():
    read = {s.metric for p in PATHS for _, t in _targets(load_dashboard(p)) for s in selectors(t["expr"])}
    for name, kind in CONTRACT_METRICS.items():
        forms = {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
        # ... or through a recording rule of it (level:metric:operations, `_total` dropped).
        forms |= {series for series in read if series.count(":") == 2 and series.split(":")[1] == name.removesuffix("_total")}
        assert read & forms, f"{name} is on no dashboard"


def test_latency_panels_have_exemplars():
    for path in PATHS:
        for panel, target in _targets(load_dashboard(path)):
            if any(s.metric == "tensorplay_allreduce_latency_seconds_bucket" for s in selectors(target["expr"])):
                assert target.get("exemplar") is True, f"{path.name}: {panel['title']}"
    communication = load_dashboard(REPO_ROOT / "dashboards" / "communication.json")
    assert {panel["type"] for panel in panels(communication)} >= {"timeseries", "heatmap"}
    assert any(p["type"] == "heatmap" and t.get("exemplar") for p, t in _targets(communication))


def test_series_check_catches_a_typo():
    known = known_series()
    typo = 'sum(rate(tensorplay_wire_byte_total{job=~"$job", rank=~"$rank"}[$__rate_interval]))'
    assert [s.metric for s in selectors(typo) if s.metric not in known] == ["tensorplay_wire_byte_total"]
    assert [s.metric for s in selectors("job_rank:tensorplay_step_compute_seconds:mean1m") if s.metric not in known]
    # Functions, aggregations, label lists, keywords and numbers are not series.
    expr = (
        'histogram_quantile(0.99, sum by (job, le) (rate(tensorplay_allreduce_latency_seconds_bucket{job=~"$job"}[5m])))'
        ' / on (job) group_left (hook) max without (rank) (tensorplay_wire_bytes_total offset 5m) > bool 1e-3'
    )
    assert [s.metric for s in selectors(expr)] == [
        "tensorplay_allreduce_latency_seconds_bucket",
        "tensorplay_wire_bytes_total",
    ]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_queries_parse(path: Path, tmp_path: Path):
    """Prometheus' own parser (promtool, via a rule file) accepts every substituted query."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (apt-get install -y prometheus, as .ci/run does)"
    import yaml

    queries = dashboard_queries(path, job=["demo", "bert.large"], rank=".*")
    rules = [{"record": f"dashboard_check:query{i}", "expr": q.expr} for i, q in enumerate(queries)]
    rule_file = tmp_path / "queries.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(rule_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_queries_substitutes_variables():
    path = REPO_ROOT / "dashboards" / "stragglers-join.json"
    queries = dashboard_queries(path, job="demo", rank=["0", "3"], rate_interval="30s")
    assert queries and all("$" not in q.expr for q in queries)
    titles = {q.title for q in queries}
    assert "Straggler score (compute ÷ peers' median, 5m)" in titles
    exprs = " ".join(q.expr for q in queries)
    assert 'job=~"demo"' in exprs and 'rank=~"(0|3)"' in exprs and "[30s]" in exprs
    # Regex characters in listed values are escaped for Prometheus' string literal.
    assert substitute('x{hook=~"$job"}', {"job": ["a.b", "c"]}) == 'x{hook=~"(a\\\\.b|c)"}'
    with pytest.raises(ValueError, match="no value"):
        substitute('x{y=~"$hook"}', {})


def test_contract_names_match_the_library():
    """The names checked here are the names the library registers (tensorplay/telemetry/names.py)."""
    names_py = REPO_ROOT / "tensorplay" / "telemetry" / "names.py"
    tree = ast.parse(names_py.read_text())
    metric_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Metric")
    library = {
        node.value.value
        for node in metric_class.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
    }
    # prometheus_client appends `_total` to counter names.
    contract = {name.removesuffix("_total") if kind == "counter" else name for name, kind in CONTRACT_METRICS.items()}
    assert contract == library


def test_recording_rule_names_follow_level_metric_operations():
    for name in recording_rule_names():
        level, metric, operations = name.split(":")
        assert level in ("job", "job_hook", "job_hook_quantile", "job_rank", "job_rank_hook") and operations, name
        assert metric.startswith("tensorplay_") and not metric.endswith("_total"), name
