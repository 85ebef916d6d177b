"""Which alerts tensorplay's rules raise on a Prometheus that holds the data, and how many
notifications Alertmanager makes of them.

An alert fires at ``at`` when its expression returns the series then and at every evaluation
over the rule's ``for:`` before it (a range query at the evaluation interval); its labels are the
series' and the rule's. :func:`notifications` groups alerts by deploy/alertmanager/alertmanager.yml's
``group_by``: one notification per group.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, NamedTuple

import yaml

from .prometheus_server import PrometheusServer

__all__ = ["ALERTMANAGER_CONFIG", "Alert", "duration_s", "firing", "group_by", "notifications"]

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


def firing(server: PrometheusServer, rule: dict, at: float, interval_s: float) -> list[Alert]:
    """The alerts ``rule`` (an alerting rule as in the rule file) fires at unix time ``at``."""
    now = {_key(s["metric"]): float(s["value"][1]) for s in server.query(rule["expr"], at=at)}
    hold_s = duration_s(rule.get("for", "0s"))
    if hold_s and now:
        steps = int(hold_s // interval_s) + 1
        held = server.query_range(rule["expr"], at - hold_s, at, interval_s)
        kept = {_key(s["metric"]) for s in held if len(s["values"]) >= steps}
        now = {key: value for key, value in now.items() if key in kept}
    extra = {"alertname": rule["alert"], **rule.get("labels", {})}
    return [Alert({**dict(key), **extra}, value) for key, value in sorted(now.items())]


def _key(metric: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def group_by(config: Path = ALERTMANAGER_CONFIG) -> list[str]:
    """The top route's ``group_by`` labels."""
    return list(yaml.safe_load(config.read_text())["route"]["group_by"])


def notifications(alerts: Iterable[Alert], labels: Iterable[str] | None = None) -> int:
    """How many notifications Alertmanager sends for ``alerts``: one per group."""
    labels = group_by() if labels is None else list(labels)
    return len({tuple(alert.labels.get(label, "") for label in labels) for alert in alerts})
