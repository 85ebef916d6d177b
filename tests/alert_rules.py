"""Read tensorplay's alert and recording rules from deploy/prometheus/rules/, for the tests.

An alert may be written as several rules of one name, one per severity (TensorplayStragglerRank:
``critical``, then ``warning``): :func:`alert_rules` lists every rule, :func:`alerts` the first of
each name. ``alert_expr(name)`` is an alert's expression as Prometheus evaluates it (the rules of
one name joined with ``or``: every series that fires it, at any severity). ``alert_expr(name,
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

__all__ = ["RULE_DIR", "RULE_FILES", "alert_expr", "alert_rules", "alerts", "rules"]

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


def alert_rules(name: str | None = None) -> list[dict]:
    """Every alerting rule (of alert ``name``), in file order."""
    return [rule for rule in rules() if "alert" in rule and name in (None, rule["alert"])]


def alerts() -> dict[str, dict]:
    """Every alert by name: its first rule (of an alert with one rule per severity, the first written)."""
    first: dict[str, dict] = {}
    for rule in alert_rules():
        first.setdefault(rule["alert"], rule)
    return first


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
    exprs = [rule["expr"].strip() for rule in alert_rules(name)]
    if not exprs:
        raise KeyError(name)
    expr = exprs[0] if len(exprs) == 1 else " or ".join(f"({e})" for e in exprs)
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
