"""Which alerts tensorplay's rules raise on a Prometheus that holds the data, and how many
notifications Alertmanager makes of them.

An alert fires at ``at`` when its expression returns the series then and at every evaluation
over the rule's ``for:`` before it (a range query at the evaluation interval); its labels are the
series' and the rule's. A rule that reads another's ``ALERTS{..., alertstate="firing"}`` (the
straggler alert's warning reads its critical) is evaluated after it, with that selector standing
for the alerts found firing (:func:`firing_in_order`): a backfilled Prometheus has no ALERTS
series, and on data that holds still over the ``for:`` the two agree. :func:`notifications`
groups alerts by deploy/alertmanager/alertmanager.yml's ``group_by``: one notification per group.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, NamedTuple

import yaml

from .prometheus_server import PrometheusServer

__all__ = ["ALERTMANAGER_CONFIG", "Alert", "duration_s", "firing", "firing_in_order", "group_by", "notifications"]

ALERTMANAGER_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "alertmanager" / "alertmanager.yml"
_UNITS_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


class Alert(NamedTuple):
    """A firing alert: its labels (``alertname`` included) and value."""

    labels: dict[str, str]
    value: float


def duration_s(duration: str) -> float:
    """A Prometheus duration (``10m``, ``1h30m``) in seconds."""
    parts = re.findall(r"(\d+)(ms|[smhdwy])", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * _UNITS_S[u] for n, u in parts)


def firing(server: PrometheusServer, rule: dict, at: float, interval_s: float,
           already: Iterable[Alert] = ()) -> list[Alert]:
    """The alerts ``rule`` (an alerting rule as in the rule file) fires at unix time ``at``;
    ``already``: the alerts firing that its ``ALERTS`` selectors read."""
    expr = _ALERTS_FIRING.sub(lambda match: _vector_of(match, list(already)), rule["expr"])
    now = {_key(s["metric"]): float(s["value"][1]) for s in server.query(expr, at=at)}
    hold_s = duration_s(rule.get("for", "0s"))
    if hold_s and now:
        steps = int(hold_s // interval_s) + 1
        held = server.query_range(expr, at - hold_s, at, interval_s)
        kept = {_key(s["metric"]) for s in held if len(s["values"]) >= steps}
        now = {key: value for key, value in now.items() if key in kept}
    extra = {"alertname": rule["alert"], **rule.get("labels", {})}
    return [Alert({**dict(key), **extra}, value) for key, value in sorted(now.items())]


def firing_in_order(server: PrometheusServer, rules: Iterable[dict], at: float,
                    interval_s: float) -> list[tuple[dict, list[Alert]]]:
    """Each rule with the alerts it fires at ``at``, in order, each reading the alerts before it."""
    found: list[tuple[dict, list[Alert]]] = []
    for rule in rules:
        found.append((rule, firing(server, rule, at, interval_s, [a for _, alerts in found for a in alerts])))
    return found


_ALERTS_FIRING = re.compile(r'ALERTS\{alertname="(\w+)", severity="(\w+)", alertstate="firing"\}')


def _vector_of(match: re.Match, alerts: list[Alert]) -> str:
    """The alerts of the selector's name and severity as a PromQL vector of their labels (value 1)."""
    name, severity = match.groups()
    chosen = [a for a in alerts if a.labels["alertname"] == name and a.labels.get("severity") == severity]
    if not chosen:
        return "(vector(1) == 0)"  # an empty vector
    return "(" + " or ".join(_sample_of(a) for a in chosen) + ")"


def _sample_of(alert: Alert) -> str:
    """A PromQL sample of value 1 with the alert's labels."""
    expr = "vector(1)"
    for label, value in sorted(alert.labels.items()):
        expr = f'label_replace({expr}, "{label}", "{value}", "", "")'
    return expr


def _key(metric: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def group_by(config: Path = ALERTMANAGER_CONFIG) -> list[str]:
    """The top route's ``group_by`` labels."""
    return list(yaml.safe_load(config.read_text())["route"]["group_by"])


def notifications(alerts: Iterable[Alert], labels: Iterable[str] | None = None) -> int:
    """How many notifications Alertmanager sends for ``alerts``: one per group."""
    labels = group_by() if labels is None else list(labels)
    return len({tuple(alert.labels.get(label, "") for label in labels) for alert in alerts})
