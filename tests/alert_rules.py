"""Read tensorplay's alert and recording rules from deploy/prometheus/rules/, for the tests.

``alert_expr(name)`` is an alert's expression as Prometheus evaluates it. ``alert_expr(name,
{120: 3})`` is the same expression with every number 120 in it replaced by 3: an end-to-end test
of a short run checks an alert built for minutes (a 120 s hang threshold) on a hang of seconds,
with the rule's own expression. A number that does not occur is an error, so a test written
against a threshold that has since changed fails instead of silently checking something else.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

import yaml

__all__ = ["RULE_DIR", "RULE_FILES", "alert_expr", "alerts", "rules"]

RULE_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "rules"
RULE_FILES = tuple(sorted(RULE_DIR.glob("*.yml")))
"""The project's rule files: tensorplay.alerts.yml and tensorplay.rules.yml."""

# A number literal standing alone: not part of a name (`mean5m`), a duration (`30m`, `[30m:1m]`)
# or a longer number.
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")


def rules() -> list[dict]:
    """Every rule (recording and alerting) of every rule file, in file order."""
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def alerts() -> dict[str, dict]:
    """Every alerting rule, by alert name."""
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def alert_expr(name: str, thresholds: Mapping[float, float] | None = None) -> str:
    """Return alert ``name``'s expression, with the numbers in ``thresholds`` replaced.

    Arguments:
        name: the alert, e.g. ``"TensorplayRankStalled"``.
        thresholds: ``{number in the rule: number to use instead}``. Raises ValueError if a
            number does not occur in the expression.

    Example::

        # the hang alerts wait for 120 s; a test hang lasts a few seconds
        server.query(alert_expr("TensorplayRankStalled", {120: 3}))
    """
    expr = alerts()[name]["expr"]
    thresholds = dict(thresholds or {})
    found = set()

    def replace(match: re.Match) -> str:
        for old, new in thresholds.items():
            if float(match.group()) == float(old):
                found.add(old)
                return repr(new) if isinstance(new, float) else str(new)
        return match.group()

    substituted = _NUMBER.sub(replace, expr)
    missing = set(thresholds) - found
    if missing:
        raise ValueError(f"{name}: no number {sorted(missing)} in its expression {expr!r}")
    return substituted
