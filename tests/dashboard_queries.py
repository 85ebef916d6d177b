"""Read the PromQL out of tensorplay's Grafana dashboards, ready to run against a real Prometheus.

``dashboard_queries(path, job=..., rate_interval="1m")`` returns ``(panel title, expr, instant)`` with
the dashboard variables substituted the way Grafana does it -- ``$rank`` and ``$topk`` at the
dashboard's defaults unless given, ``$__range`` at its default time range -- so an end-to-end test
can execute every panel's query (``PrometheusServer.query``) and check that it returns data, and a
scale test can run exactly what a user opening the dashboard runs.

The PromQL reader the dashboard and rule tests use to check which metrics a query reads, with
which label matchers and range, is tests/promql.py (:func:`selectors` is re-exported here).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

from .promql import Selector, selectors

__all__ = [
    "CONTRACT_METRICS",
    "DASHBOARD_DIR",
    "RULE_DIR",
    "Query",
    "Selector",
    "dashboard_paths",
    "dashboard_queries",
    "default_time_range",
    "default_value",
    "known_series",
    "load_dashboard",
    "recording_rule_names",
    "panels",
    "selectors",
    "substitute",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = REPO_ROOT / "dashboards"
RULE_DIR = REPO_ROOT / "deploy" / "prometheus" / "rules"

CONTRACT_METRICS: dict[str, str] = {
    # The telemetry contract, sections 3 and 7 (names are fixed) ...
    "tensorplay_allreduce_latency_seconds": "histogram",
    "tensorplay_bucket_bytes_total": "counter",
    "tensorplay_wire_bytes_total": "counter",
    "tensorplay_compression_error_ratio": "histogram",
    "tensorplay_nonfinite_elements_total": "counter",
    "tensorplay_step_compute_seconds": "histogram",
    "tensorplay_last_step_timestamp_seconds": "gauge",
    "tensorplay_collective_waiting_since_timestamp_seconds": "gauge",
    "tensorplay_join_timestamp_seconds": "gauge",
    "tensorplay_join_shadow_iterations": "gauge",
    "tensorplay_join_wait_seconds": "histogram",
    "tensorplay_join_last_joiner": "gauge",
    "tensorplay_joins_total": "counter",
    "tensorplay_optimizer_steps_total": "counter",  # section 7
    "tensorplay_gradient_reductions_total": "counter",
    "tensorplay_unreduced_optimizer_steps_total": "counter",
    "tensorplay_replica_fingerprint": "gauge",
    "tensorplay_replica_fingerprint_step": "gauge",
    # ... and its documented extensions.
    "tensorplay_telemetry_errors_total": "counter",
    "tensorplay_bucket_nonfinite_elements_total": "counter",
    "tensorplay_step_wait_seconds_total": "counter",
    "tensorplay_step_seconds_total": "counter",
    "tensorplay_steps_total": "counter",
    # ... and the step timeline (sections 4 and 6).
    "tensorplay_step_busy_seconds_total": "counter",
    "tensorplay_step_exposed_communication_seconds_total": "counter",
    "tensorplay_step_communication_seconds_total": "counter",
    "tensorplay_compression_candidate_error_ratio": "gauge",
    "tensorplay_compression_candidate_wire_ratio": "gauge",
    "tensorplay_compression_candidate_nonfinite": "gauge",
}
"""Every metric tensorplay exports, as the contract names it, with its type. Each carries `rank`."""


def recording_rule_names() -> set[str]:
    """The series the project's recording rules record."""
    import yaml

    names = set()
    for path in sorted(RULE_DIR.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names.update(rule["record"] for rule in group["rules"] if "record" in rule)
    return names


def known_series() -> set[str]:
    """Every series name a query may read: the contract's (histograms as _bucket/_sum/_count),
    the recording rules', and Prometheus' own ``ALERTS`` (of the project's alerts) and ``up`` (whether a
    target's latest scrape succeeded)."""
    names = {"ALERTS", "up"}
    for name, kind in CONTRACT_METRICS.items():
        names.update((f"{name}_bucket", f"{name}_sum", f"{name}_count") if kind == "histogram" else (name,))
    return names | recording_rule_names()


class Query(NamedTuple):
    """One panel query: the panel's title, its expression with variables substituted, and whether
    Grafana runs it as an instant query (a table or stat of "now") rather than over the range."""

    title: str
    expr: str
    instant: bool


def dashboard_paths() -> list[Path]:
    """The dashboards the project ships (``dashboards/*.json``)."""
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load_dashboard(path: Path | str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel that is not a row, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def _regex_value(value: str | Sequence[str]) -> str:
    """A variable's value inside ``=~"..."``: a regex as given, or several values as ``(a|b)``."""
    if isinstance(value, str):
        return value
    values = [_REGEX_SPECIAL.sub(r"\\\1", str(v)).replace("\\", "\\\\") for v in value]
    return values[0] if len(values) == 1 else "(" + "|".join(values) + ")"


def substitute(
    expr: str,
    variables: dict[str, str | Sequence[str]],
    rate_interval: str = "1m",
    time_range: str | None = None,
) -> str:
    """Replace ``$var`` / ``${var}`` / ``${var:format}`` and Grafana's interval macros in ``expr``.

    A string value is used as it is (a regex such as ``.*``, Grafana's "All" for these dashboards,
    or a single-value variable such as ``$topk``); a list of values becomes ``(a|b)`` with regex
    characters escaped, as Grafana formats a multi-value variable for Prometheus.
    ``$__rate_interval`` and ``$__interval`` become ``rate_interval``, ``$__range`` becomes
    ``time_range`` (Grafana writes the dashboard's time range in seconds: ``3600s``). Raises
    ValueError if a variable has no value or a ``$`` is left over.
    """
    macros = {"__rate_interval": rate_interval, "__interval": rate_interval}
    if time_range is not None:
        macros["__range"] = time_range
    values = {**variables, **macros}

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ValueError(f"no value given for ${name} in {expr!r}")
        return _regex_value(values[name])

    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", replace, expr)
    if "$" in out:
        raise ValueError(f"unresolved variable in {out!r}")
    return out


def _variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


def default_value(dashboard: dict, name: str) -> str | list[str]:
    """What variable ``name`` holds when the dashboard opens: its saved ``current`` value, with
    Grafana's "All" (``$__all``) as the variable's ``allValue``. A multi-value variable gives a
    list, a single-value one a string."""
    variable = _variables(dashboard)[name]
    value = variable["current"]["value"]
    if value == "$__all" or value == ["$__all"]:
        return variable["allValue"]
    return list(value) if variable.get("multi") else str(value)


def default_time_range(dashboard: dict) -> str:
    """The dashboard's default time range as Grafana writes ``$__range`` (``now-30m`` to ``now``:
    ``1800s``)."""
    span = dashboard["time"]
    if span["to"] != "now" or not span["from"].startswith("now-"):
        raise ValueError(f"expected a time range ending now, got {span}")
    amount, unit = re.fullmatch(r"(\d+)([smhdw])", span["from"].removeprefix("now-")).groups()
    return f"{int(amount) * {'s': 1, 'm': 60, 'h': 3600, 'd': 86400, 'w': 604800}[unit]}s"


def dashboard_queries(
    path: Path | str,
    job: str | Sequence[str] = ".*",
    rank: str | Sequence[str] | None = None,
    rate_interval: str = "1m",
    topk: str | None = None,
    time_range: str | None = None,
) -> list[Query]:
    """Return ``(panel title, expr)`` for every query of every panel of the dashboard at ``path``.

    Arguments:
        job, rank: the variables' values -- a regex string (``.*`` is "All") or a list of values
            such as ``["0", "1"]``. ``job`` defaults to All; ``rank`` to the dashboard's default
            (what a user opening it sees).
        rate_interval: what ``$__rate_interval`` becomes (Grafana makes it at least four scrape
            intervals; ``1m`` suits a 1 s scrape of a 60 s run).
        topk: how many worst ranks the top-k panels show; default: the dashboard's default.
        time_range: what ``$__range`` becomes (seconds, ``"3600s"``); default: the dashboard's
            default time range.

    Example::

        for title, expr, _ in dashboard_queries("dashboards/communication.json", job="demo"):
            assert server.query(expr), title
    """
    dashboard = load_dashboard(path)
    variables = {
        "job": job,
        "rank": default_value(dashboard, "rank") if rank is None else rank,
        "topk": default_value(dashboard, "topk") if topk is None else topk,
    }
    span = default_time_range(dashboard) if time_range is None else time_range
    return [
        Query(
            panel.get("title", ""),
            substitute(target["expr"], variables, rate_interval, span),
            bool(target.get("instant")) and not target.get("range"),
        )
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if target.get("expr") and not target.get("hide")
    ]
