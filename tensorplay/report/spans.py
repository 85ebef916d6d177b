"""Read tensorplay's spans from JSON-lines files into compact columns, saying what could not be read.

The files are what :class:`tensorplay.telemetry.tracing.JsonLinesSpanExporter` writes: one
OpenTelemetry span per line (``ReadableSpan.to_json``), from any number of ranks, in any number
of files. Only tensorplay's spans are kept, as arrays rather than dicts (a run of 64 ranks x
1,000 steps x 10 buckets is 640,000 spans). Reading never stops at bad input: a line that is not
JSON (a truncated last line when a job was killed), a tensorplay span of a shape this version
does not know, is skipped and described in :attr:`Spans.problems`.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from tensorplay.telemetry.names import HOOK_SPAN_NAME, JOIN_SPAN_NAME, Attr

__all__ = ["HookSpans", "JoinSpan", "Spans", "NoSpans", "span_files", "read_spans"]

_TENSORPLAY_PREFIX = "tensorplay."
_HOOK_INTS = (Attr.RANK, Attr.STEP, Attr.BUCKET_INDEX, Attr.BUCKET_BYTES, Attr.BUCKET_WIRE_BYTES,
              Attr.COMPRESSION_NONFINITE)
_HOOK_FLOATS = (Attr.ALLREDUCE_LATENCY_MS,)
_JOIN_INTS = (Attr.RANK, Attr.JOIN_SHADOW_ITERATIONS)
_JOIN_FLOATS = (Attr.JOIN_WAIT_MS,)


class NoSpans(Exception):
    """There is nothing to draw: the path is missing, or holds no readable tensorplay span."""


@dataclass
class HookSpans:
    """Every ``tensorplay.comm_hook`` span, one array element each; times in unix seconds."""

    rank: np.ndarray
    step: np.ndarray
    bucket: np.ndarray
    start_s: np.ndarray
    end_s: np.ndarray
    latency_ms: np.ndarray
    bucket_bytes: np.ndarray
    wire_bytes: np.ndarray
    relative_error: np.ndarray
    """NaN where the error was not sampled (or the hook does not compress)."""
    nonfinite: np.ndarray
    """Elements compression made non-finite."""
    bucket_nonfinite: np.ndarray
    """Non-finite elements that reached a compressing hook; 0 for hooks that do not compress."""
    hook: np.ndarray
    """Index into :attr:`hook_names`."""
    hook_names: list[str]

    def __len__(self) -> int:
        return len(self.rank)


@dataclass(frozen=True)
class JoinSpan:
    """One rank's ``tensorplay.join`` span: from running out of inputs until all ranks joined."""

    rank: int
    start_s: float
    end_s: float
    shadow_iterations: int
    wait_ms: float
    last_joiner: bool


@dataclass
class Spans:
    """What was read, and what could not be."""

    hooks: HookSpans
    joins: list[JoinSpan]
    files: list[Path]
    problems: list[str] = field(default_factory=list)


def span_files(source: Path) -> list[Path]:
    """The span files of ``source``: the file itself, or every ``*.jsonl`` in the directory."""
    if not source.exists():
        raise NoSpans(f"{source} does not exist")
    if source.is_file():
        return [source]
    files = sorted(path for path in source.glob("*.jsonl") if path.is_file())
    if not files:
        raise NoSpans(f"no span files (*.jsonl) in {source}; a run writes them with "
                      "configure_tracing(span_file=...) or tensorplay demo --run-dir")
    return files


def _unix_seconds(iso: str) -> float:
    # Python 3.10's fromisoformat does not take the trailing "Z" OpenTelemetry writes.
    return datetime.fromisoformat(iso[:-1] + "+00:00" if iso.endswith("Z") else iso).timestamp()


class _Columns:
    """Accumulates hook spans as typed arrays while the files are read."""

    _INTS = ("rank", "step", "bucket", "bucket_bytes", "wire_bytes", "nonfinite", "bucket_nonfinite", "hook")
    _FLOATS = ("start_s", "end_s", "latency_ms", "relative_error")

    def __init__(self) -> None:
        self._ints = [array("q") for _ in self._INTS]
        self._floats = [array("d") for _ in self._FLOATS]
        self._hook_names: dict[str, int] = {}

    def add(self, span: dict[str, Any], attributes: dict[str, Any]) -> None:
        """Append one hook span; every value is converted before any column grows."""
        hook = str(attributes[Attr.HOOK])
        ints = (attributes[Attr.RANK], attributes[Attr.STEP], attributes[Attr.BUCKET_INDEX],
                attributes[Attr.BUCKET_BYTES], attributes[Attr.BUCKET_WIRE_BYTES],
                attributes[Attr.COMPRESSION_NONFINITE], _int(attributes.get(Attr.BUCKET_NONFINITE, 0)),
                self._hook_names.get(hook, len(self._hook_names)))
        floats = (_unix_seconds(span["start_time"]), _unix_seconds(span["end_time"]),
                  float(attributes[Attr.ALLREDUCE_LATENCY_MS]),
                  float(attributes.get(Attr.COMPRESSION_RELATIVE_ERROR, float("nan"))))
        if min(ints) < 0 or max(ints) >= 2**63:
            raise ValueError("an integer attribute is negative or does not fit 64 bits")
        self._hook_names.setdefault(hook, len(self._hook_names))
        for column, value in zip(self._ints, ints):
            column.append(value)
        for column, value in zip(self._floats, floats):
            column.append(value)

    def finish(self) -> HookSpans:
        arrays = {name: np.array(column, dtype=np.int64) for name, column in zip(self._INTS, self._ints)}
        arrays |= {name: np.array(column, dtype=np.float64) for name, column in zip(self._FLOATS, self._floats)}
        return HookSpans(**arrays, hook_names=list(self._hook_names))


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _wrong_type(attributes: dict[str, Any], ints: Iterable[str], floats: Iterable[str]) -> str | None:
    """The first attribute that is missing or of the wrong type, or None if all are right."""
    for name in ints:
        value = attributes.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"an integer in {name}"
    for name in floats:
        value = attributes.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"a number in {name}"
    return None


class _FileProblems:
    """Counts one file's skipped lines by kind, remembering the first of each, for one message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kinds: dict[str, tuple[int, int, str]] = {}

    def add(self, kind: str, line: int, detail: str = "") -> None:
        count, first, first_detail = self.kinds.get(kind, (0, line, detail))
        self.kinds[kind] = (count + 1, first, first_detail)

    def messages(self) -> list[str]:
        out = []
        for kind, (count, first, detail) in self.kinds.items():
            detail = f": {detail}" if detail else ""
            where = f"line {first}: {kind}" if count == 1 else f"{count} lines: {kind}, the first line {first}"
            out.append(f"{self.path.name}: {where}{detail}; skipped")
        return out


_MARKER = _TENSORPLAY_PREFIX.encode()


def _read_file(path: Path, columns: _Columns, joins: list[JoinSpan], problems: list[str]) -> None:
    file_problems = _FileProblems(path)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if _MARKER not in raw:
                continue  # blank, or another library's span: not ours to judge
            try:
                span = json.loads(raw)
            except ValueError:
                # Only the last line can lack its newline: the writer was stopped in the middle of it.
                truncated = not raw.endswith(b"\n")
                file_problems.add("the last line is truncated (was the job killed?)" if truncated else "not JSON",
                                  number)
                continue
            problem = _add_span(span, columns, joins)
            if problem is not None:
                file_problems.add("spans of an unknown version", number, problem)
    problems += file_problems.messages()


def _add_span(span: Any, columns: _Columns, joins: list[JoinSpan]) -> str | None:
    """Add one parsed span; return what makes it unreadable, or None."""
    if not isinstance(span, dict) or not isinstance(span.get("attributes"), dict):
        return "not an OpenTelemetry span as JsonLinesSpanExporter writes it"
    name, attributes = span.get("name"), span["attributes"]
    if name not in (HOOK_SPAN_NAME, JOIN_SPAN_NAME):
        if isinstance(name, str) and name.startswith(_TENSORPLAY_PREFIX):
            return f"a span named {name!r}"
        return None  # the application's own span
    hook = name == HOOK_SPAN_NAME
    wrong = _wrong_type(attributes, _HOOK_INTS if hook else _JOIN_INTS, _HOOK_FLOATS if hook else _JOIN_FLOATS)
    if wrong is not None:
        return f"{name} without {wrong}"
    try:
        if hook:
            columns.add(span, attributes)
        else:
            joins.append(JoinSpan(
                rank=attributes[Attr.RANK],
                start_s=_unix_seconds(span["start_time"]),
                end_s=_unix_seconds(span["end_time"]),
                shadow_iterations=attributes[Attr.JOIN_SHADOW_ITERATIONS],
                wait_ms=float(attributes[Attr.JOIN_WAIT_MS]),
                last_joiner=bool(attributes.get(Attr.JOIN_LAST_JOINER, False)),
            ))
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as error:
        return f"{name}: {type(error).__name__}: {error}"
    return None


def read_spans(source: Path) -> Spans:
    """Read every tensorplay span under ``source`` (a span file or a run directory).

    Raises :class:`NoSpans` when there is nothing to draw; anything less is a problem listed in
    the result and the rest is read.
    """
    files = span_files(source)
    columns, joins, problems = _Columns(), [], []
    for path in files:
        _read_file(path, columns, joins, problems)
    hooks = columns.finish()
    if not len(hooks) and not joins:
        raise NoSpans("; ".join(problems) if problems else
                      f"no tensorplay spans in {', '.join(str(path) for path in files)}")
    return Spans(hooks, joins, files, problems)
