"""The Grafana dashboards follow the project's conventions, read only metrics that exist, and stay
readable at 10,000 ranks.

Conventions (shared/style.md): a fixed uid, a current schemaVersion, a `${datasource}` variable and
no hard-coded datasource uid, `job` and `rank` variables from label_values(), every query filtered
with job=~"$job", `$__rate_interval` in rate queries, exemplars on the latency panels. Every series
a query reads is one the contract names (or one the project's recording rules record), so a typo
fails here rather than as an empty panel.

Scale (deploy/README.md, "Dashboards"): opened with its defaults, no panel draws one line per rank
of a job. Every query aggregates `rank` away, or keeps the `$topk` worst ranks (ranked once over
the time range in a range query: `@ end()`), or reads only the ranks of the `rank` variable --
which has no "All" and starts at one rank, and drives only the collapsed per-rank row.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .alert_rules import alerts
from .dashboard_queries import (
    CONTRACT_METRICS,
    REPO_ROOT,
    dashboard_paths,
    dashboard_queries,
    default_time_range,
    default_value,
    known_series,
    load_dashboard,
    panels,
    recording_rule_names,
    selectors,
    substitute,
)
from .promql import Vector, parse, per_rank_selectors, rankings, walk

EXPECTED = {
    "communication.json": "tensorplay-communication",
    "stragglers-join.json": "tensorplay-stragglers-join",
}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE_FUNCTIONS = ("rate", "irate", "increase", "delta", "idelta", "deriv", "changes", "resets")
PATHS = dashboard_paths()
IDS = [p.name for p in PATHS]
PER_RANK_ROW = "Per-rank detail"  # the title every dashboard's collapsed per-rank row starts with
MAX_DEFAULT_RANKS = 10  # the most ranks the rank variable may start with


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
def test_committed_dashboard_is_the_generators_output(path: Path):
    """dashboards/*.json are written by dashboards/generate.py, never by hand."""
    from dashboards import generate

    assert set(generate.DASHBOARDS) == set(IDS)
    assert path.read_text(encoding="utf-8") == generate.render(path.name), "run: python -m dashboards.generate"


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
        assert variable["multi"] is True
        query = _variable_query(variable)
        assert re.fullmatch(rf"label_values\((\w+)(\{{.*\}})?, {name}\)", query), query
        for selector in selectors(query[len("label_values("):query.rindex(",")]):
            assert selector.metric in known_series()
    # Jobs: All by default. Ranks: no All (see test_default_view_draws_no_line_per_rank).
    assert variables["job"]["includeAll"] is True and variables["job"]["current"]["value"] == ["$__all"]
    # The rank list follows the job selection.
    assert 'job=~"$job"' in _variable_query(variables["rank"])
    # topk: a fixed choice of small numbers, the default among them.
    topk = variables["topk"]
    options = [option["value"] for option in topk["options"]]
    assert topk["type"] == "custom" and topk["query"].split(",") == options
    assert topk["multi"] is False and topk["includeAll"] is False
    assert all(re.fullmatch(r"[1-9]\d*", k) and int(k) <= 50 for k in options), options
    assert topk["current"]["value"] in options


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
        found = [node for node in walk(parse(expr)) if isinstance(node, Vector)]
        assert found, f"{title}: reads no series"
        for node in found:
            selector = node.selector
            assert selector.matchers.get("job") == ("=~", "$job"), f"{title}: {selector.metric} not filtered by job"
            assert selector.matchers.get("rank", ("=~", "$rank")) == ("=~", "$rank"), f"{title}: {selector.metric}"
            if selector.range is not None:
                # A rate's window, or the whole time range read once (ranking the worst ranks).
                assert selector.range == "$__rate_interval" or (selector.range, node.at) == ("$__range", "end()"), (
                    f"{title}: {selector.metric}[{selector.range}]{' @ ' + node.at if node.at else ''}")
        for function in RATE_FUNCTIONS:
            for _ in re.finditer(rf"\b{function}\s*\(", expr):
                assert "[$__rate_interval]" in expr, f"{title}: {function}() without $__rate_interval"


def _rows(dashboard: dict) -> list[tuple[dict, list[dict]]]:
    """Every row with the panels under it, whether nested (collapsed) or following it."""
    rows: list[tuple[dict, list[dict]]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            rows.append((panel, list(panel.get("panels", []))))
        else:
            assert rows, f"{panel['title']}: a panel above the first row"
            rows[-1][1].append(panel)
    return rows


def _reads_picked_ranks(panel: dict) -> bool:
    return any(s.matchers.get("rank") == ("=~", "$rank") for t in panel["targets"] for s in selectors(t["expr"]))


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_rank_variable_drives_only_the_collapsed_per_rank_row(path: Path):
    """Job aggregates and worst ranks come first and look at every rank; the ranks picked in the
    rank variable are shown in one collapsed row at the end, and only there."""
    rows = _rows(load_dashboard(path))
    per_rank = [(row, members) for row, members in rows if row["title"].startswith(PER_RANK_ROW)]
    assert [row["title"] for row, _ in rows][-1:] == [row["title"] for row, _ in per_rank], "one per-rank row, last"
    (row, members), = per_rank
    assert row["collapsed"] is True and members
    for member in members:
        assert _reads_picked_ranks(member), f"{member['title']}: in the per-rank row but not filtered by $rank"
    for other, others in rows[:-1]:
        for member in others:
            assert not _reads_picked_ranks(member), f"{member['title']} ({other['title']}): filtered by $rank"


def rank_problems(dashboard: dict) -> list[str]:
    """Why the dashboard, opened with its defaults, could draw one line per rank of a job: a
    query whose rank label reaches its result unbounded (tests/promql.py, per_rank_selectors)
    without selecting the rank variable's ranks; a range query ranking at every step; a rank
    variable whose default is not a short list of ranks."""
    problems = []
    rank = _variables(dashboard)["rank"]
    # With "All" among the options, Grafana falls back to it whenever the saved ranks are not in
    # the job (a multi-value variable with no match takes the first option).
    if rank.get("includeAll"):
        problems.append("the rank variable offers All")
    default = default_value(dashboard, "rank")
    if not (isinstance(default, list) and 0 < len(default) <= MAX_DEFAULT_RANKS
            and all(re.fullmatch(r"\d+", value) for value in default)):
        problems.append(f"the rank variable starts at {default!r}, not at a few ranks")
    for panel, target in _targets(dashboard):
        expr, title = target["expr"], panel["title"]
        for selector in per_rank_selectors(expr):
            if selector.matchers.get("rank") != ("=~", "$rank"):
                problems.append(f"{title}: one series per rank of {selector.metric}")
        if not target.get("instant"):
            for ranking in rankings(expr):
                if not ranking.pinned:
                    problems.append(f"{title}: {ranking.op}() of a range query ranks anew at every step (use @ end())")
    return problems


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_default_view_draws_no_line_per_rank(path: Path):
    assert rank_problems(load_dashboard(path)) == []


def test_rank_check_catches_a_per_rank_query():
    """The check above fails on a plain per-rank query, on a top-k ranked at every step, on a top-k
    of a number other than $topk, on "All ranks" by default."""
    path = REPO_ROOT / "dashboards" / "stragglers-join.json"
    score = 'job_rank:tensorplay_step_lateness:ratio5m{job=~"$job"}'
    title = "Straggler share of every step: highest $topk ranks (5m)"

    def with_query(expr: str) -> dict:
        dashboard = load_dashboard(path)
        (panel,) = [p for p in panels(dashboard) if p["title"] == title]
        panel["targets"][0]["expr"] = expr
        return dashboard

    assert rank_problems(load_dashboard(path)) == []
    assert rank_problems(with_query(score)) == [
        f"{title}: one series per rank of job_rank:tensorplay_step_lateness:ratio5m"]
    assert rank_problems(with_query(f"sum by (job, rank) ({score})")) != []
    assert rank_problems(with_query(f"topk(10, {score})")) != []
    assert rank_problems(with_query(f"topk by (job, rank) ($topk, {score})")) != []
    assert rank_problems(with_query(f"topk($topk, {score})")) == [
        f"{title}: topk() of a range query ranks anew at every step (use @ end())"]
    # A comparison against one job-level series keeps every rank; matched on rank to a top-k it does not.
    peers = 'job:tensorplay_step_wait_seconds:peers_median_ratio5m{job=~"$job"}'
    assert rank_problems(with_query(f"{score} > on (job) group_left {peers}")) != []
    assert rank_problems(with_query(f"{score} and on (job) topk($topk, {score} @ end())")) != []
    assert rank_problems(with_query(f"{score} and on (job, rank) topk($topk, {score} @ end())")) == []
    assert rank_problems(with_query(f"max by (job) ({score})")) == []

    every_rank = load_dashboard(path)
    rank = next(v for v in every_rank["templating"]["list"] if v["name"] == "rank")
    rank.update(includeAll=True, allValue=".*", current={"text": ["All"], "value": ["$__all"]})
    assert rank_problems(every_rank) == ["the rank variable offers All", "the rank variable starts at '.*', not at a few ranks"]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_queries_read_only_known_series(path: Path):
    known = known_series()
    for panel, target in _targets(load_dashboard(path)):
        for selector in selectors(target["expr"]):
            assert selector.metric in known, f"{panel['title']}: unknown series {selector.metric}"
            if selector.metric == "ALERTS":
                op, alertname = selector.matchers["alertname"]
                assert op == "=" and alertname in alerts(), f"{panel['title']}: no alert {alertname}"


def test_every_contract_metric_is_on_a_dashboard():
    read = {s.metric for p in PATHS for _, t in _targets(load_dashboard(p)) for s in selectors(t["expr"])}
    for name, kind in CONTRACT_METRICS.items():
        forms = {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
        # ... or through a recording rule of it (level:metric:operations, `_total` dropped; a
        # histogram's buckets as `..._bucket`).
        recorded = {name.removesuffix("_total")} | ({f"{name}_bucket"} if kind == "histogram" else set())
        forms |= {series for series in read if series.count(":") == 2 and series.split(":")[1] in recorded}
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
    queries = dashboard_queries(path, job="demo", rank=["0", "3"], rate_interval="30s", topk="5", time_range="600s")
    assert queries and all("$" not in q.expr for q in queries)
    titles = {q.title for q in queries}
    assert {"Share of every step the job waits for, by rank (5m)",
            "Straggler share of every step: highest $topk ranks (5m)"} <= titles
    exprs = " ".join(q.expr for q in queries)
    assert 'job=~"demo"' in exprs and 'rank=~"(0|3)"' in exprs and "[30s]" in exprs
    assert "topk(5, avg_over_time(" in exprs and "[600s] @ end()" in exprs
    # Regex characters in listed values are escaped for Prometheus' string literal.
    assert substitute('x{hook=~"$job"}', {"job": ["a.b", "c"]}) == 'x{hook=~"(a\\\\.b|c)"}'
    with pytest.raises(ValueError, match="no value"):
        substitute('x{y=~"$hook"}', {})
    with pytest.raises(ValueError, match="no value"):
        substitute("avg_over_time(x[$__range])", {})


def test_dashboard_queries_default_to_what_a_user_opening_the_dashboard_sees():
    """By default the variables hold their saved values: rank 0, the default top-k, the default
    time range (Grafana's $__range: the range in seconds)."""
    path = REPO_ROOT / "dashboards" / "communication.json"
    dashboard = load_dashboard(path)
    assert (default_value(dashboard, "rank"), default_value(dashboard, "topk"), default_value(dashboard, "job")) == (
        ["0"], "10", ".*")
    assert dashboard["time"] == {"from": "now-30m", "to": "now"} and default_time_range(dashboard) == "1800s"
    exprs = " ".join(q.expr for q in dashboard_queries(path, job="demo"))
    assert 'rank=~"0"' in exprs and "topk(10, avg_over_time(" in exprs and "[1800s] @ end()" in exprs


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
        assert level in ("job", "job_hook", "job_hook_quantile", "job_rank", "job_rank_hook", "job_step",
                         "job_step_fingerprint") and operations, name
        assert metric.startswith("tensorplay_") and not metric.endswith("_total"), name
