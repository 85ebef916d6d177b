"""The pieces both Grafana dashboards are built from, each written once: the dashboard's header and
its variables, one builder per panel kind with the options every panel of that kind shares, the
query, the link that opens a rank in the per-rank row, and the layout (ids and grid positions).

A panel builder takes what says what the panel means -- title, description, queries, unit,
thresholds, size -- and returns the panel with its size where ``id`` and ``gridPos`` go;
:func:`dashboard` numbers the panels in order and flows them left to right, 24 columns wide, a row
header starting a new line.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal, NamedTuple, Sequence

Json = dict[str, Any]

SCHEMA_VERSION = 39
DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
TOPK_CHOICES = ("5", "10", "20", "50")
TOPK_DEFAULT = "10"
STEP_METRIC = "tensorplay_last_step_timestamp_seconds"  # every rank of every job reports it


class Query(NamedTuple):
    """One PromQL query of a panel and its legend; ``exemplar``: ask Prometheus for exemplars
    (raw histogram buckets only: recorded series carry none)."""

    expr: str
    legend: str = ""
    exemplar: bool = False


class Size(NamedTuple):
    width: int
    height: int


class Row(NamedTuple):
    """A row header and the panels under it; a collapsed row holds them until it is opened."""

    title: str
    panels: Sequence[Json]
    collapsed: bool = False


# -- the dashboard ---------------------------------------------------------------------------------

_LINKS: list[Json] = [
    {
        "type": "dashboards",
        "tags": ["tensorplay"],
        "title": "tensorplay dashboards",
        "asDropdown": False,
        "includeVars": True,
        "keepTime": True,
        "icon": "external link",
        "targetBlank": False,
        "tooltip": "",
        "url": "",
    }
]


def _label_values_variable(
    name: str, label: str, selector: str, current: Json, description: str | None = None, **settings: Any
) -> Json:
    """A multi-value variable listing the values of label ``name`` on ``selector``."""
    query = f"label_values({selector}, {name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        **({"description": description} if description is not None else {}),
        "definition": query,
        "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "current": current,
        "multi": True,
        **settings,
        "regex": "",
        "hide": 0,
        "options": [],
        "skipUrlSync": False,
    }


def _templating() -> Json:
    """The variables: data source, job (All by default), how many worst ranks, and the ranks of the
    per-rank row (no All: at 10,000 ranks it would draw 10,000 lines per panel)."""
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }
    job = _label_values_variable(
        "job", "Job", STEP_METRIC, {"selected": True, "text": ["All"], "value": ["$__all"]},
        includeAll=True, allValue=".*", refresh=2, sort=1,
    )
    topk = {
        "name": "topk",
        "label": "Worst ranks shown",
        "type": "custom",
        "description": "How many ranks the worst-ranks panels show: the k highest (or lowest) over the dashboard's "
        "time range, the same ranks at every point of it.",
        "query": ",".join(TOPK_CHOICES),
        "current": {"selected": True, "text": TOPK_DEFAULT, "value": TOPK_DEFAULT},
        "options": [{"selected": k == TOPK_DEFAULT, "text": k, "value": k} for k in TOPK_CHOICES],
        "multi": False,
        "includeAll": False,
        "hide": 0,
        "skipUrlSync": False,
    }
    rank = _label_values_variable(
        "rank", "Ranks (per-rank row)", STEP_METRIC + '{job=~"$job"}',
        {"selected": True, "text": ["0"], "value": ["0"]},
        description="The ranks the collapsed per-rank row shows, one line each. Pick those the worst-ranks panels "
        'name, or click a rank there. It starts at rank 0 and has no "All": a job of 10,000 ranks would draw '
        "10,000 lines per panel.",
        includeAll=False, refresh=2, sort=3,
    )
    return {"list": [datasource, job, topk, rank]}


def dashboard(uid: str, title: str, description: str, tags: Sequence[str], rows: Sequence[Row]) -> Json:
    """A whole dashboard: the shared header and variables, then ``rows`` laid out in order."""
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": list(tags),
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "id": None,
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "refresh": "30s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "annotations": {"list": []},
        "links": _LINKS,
        "templating": _templating(),
        "panels": _layout(rows),
    }


def _layout(rows: Sequence[Row]) -> list[Json]:
    """Number every panel (rows too) from 1 and give it its place: panels flow left to right and
    wrap at 24 columns below the tallest of their line; a row header takes a line of its own. A
    collapsed row nests its panels; an open row is followed by them."""
    out: list[Json] = []
    ids = itertools.count(1)
    x = y = line_height = 0

    def place(panel: Json) -> Json:
        nonlocal x, y, line_height
        width, height = panel.pop("size")
        if x + width > GRID_WIDTH:
            x, y, line_height = 0, y + line_height, 0
        head = {key: panel.pop(key) for key in ("type", "title", "description") if key in panel}
        placed = {**head, "id": next(ids), "datasource": DATASOURCE,
                  "gridPos": {"h": height, "w": width, "x": x, "y": y}, **panel}
        x, line_height = x + width, max(line_height, height)
        return placed

    for row in rows:
        y, x, line_height = y + line_height, 0, 0
        header = {"type": "row", "title": row.title, "collapsed": row.collapsed, "id": next(ids),
                  "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []}
        y += 1
        out.append(header)
        placed = [place(dict(panel)) for panel in row.panels]
        (header["panels"] if row.collapsed else out).extend(placed)
    return out


# -- queries and links ------------------------------------------------------------------------------

def _targets(queries: Sequence[Query], instant: bool, fmt: str) -> list[Json]:
    return [
        {
            "datasource": DATASOURCE,
            "refId": chr(ord("A") + index),
            "expr": query.expr,
            "legendFormat": query.legend,
            "editorMode": "code",
            "range": not instant,
            "instant": instant,
            "exemplar": query.exemplar,
            "format": fmt,
        }
        for index, query in enumerate(queries)
    ]


def worst_over_range(series: str, op: Literal["topk", "bottomk"] = "topk") -> str:
    """``series`` of the $topk ranks whose mean over the dashboard's time range is the highest
    (``bottomk``: lowest): ranked once (``@ end()``), so the same ranks at every step, where a plain
    topk() would pick others at each step and draw many more than k lines."""
    return f"{series}\nand on (job, rank)\n{op}($topk, avg_over_time({series}[$__range] @ end()))"


def picked_ranks_mean(histogram: str, by: str = "job, rank") -> str:
    """The mean of ``histogram`` (``_sum`` over ``_count``) per ``by`` over each rate window, for
    the ranks picked in the rank variable (the per-rank row)."""
    rate = 'rate({}{{job=~"$job", rank=~"$rank"}}[$__rate_interval])'
    return (f"sum by ({by}) ({rate.format(histogram + '_sum')})\n/\n"
            f"sum by ({by}) ({rate.format(histogram + '_count')})")


def rank_link(uid: str) -> list[Json]:
    """A data link on a worst-ranks panel: the clicked series' rank in dashboard ``uid``'s per-rank
    row, keeping the time range, data source, jobs and top-k."""
    return [{
        "title": "Show rank ${__field.labels.rank} in the per-rank row",
        "url": f"/d/{uid}/?${{__url_time_range}}&${{datasource:queryparam}}&${{job:queryparam}}"
        "&${topk:queryparam}&var-rank=${__field.labels.rank}",
    }]


def _thresholds(red_from: float | None) -> Json:
    steps: list[Json] = [{"color": "green", "value": None}]
    if red_from is not None:
        steps.append({"color": "red", "value": red_from})
    return {"mode": "absolute", "steps": steps}


def _panel(kind: str, title: str, description: str, size: Size, targets: list[Json], **rest: Any) -> Json:
    return {"type": kind, "title": title, "description": description, "size": size, "targets": targets, **rest}


def _reduce_last() -> Json:
    return {"calcs": ["lastNotNull"], "fields": "", "values": False}


# -- the panel kinds --------------------------------------------------------------------------------

def timeseries(
    title: str,
    description: str,
    queries: Sequence[Query],
    size: Size,
    unit: str,
    *,
    min_zero: bool = True,
    red_from: float | None = None,
    links: list[Json] | None = None,
    log_scale: bool = False,
) -> Json:
    """Lines over the time range, the legend a table of each line's mean and last value; ``red_from``
    draws a red threshold line there; ``log_scale``: a logarithmic y axis (base 10, no minimum)."""
    defaults: Json = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "thresholdsStyle": {"mode": "off" if red_from is None else "line"},
            **({"scaleDistribution": {"type": "log", "log": 10}} if log_scale else {}),
        },
        "thresholds": _thresholds(red_from),
        "color": {"mode": "palette-classic"},
        **({"min": 0} if min_zero and not log_scale else {}),
        **({"links": links} if links else {}),
    }
    options = {
        "legend": {"displayMode": "table", "placement": "right", "showLegend": True, "calcs": ["mean", "lastNotNull"]},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return _panel("timeseries", title, description, size, _targets(queries, False, "time_series"),
                  fieldConfig={"defaults": defaults, "overrides": []}, options=options)


def heatmap(title: str, description: str, query: Query, size: Size) -> Json:
    """Buckets per second in each latency/compute bucket (``query`` gives them by ``le``), in seconds."""
    options = {
        "calculate": False,
        "yAxis": {"axisPlacement": "left", "unit": "s"},
        "rowsFrame": {"layout": "auto"},
        "cellGap": 1,
        "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5,
                  "fill": "dark-orange", "steps": 64, "reverse": False},
        "exemplars": {"color": "rgba(255,0,255,0.7)"},
        "filterValues": {"le": 1e-09},
        "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
        "legend": {"show": True},
    }
    field_config = {
        "defaults": {"custom": {"scaleDistribution": {"type": "linear"},
                                "hideFrom": {"legend": False, "tooltip": False, "viz": False}}},
        "overrides": [],
    }
    return _panel("heatmap", title, description, size, _targets([query], False, "heatmap"),
                  maxDataPoints=50, fieldConfig=field_config, options=options)


def stat(
    title: str,
    description: str,
    queries: Sequence[Query],
    size: Size,
    unit: str = "short",
    *,
    decimals: int | None = None,
    no_value: str | None = None,
) -> Json:
    """The latest value of each query, with its sparkline; ``no_value``: what no series means."""
    defaults: Json = {
        "unit": unit,
        "thresholds": _thresholds(None),
        "color": {"mode": "thresholds"},
        **({"decimals": decimals} if decimals is not None else {}),
        **({"noValue": no_value} if no_value is not None else {}),
    }
    options = {
        "reduceOptions": _reduce_last(),
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "textMode": "auto",
        "wideLayout": True,
        "showPercentChange": False,
    }
    return _panel("stat", title, description, size, _targets(queries, True, "time_series"),
                  fieldConfig={"defaults": defaults, "overrides": []}, options=options)


def bargauge(
    title: str,
    description: str,
    query: Query,
    size: Size,
    unit: str,
    *,
    fmt: Literal["time_series", "heatmap"] = "time_series",
    links: list[Json] | None = None,
) -> Json:
    """One horizontal bar per series at its latest value; ``fmt="heatmap"`` orders histogram buckets
    by ``le``."""
    defaults: Json = {
        "unit": unit,
        "min": 0,
        "thresholds": _thresholds(None),
        "color": {"mode": "thresholds"},
        **({"links": links} if links else {}),
    }
    options = {
        "orientation": "horizontal",
        "displayMode": "basic",
        "showUnfilled": True,
        "valueMode": "color",
        "reduceOptions": _reduce_last(),
        "minVizHeight": 16,
        "minVizWidth": 8,
        "namePlacement": "left",
        "sizing": "auto",
    }
    return _panel("bargauge", title, description, size, _targets([query], True, fmt),
                  fieldConfig={"defaults": defaults, "overrides": []}, options=options)


def table(
    title: str,
    description: str,
    query: Query,
    size: Size,
    value_name: str,
    *,
    unit: str | None = None,
    decimals: int | None = None,
) -> Json:
    """One line per series at its latest value, labels as columns, the value column named
    ``value_name`` and sorted highest first."""
    defaults: Json = {
        **({"unit": unit} if unit is not None else {}),
        **({"decimals": decimals} if decimals is not None else {}),
        "custom": {"align": "auto", "cellOptions": {"type": "auto"}},
    }
    options = {
        "showHeader": True,
        "cellHeight": "sm",
        "footer": {"show": False, "reducer": ["sum"], "fields": ""},
        "sortBy": [{"displayName": value_name, "desc": True}],
    }
    organize = {
        "id": "organize",
        "options": {"excludeByName": {"Time": True, "__name__": True}, "indexByName": {},
                    "renameByName": {"Value": value_name}},
    }
    return _panel("table", title, description, size, _targets([query], True, "table"),
                  fieldConfig={"defaults": defaults, "overrides": []}, options=options,
                  transformations=[organize])
