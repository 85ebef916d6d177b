"""What the dashboard and rule tests read of PromQL: the series a query reads and the labels it keeps.

:func:`parse` reads an expression with the ``promql-parser`` package (Prometheus' own grammar,
ported) and turns its tree into this module's small one (:class:`Vector`, :class:`Subquery`,
:class:`Aggregate`, :class:`Call`, :class:`Binary`, :class:`Unary`, :class:`Literal`). Grafana
variables such as ``$topk`` or ``$__range`` stand in as numbers and durations while it parses and
come back as literals, so a dashboard's raw query parses as it is. On that tree:

- :func:`selectors` lists the series an expression reads, with their label matchers and range;
- :func:`per_rank_selectors` lists the selectors whose ``rank`` label reaches the result with
  nothing to bound it: neither aggregated away nor cut to the ``$topk`` worst ranks. A panel
  query with such a selector draws one series per rank of the job unless the selector itself
  picks ranks (``rank=~"$rank"``);
- :func:`rankings` lists the ``topk``/``bottomk`` of an expression and whether what they rank is
  pinned to one instant (``@ end()``), which a range query needs to keep the same ranks at every
  step.

The grammar (precedence, ``by``/``without`` on either side, ``bool``, ``on``/``ignoring``,
``group_left``/``group_right``, subqueries, ``offset``, ``@``) is promql-parser's; this module
knows nothing of what a query means beyond the labels it keeps.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, NamedTuple, Union

import promql_parser

__all__ = [
    "Aggregate",
    "Binary",
    "Call",
    "Literal",
    "Node",
    "Ranking",
    "Selector",
    "Subquery",
    "Unary",
    "Vector",
    "parse",
    "per_rank_selectors",
    "rankings",
    "selectors",
    "walk",
]


class Selector(NamedTuple):
    """A vector selector of a query: metric name, label matchers ``{label: (op, value)}``, range."""

    metric: str
    matchers: dict[str, tuple[str, str]]
    range: str | None


@dataclass(frozen=True)
class Vector:
    """A vector or range selector; ``at`` is its ``@`` modifier (``end()``, a timestamp) or None."""

    selector: Selector
    at: str | None = None


@dataclass(frozen=True)
class Subquery:
    """``expr[range:step]``, with its ``@`` modifier."""

    expr: "Node"
    range: str
    at: str | None = None


@dataclass(frozen=True)
class Aggregate:
    """``op by (grouping) (param, expr)``; ``grouping`` None: no by/without (one series in all)."""

    op: str
    grouping: tuple[str, ...] | None
    without: bool
    param: "Node | None"
    expr: "Node"


@dataclass(frozen=True)
class Call:
    """A function call."""

    name: str
    args: tuple["Node", ...]


@dataclass(frozen=True)
class Binary:
    """``lhs op rhs`` with its vector matching: ``on`` / ``ignoring`` labels (None when absent) and
    ``group`` (``"left"``, ``"right"`` or None)."""

    op: str
    lhs: "Node"
    rhs: "Node"
    on: tuple[str, ...] | None = None
    ignoring: tuple[str, ...] | None = None
    group: str | None = None

    def matches_on(self, label: str) -> bool:
        """Whether ``label`` is one of the labels the two sides are matched on."""
        if self.on is not None:
            return label in self.on
        return label not in (self.ignoring or ())


@dataclass(frozen=True)
class Unary:
    """``-expr`` or ``+expr``."""

    op: str
    expr: "Node"


@dataclass(frozen=True)
class Literal:
    """A number, a string, or a Grafana variable standing for one (``$topk``)."""

    text: str

    @property
    def is_string(self) -> bool:
        return self.text[:1] in ("'", '"', "`")


Node = Union[Vector, Subquery, Aggregate, Call, Binary, Unary, Literal]

_SCALAR_FUNCTIONS = {"time", "scalar", "pi"}
_NO_SERIES_FUNCTIONS = _SCALAR_FUNCTIONS | {"vector", "absent", "absent_over_time"}

# Grafana variables outside string literals: `$topk`, `${topk}`, `$__range`, `[$__rate_interval]`.
_VARIABLE_OR_STRING = re.compile(r"""(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)|(?P<variable>\$\{?\w+(?::\w+)?\}?)""")
_NUMBER_BASE = 9_000_000_000  # stand-in numbers no real query uses ...
_DAYS_BASE = 70_000  # ... and stand-in durations (in days: some 190 years)
_MATCH_OPS = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}


class _Variables:
    """Stands Grafana variables in for numbers and durations promql-parser accepts, and back."""

    def __init__(self, expr: str) -> None:
        self.names: list[str] = []
        self.expr = _VARIABLE_OR_STRING.sub(self._stand_in, expr)

    def _stand_in(self, match: re.Match) -> str:
        if match.group("string") is not None:
            return match.group()
        self.names.append(match.group("variable"))
        index = len(self.names) - 1
        before = match.string[: match.start()].rstrip()
        return f"{_DAYS_BASE + index}d" if before.endswith(("[", ":")) else str(_NUMBER_BASE + index)

    def number(self, value: float) -> str:
        index = int(value) - _NUMBER_BASE
        if value == int(value) and 0 <= index < len(self.names):
            return self.names[index]
        return str(int(value)) if value == int(value) else repr(value)

    def duration(self, value: timedelta) -> str:
        index = value.days - _DAYS_BASE
        if 0 <= index < len(self.names):
            return self.names[index]
        return promql_parser.display_duration(value)


def _at(modifier: promql_parser.AtModifier | None) -> str | None:
    if modifier is None:
        return None
    if modifier.type == promql_parser.AtModifierType.End:
        return "end()"
    if modifier.type == promql_parser.AtModifierType.Start:
        return "start()"
    return str(modifier).removeprefix("@ ")


def _selector(node: promql_parser.VectorSelector, range_: str | None) -> Selector:
    if node.name is None:
        raise ValueError(f"a selector without a metric name: {node}")
    matchers = {m.name: (_MATCH_OPS[str(m.op).rpartition(".")[2]], m.value) for m in node.matchers.matchers}
    return Selector(node.name, matchers, range_)


def _node(node: promql_parser.Expr, variables: _Variables) -> Node:
    """The tree of this module for one node of promql-parser's."""
    def child(expr: promql_parser.Expr) -> Node:
        return _node(expr, variables)

    if isinstance(node, promql_parser.ParenExpr):
        return child(node.expr)
    if isinstance(node, promql_parser.VectorSelector):
        return Vector(_selector(node, None), _at(node.at))
    if isinstance(node, promql_parser.MatrixSelector):
        inner = node.vector_selector
        return Vector(_selector(inner, variables.duration(node.range)), _at(inner.at))
    if isinstance(node, promql_parser.SubqueryExpr):
        return Subquery(child(node.expr), variables.duration(node.range), _at(node.at))
    if isinstance(node, promql_parser.AggregateExpr):
        modifier = node.modifier
        grouping = tuple(modifier.labels) if modifier is not None else None
        without = modifier is not None and modifier.type == promql_parser.AggModifierType.Without
        param = child(node.param) if node.param is not None else None
        return Aggregate(str(node.op), grouping, without, param, child(node.expr))
    if isinstance(node, promql_parser.Call):
        return Call(node.func.name, tuple(child(arg) for arg in node.args))
    if isinstance(node, promql_parser.BinaryExpr):
        modifier = node.modifier
        on = ignoring = group = None
        if modifier is not None:
            if modifier.matching is not None:
                labels = tuple(modifier.matching.labels)
                include = modifier.matching.type == promql_parser.LabelModifierType.Include
                on, ignoring = (labels, None) if include else (None, labels)
            if modifier.card == promql_parser.VectorMatchCardinality.ManyToOne:
                group = "left"
            elif modifier.card == promql_parser.VectorMatchCardinality.OneToMany:
                group = "right"
        return Binary(str(node.op), child(node.lhs), child(node.rhs), on, ignoring, group)
    if isinstance(node, promql_parser.UnaryExpr):
        return Unary("-", child(node.expr))
    if isinstance(node, promql_parser.NumberLiteral):
        return Literal(variables.number(node.val))
    if isinstance(node, promql_parser.StringLiteral):
        return Literal(json.dumps(node.val))
    raise ValueError(f"no reading of {type(node).__name__}: {node}")


def parse(expr: str) -> Node:
    """Return the tree of a PromQL expression; raise ValueError on one it cannot read."""
    variables = _Variables(expr)
    return _node(promql_parser.parse(variables.expr), variables)


def walk(node: Node) -> Iterator[Node]:
    """Every node of a tree, parents before their children, left to right."""
    yield node
    if isinstance(node, Subquery | Unary):
        yield from walk(node.expr)
    elif isinstance(node, Aggregate):
        if node.param is not None:
            yield from walk(node.param)
        yield from walk(node.expr)
    elif isinstance(node, Call):
        for arg in node.args:
            yield from walk(arg)
    elif isinstance(node, Binary):
        yield from walk(node.lhs)
        yield from walk(node.rhs)


def selectors(expr: str) -> list[Selector]:
    """Return the vector selectors of a PromQL expression, in order. Raises ValueError on an
    expression it cannot read, and on a selector without a metric name (``{__name__=...}``),
    which the checks cannot follow."""
    return [node.selector for node in walk(parse(expr)) if isinstance(node, Vector)]


def _carries_rank(metric: str) -> bool:
    """Whether a series has a ``rank`` label: every tensorplay metric does; a recording rule does
    when its level (``job_rank_hook:...``) names it."""
    if metric.count(":") == 2:
        return "rank" in metric.split(":")[0].split("_")
    return True


def _is_scalar(node: Node) -> bool:
    if isinstance(node, Literal):
        return not node.is_string
    if isinstance(node, Call):
        return node.name in _SCALAR_FUNCTIONS
    if isinstance(node, Unary):
        return _is_scalar(node.expr)
    if isinstance(node, Binary):
        return _is_scalar(node.lhs) and _is_scalar(node.rhs)
    return False


def _keeps_label(aggregate: Aggregate, label: str) -> bool:
    if aggregate.grouping is None:
        return False
    return (label not in aggregate.grouping) if aggregate.without else (label in aggregate.grouping)


def _per_rank(node: Node, bound: str) -> list[Selector]:
    if isinstance(node, Vector):
        return [node.selector] if _carries_rank(node.selector.metric) else []
    if isinstance(node, Subquery | Unary):
        return _per_rank(node.expr, bound)
    if isinstance(node, Literal):
        return []
    if isinstance(node, Call):
        if node.name in _NO_SERIES_FUNCTIONS:
            return []
        return [s for arg in node.args for s in _per_rank(arg, bound)]
    if isinstance(node, Aggregate):
        if _keeps_label(node, "rank"):
            return _per_rank(node.expr, bound)
        if node.op in ("topk", "bottomk", "limitk"):
            # k series per group; without `rank` in the grouping that is k ranks -- if k is `bound`.
            bounded = isinstance(node.param, Literal) and node.param.text == bound
            return [] if bounded else _per_rank(node.expr, bound)
        return []
    lhs, rhs = _per_rank(node.lhs, bound), _per_rank(node.rhs, bound)
    if node.op == "or":
        return lhs + rhs
    if node.op == "unless":
        return lhs
    if node.op == "and":
        # Only the left side's series come through, and only those the right side matches.
        return [] if not rhs and node.matches_on("rank") else lhs
    if _is_scalar(node.lhs) or _is_scalar(node.rhs):
        return lhs + rhs
    if node.group == "left":
        return lhs
    if node.group == "right":
        return rhs
    # One-to-one: a result series needs a partner with the same matching labels on the other side.
    return [] if (not lhs or not rhs) and node.matches_on("rank") else lhs + rhs


def per_rank_selectors(expr: str, bound: str = "$topk") -> list[Selector]:
    """The selectors of ``expr`` whose ``rank`` label reaches its result unbounded.

    A selector's ranks are bounded when an aggregation takes ``rank`` away (``sum by (job)``,
    ``histogram_quantile`` over such a sum), when ``topk``/``bottomk`` with ``k = bound`` (the
    dashboards' ``$topk`` variable) keeps only that many ranks, or when its series only come
    through matched on ``rank`` against a bounded side (``x and on (job, rank) topk($topk, ...)``,
    one-to-one arithmetic). Series without a ``rank`` label (``job:...`` recordings) are bounded
    by the number of jobs. Whatever is returned draws one series per rank it selects.
    """
    return _per_rank(parse(expr), bound)


class Ranking(NamedTuple):
    """A ``topk``/``bottomk`` of an expression: its k as written, and whether every series it ranks
    is read at one pinned instant (``@``), so that a range query ranks once, not at every step."""

    op: str
    k: str
    pinned: bool


def rankings(expr: str) -> list[Ranking]:
    """Every ``topk``/``bottomk`` of ``expr``, outermost first."""
    found = []
    for node in walk(parse(expr)):
        if isinstance(node, Aggregate) and node.op in ("topk", "bottomk"):
            pinned = all(
                read.at is not None or _inside_pinned(read, node.expr)
                for read in walk(node.expr)
                if isinstance(read, Vector)
            )
            found.append(Ranking(node.op, node.param.text if isinstance(node.param, Literal) else "", pinned))
    return found


def _inside_pinned(target: Vector, root: Node) -> bool:
    """Whether ``target`` sits inside a subquery of ``root`` that has an ``@`` modifier."""
    return any(
        isinstance(node, Subquery) and node.at is not None and any(n is target for n in walk(node.expr))
        for node in walk(root)
    )
