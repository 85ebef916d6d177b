"""A small PromQL reader for the dashboard and rule tests.

:func:`parse` turns an expression into a tree (:class:`Vector`, :class:`Subquery`,
:class:`Aggregate`, :class:`Call`, :class:`Binary`, :class:`Unary`, :class:`Literal`); Grafana
variables such as ``$topk`` or ``$__range`` are read as literals, so a dashboard's raw query parses
as it is. On that tree:

- :func:`selectors` lists the series an expression reads, with their label matchers and range;
- :func:`per_rank_selectors` lists the selectors whose ``rank`` label reaches the result with
  nothing to bound it: neither aggregated away nor cut to the ``$topk`` worst ranks. A panel
  query with such a selector draws one series per rank of the job unless the selector itself
  picks ranks (``rank=~"$rank"``);
- :func:`rankings` lists the ``topk``/``bottomk`` of an expression and whether what they rank is
  pinned to one instant (``@ end()``), which a range query needs to keep the same ranks at every
  step.

It knows the whole PromQL grammar that Prometheus 2.x evaluates (selectors, ranges, subqueries,
``offset``, ``@``, functions, aggregations with ``by``/``without`` before or after their
arguments, binary operators with ``bool``, ``on``/``ignoring`` and ``group_left``/``group_right``,
operator precedence) and nothing of what a query means beyond the labels it keeps.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Union

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

_AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
}
_SCALAR_FUNCTIONS = {"time", "scalar", "pi"}
_NO_SERIES_FUNCTIONS = _SCALAR_FUNCTIONS | {"vector", "absent", "absent_over_time"}
_PRECEDENCE = {
    "or": 1,
    "and": 2, "unless": 2,
    "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3,
    "+": 4, "-": 4,
    "*": 5, "/": 5, "%": 5, "atan2": 5,
    "^": 6,
}
_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)
  | (?P<number>0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<variable>\$\{?\w+(?::\w+)?\}?)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],@:])
    """,
    re.VERBOSE,
)


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if not match:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        if match.lastgroup != "space":
            tokens.append((match.lastgroup, match.group()))
        pos = match.end()
    return tokens


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    return json.loads('"' + text[1:-1].replace('\\"', '"').replace('"', '\\"') + '"')


class _Parser:
    """Precedence climbing over the tokens of one expression."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.tokens = _tokens(expr)
        self.pos = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"{what} at token {self.pos} of {self.expr!r}")

    def peek(self, ahead: int = 0) -> tuple[str, str]:
        index = self.pos + ahead
        return self.tokens[index] if index < len(self.tokens) else ("end", "")

    def take(self, expected: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token[0] == "end" or (expected is not None and token[1] != expected):
            raise self.error(f"expected {expected or 'more'}, found {token[1]!r}")
        self.pos += 1
        return token

    def parse(self) -> Node:
        node = self.binary(1)
        if self.peek()[0] != "end":
            raise self.error(f"unexpected {self.peek()[1]!r}")
        return node

    def binary(self, lowest: int) -> Node:
        node = self.unary()
        while True:
            op = self.peek()[1]
            precedence = _PRECEDENCE.get(op)
            if precedence is None or precedence < lowest or self.peek()[0] not in ("op", "ident"):
                return node
            self.take()
            if self.peek()[1] == "bool":
                self.take()
            on = ignoring = group = None
            if self.peek()[1] in ("on", "ignoring"):
                keyword = self.take()[1]
                labels = self.label_list()
                on, ignoring = (labels, None) if keyword == "on" else (None, labels)
            if self.peek()[1] in ("group_left", "group_right"):
                group = self.take()[1].removeprefix("group_")
                if self.peek()[1] == "(":
                    self.label_list()
            # ^ is right-associative; every other operator left-associative.
            rhs = self.binary(precedence if op == "^" else precedence + 1)
            node = Binary(op, node, rhs, on, ignoring, group)

    def unary(self) -> Node:
        if self.peek()[1] in ("-", "+"):
            op = self.take()[1]
            return Unary(op, self.binary(_PRECEDENCE["^"]))
        return self.postfix(self.primary())

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        labels = []
        while self.peek()[1] != ")":
            labels.append(self.take()[1])
            if self.peek()[1] == ",":
                self.take()
        self.take(")")
        return tuple(labels)

    def primary(self) -> Node:
        kind, text = self.peek()
        if text == "(":
            self.take()
            node = self.binary(1)
            self.take(")")
            return node
        if text == "{":
            raise self.error("selector without a metric name")
        if kind in ("number", "string", "variable", "duration"):
            self.take()
            return Literal(text)
        if kind != "ident":
            raise self.error("unexpected end" if kind == "end" else f"unexpected {text!r}")
        if text.lower() in ("inf", "nan"):
            self.take()
            return Literal(text)
        following = self.peek(1)[1]
        if text in _AGGREGATIONS and following in ("(", "by", "without"):
            return self.aggregate()
        if following == "(":
            self.take()
            return Call(text, self.arguments())
        return self.selector()

    def arguments(self) -> tuple[Node, ...]:
        self.take("(")
        args = []
        while self.peek()[1] != ")":
            args.append(self.binary(1))
            if self.peek()[1] == ",":
                self.take()
        self.take(")")
        return tuple(args)

    def aggregate(self) -> Aggregate:
        op = self.take()[1]
        grouping, without = None, False
        if self.peek()[1] in ("by", "without"):
            without = self.take()[1] == "without"
            grouping = self.label_list()
        args = self.arguments()
        if grouping is None and self.peek()[1] in ("by", "without"):
            without = self.take()[1] == "without"
            grouping = self.label_list()
        param, expr = (args[0], args[1]) if len(args) == 2 else (None, args[0])
        return Aggregate(op, grouping, without, param, expr)

    def selector(self) -> Vector:
        metric = self.take()[1]
        matchers: dict[str, tuple[str, str]] = {}
        if self.peek()[1] == "{":
            self.take()
            while self.peek()[1] != "}":
                label, op, value = self.take()[1], self.take()[1], self.take()
                if value[0] != "string":
                    raise self.error(f"bad matcher {label}{op}{value[1]}")
                matchers[label] = (op, _unquote(value[1]))
                if self.peek()[1] == ",":
                    self.take()
            self.take("}")
        return Vector(Selector(metric, matchers, None))

    def postfix(self, node: Node) -> Node:
        while True:
            text = self.peek()[1]
            if text == "[":
                self.take()
                parts = []
                while self.peek()[1] != "]":
                    parts.append(self.take()[1])
                self.take("]")
                window = "".join(parts)
                if isinstance(node, Vector) and node.selector.range is None and ":" not in window:
                    node = Vector(node.selector._replace(range=window), node.at)
                else:
                    node = Subquery(node, window)
            elif text == "offset":
                self.take()
                if self.peek()[1] == "-":
                    self.take()
                self.take()
            elif text == "@":
                self.take()
                at = self.take()[1]
                if at in ("start", "end"):
                    self.take("(")
                    self.take(")")
                    at += "()"
                if isinstance(node, Vector):
                    node = Vector(node.selector, at)
                elif isinstance(node, Subquery):
                    node = Subquery(node.expr, node.range, at)
                else:
                    raise self.error("@ applies to a selector or a subquery only")
            else:
                return node


def parse(expr: str) -> Node:
    """Return the tree of a PromQL expression; raise ValueError on one it cannot read."""
    return _Parser(expr).parse()


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
