"""The one reader of tensorplay's span files: compact columns keyed by rank, model, step and bucket.

Every figure derived from a run (:mod:`tensorplay.analysis`), the demo's table, ``tensorplay report``
and the tests read spans through it.

The files are what :class:`tensorplay.telemetry.tracing.JsonLinesSpanExporter` writes: one
OpenTelemetry span per line (``ReadableSpan.to_json``), from any number of ranks, in any number
of files. Only tensorplay's spans are kept, as arrays rather than dicts (a run of 64 ranks x
1,000 steps x 10 buckets is 640,000 spans). Reading never stops at bad input: a line that is not
JSON (a truncated last line when a job was killed), a tensorplay span of a shape this version
does not know, a span with values no run has, is skipped and described in :attr:`Spans.problems`.

Implausible values are those of a damaged line, which a report must not take for a run: a
negative count or index; a rank not below its job's world size (its resource's
``tensorplay.world_size``, which :func:`~tensorplay.telemetry.configure_tracing` sets; the span's
own attribute is the hook's process group's, which a DDP over a subgroup has global ranks beyond);
and a step, bucket index or model index beyond :data:`IMPLAUSIBLE_SPREAD` times the median of all
the run's hook spans plus :data:`IMPLAUSIBLE_SLACK` -- the report lays out steps x buckets per rank,
so one line claiming step 10^9 would otherwise have it allocate tens of GiB. Steps and buckets of
a run are spread evenly from 0, so their median is about half their largest value: only a line
far beyond all the others meets the bound. The optimizer step counts spans carry
(``tensorplay.optimizer.steps``, :class:`OptimizerSteps`) are bounded the same way, against their
own median.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import numpy as np

try:  # the report extra brings orjson: JSON parsing is most of the time a large run takes
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - the standard library parses the same lines, three times slower
    from json import loads as _fast_loads

from tensorplay.telemetry.names import ADVICE_SPAN_NAME, HOOK_SPAN_NAME, JOIN_SPAN_NAME, OPTIMIZER_STEP_SPAN_NAME, Attr, Candidate

__all__ = ["HookSpans", "JoinSpan", "AdviceSpan", "OptimizerSteps", "Spans", "NoSpans", "span_files", "read_spans",
           "merge_spans",
           "PARALLEL_BYTES", "IMPLAUSIBLE_SPREAD", "IMPLAUSIBLE_SLACK"]

PARALLEL_BYTES = 64 * 2**20
"""Runs with at least this much JSON are read by one process per core."""

IMPLAUSIBLE_SPREAD = 4
IMPLAUSIBLE_SLACK = 100
"""A hook span whose step, bucket index or model index is above ``IMPLAUSIBLE_SPREAD`` x the median
over the run's hook spans + ``IMPLAUSIBLE_SLACK`` is taken for a damaged line and skipped."""

_TENSORPLAY_PREFIX = "tensorplay."
_HOOK_INTS = (Attr.RANK, Attr.STEP, Attr.BUCKET_INDEX, Attr.BUCKET_BYTES, Attr.BUCKET_WIRE_BYTES,
              Attr.COMPRESSION_NONFINITE)
_HOOK_FLOATS = (Attr.ALLREDUCE_LATENCY_MS,)
_JOIN_INTS = (Attr.RANK, Attr.JOIN_SHADOW_ITERATIONS)
_JOIN_FLOATS = (Attr.JOIN_WAIT_MS,)
_ADVICE_INTS = (Attr.RANK, Attr.STEP, Attr.BUCKET_BYTES)


class NoSpans(Exception):
    """There is nothing to draw: the path is missing, or holds no readable tensorplay span."""


@dataclass
class HookSpans:
    """Every ``tensorplay.comm_hook`` span, one array element each; times in unix seconds."""

    rank: np.ndarray
    model: np.ndarray
    """Which of the traced hook's DDP models (``tensorplay.model``: 0, 1, ...) the bucket belongs to."""
    step: np.ndarray
    """The step of that model (each model counts its own)."""
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
    busy_ms: np.ndarray
    """On the span that closed its step (the step's last call to finish), the step's busy time:
    the previous step's last collective done to the step's last hook call. NaN on other spans."""
    exposed_communication_ms: np.ndarray
    """On the span that closed its step, the last hook call to the last hook future done; NaN elsewhere."""
    communication_ms: np.ndarray
    """On the span that closed its step, the time with one of its collectives in flight; NaN elsewhere."""
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


@dataclass(frozen=True)
class AdviceSpan:
    """One rank's ``tensorplay.advice`` span: what each candidate compression would have made of
    the gradients of one advised iteration (docs/telemetry.md, "What another hook would give")."""

    rank: int
    model: int
    step: int
    hook: str
    start_s: float
    end_s: float
    bucket_bytes: int
    """Bytes of the iteration's buckets as DDP handed them over."""
    candidates: dict[str, tuple[float, float, int]]
    """Candidate -> (error ratio, NaN where it was undefined or infinite; wire ratio; elements made non-finite)."""


@dataclass
class OptimizerSteps:
    """Where the spans count a traced model's optimizer steps (docs/telemetry.md, "Replicas"), a row each.

    The last hook span of each iteration a traced hook reduced gives the steps that updated its
    model before the iteration; the ``tensorplay.optimizer_step`` span of an optimizer step that
    updated a model with no reduction since its previous step (a bug) gives that model's steps up
    to it. Either may carry the rank's latest replica fingerprint and the step it was taken after.
    """

    rank: np.ndarray
    model: np.ndarray
    """Which traced model of its rank (``tensorplay.optimizer.model``: 0, 1, ... in the order first reduced)."""
    steps: np.ndarray
    """The model's optimizer steps counted so far: before the iteration, or up to and with the unreduced step."""
    unreduced: np.ndarray
    """True on the span of an unreduced step, False on a hook span."""
    fingerprint_step: np.ndarray
    """The step (per process, from 1) the fingerprint was taken after; -1 where the span carries none."""
    fingerprint: np.ndarray
    """-1 where the span carries none."""

    def __len__(self) -> int:
        return len(self.rank)


@dataclass
class Spans:
    """What was read, and what could not be."""

    hooks: HookSpans
    joins: list[JoinSpan]
    files: list[Path]
    problems: list[str] = field(default_factory=list)
    world_sizes: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per file name, each world size its spans say (their resource's ``tensorplay.world_size``, else
    their own) and how many spans say it; spans that say none are not counted."""
    advice: list[AdviceSpan] = field(default_factory=list)
    optimizer_steps: OptimizerSteps = field(default_factory=lambda: _merge_steps([]))


def span_files(source: Path) -> list[Path]:
    """The span files of ``source``: the file itself, or every ``*.jsonl`` in the directory."""
    if not source.exists():
        raise NoSpans(f"{source} does not exist")
    if source.is_file():
        return [source]
    files = sorted(path for path in source.glob("*.jsonl") if path.is_file())
    if not files:
        raise NoSpans(f"no span files (*.jsonl) in {source}; a run writes them with "
                      "configure_tracing(span_file='spans-rank{rank}.jsonl') or tensorplay demo --run-dir")
    return files


class _Clock:
    """Parses OpenTelemetry's ISO times (``2026-12-01T11:50:03.283301Z``) to unix seconds, fast.

    Spans of one run share few distinct seconds: each is parsed once, the fraction is added.
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    def unix_seconds(self, iso: str) -> float:
        second, rest = iso[:19], iso[19:]
        base = self._seconds.get(second)
        if base is None:
            base = self._seconds[second] = datetime.fromisoformat(second + "+00:00").timestamp()
        if rest == "Z":
            return base
        if rest[:1] == "." and rest[-1:] == "Z":
            return base + float(rest[:-1])
        # Python 3.10's fromisoformat does not take a trailing "Z"; other offsets it does.
        return datetime.fromisoformat(iso[:-1] + "+00:00" if iso.endswith("Z") else iso).timestamp()


# The hook span's attributes as module constants: they are looked up 640,000 times in a large run.
_HOOK, _RANK, _MODEL, _STEP, _BUCKET = Attr.HOOK, Attr.RANK, Attr.MODEL, Attr.STEP, Attr.BUCKET_INDEX
_BYTES, _WIRE_BYTES, _NONFINITE, _BUCKET_NONFINITE = (Attr.BUCKET_BYTES, Attr.BUCKET_WIRE_BYTES,
                                                      Attr.COMPRESSION_NONFINITE, Attr.BUCKET_NONFINITE)
_LATENCY, _ERROR, _NAN = Attr.ALLREDUCE_LATENCY_MS, Attr.COMPRESSION_RELATIVE_ERROR, float("nan")
_WORLD_SIZE = Attr.WORLD_SIZE
_BUSY, _EXPOSED, _COMMUNICATION = Attr.STEP_BUSY_MS, Attr.STEP_EXPOSED_COMMUNICATION_MS, Attr.STEP_COMMUNICATION_MS
_INT_COLUMNS = ("rank", "model", "step", "bucket", "bucket_bytes", "wire_bytes", "nonfinite", "bucket_nonfinite", "hook")
_FLOAT_COLUMNS = ("start_s", "end_s", "latency_ms", "relative_error", "busy_ms", "exposed_communication_ms",
                  "communication_ms")
_HOOK_COLUMN = _INT_COLUMNS.index("hook")
_READ_COLUMNS = (*_INT_COLUMNS, "world_size", "line")
"""A file's int rows as read: the columns kept, then the world size the span says and its line (for the checks)."""
_WORLD_COLUMN, _LINE_COLUMN = len(_INT_COLUMNS), len(_INT_COLUMNS) + 1
_SPREAD_COLUMNS = tuple(_INT_COLUMNS.index(name) for name in ("step", "bucket", "model"))
_ATTRIBUTE_OF = dict(zip(_READ_COLUMNS, (Attr.RANK, Attr.MODEL, Attr.STEP, Attr.BUCKET_INDEX, Attr.BUCKET_BYTES,
                                         Attr.BUCKET_WIRE_BYTES, Attr.COMPRESSION_NONFINITE, Attr.BUCKET_NONFINITE,
                                         Attr.HOOK, Attr.WORLD_SIZE)))
_OPTIMIZER_MODEL, _OPTIMIZER_STEPS = Attr.OPTIMIZER_MODEL, Attr.OPTIMIZER_STEPS
_FINGERPRINT, _FINGERPRINT_STEP = Attr.REPLICA_FINGERPRINT, Attr.REPLICA_FINGERPRINT_STEP
_STEP_COLUMNS = ("rank", "model", "steps", "unreduced", "fingerprint_step", "fingerprint")
_STEP_READ_COLUMNS = (*_STEP_COLUMNS, "line")
_STEP_COUNT, _STEP_LINE = _STEP_COLUMNS.index("steps"), len(_STEP_COLUMNS)
_STEP_INTS = (Attr.RANK, Attr.OPTIMIZER_MODEL, _OPTIMIZER_STEPS, Attr.OPTIMIZER_UNREDUCED)
_IMPLAUSIBLE = "implausible values (a damaged line?)"


class _Implausible(ValueError):
    """A span that parses, with a value no run has."""


@dataclass
class _FileSpans:
    """One file's spans: rows of int and float columns, hook names by index, joins, problems."""

    ints: np.ndarray
    """Rows of :data:`_READ_COLUMNS` as read; the columns of :data:`_INT_COLUMNS` once merged."""
    floats: np.ndarray
    hook_names: list[str]
    joins: list[JoinSpan]
    other_world_sizes: list[int]
    """The world size each join and optimizer step span says (0: none)."""
    problems: _FileProblems
    steps: np.ndarray
    """Rows of :data:`_STEP_READ_COLUMNS`: the optimizer step counts its spans carry."""
    advice: list[AdviceSpan] = field(default_factory=list)

    def world_sizes(self) -> dict[int, int]:
        """Each world size the file's spans say, and how many spans say it."""
        sizes, counts = np.unique(np.concatenate([self.ints[:, _WORLD_COLUMN], self.other_world_sizes]).astype(np.int64),
                                  return_counts=True)
        return {int(size): int(count) for size, count in zip(sizes, counts) if size > 0}


class _FileReader:
    """Reads one span file row by row into two typed arrays (ints, floats), skipping what it cannot read."""

    def __init__(self) -> None:
        self._ints = array("q")
        self._floats = array("d")
        self._hooks: dict[str, int] = {}
        self._joins: list[JoinSpan] = []
        self._steps = array("q")
        self._other_world_sizes: list[int] = []
        self._advice: list[AdviceSpan] = []
        self._clock = _Clock()

    def read(self, path: Path) -> _FileSpans:
        problems = _FileProblems(path)
        with path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                if _MARKER not in raw:
                    continue  # blank, or another library's span: not ours to judge
                try:
                    span = _loads(raw)
                except ValueError:
                    # Only the last line can lack its newline: the writer was stopped in the middle of it.
                    kind = "not JSON" if raw.endswith(b"\n") else "the last line is truncated (was the job killed?)"
                    problems.add(kind, number)
                    continue
                try:
                    problem = self._add(span, number)
                except _Implausible as implausible:
                    problems.add(_IMPLAUSIBLE, number, str(implausible))
                    continue
                if problem is not None:
                    problems.add("spans of an unknown version", number, problem)
        return _FileSpans(np.array(self._ints, dtype=np.int64).reshape(-1, len(_READ_COLUMNS)),
                          np.array(self._floats, dtype=np.float64).reshape(-1, len(_FLOAT_COLUMNS)),
                          list(self._hooks), self._joins, self._other_world_sizes, problems,
                          np.array(self._steps, dtype=np.int64).reshape(-1, len(_STEP_READ_COLUMNS)), self._advice)

    def _add(self, span: Any, line: int) -> str | None:
        """Add one parsed span; return what makes it unreadable, or None."""
        try:
            name, attributes = span["name"], span["attributes"]
            if name == HOOK_SPAN_NAME:
                self._add_hook(span, attributes, line)
            elif name == JOIN_SPAN_NAME:
                self._add_join(span, attributes)
            elif name == OPTIMIZER_STEP_SPAN_NAME:
                self._add_step(span, attributes, line)
            elif name == ADVICE_SPAN_NAME:
                self._add_advice(span, attributes)
            elif isinstance(name, str) and name.startswith(_TENSORPLAY_PREFIX):
                return f"a span named {name!r}"
            return None  # ours, or the application's own span
        except _Implausible:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError, IndexError) as error:
            return _describe(span, error)

    def _add_hook(self, span: dict[str, Any], attributes: dict[str, Any], line: int) -> None:
        """Append one row; every value is converted (and so checked) before either array grows.

        Negative values and values far beyond the run's others are found once every file is read
        (:func:`_drop_implausible`), with numpy; a rank beyond its job's world size here.
        """
        hook, hooks, clock, rank = attributes[_HOOK], self._hooks, self._clock.unix_seconds, attributes[_RANK]
        world_size = _world_size(span, attributes, rank)
        ints = array("q", (rank, attributes.get(_MODEL, 0), attributes[_STEP], attributes[_BUCKET], attributes[_BYTES],
                           attributes[_WIRE_BYTES], attributes[_NONFINITE], attributes.get(_BUCKET_NONFINITE, 0),
                           hooks.get(hook, len(hooks)), world_size, line))
        floats = array("d", (clock(span["start_time"]), clock(span["end_time"]), attributes[_LATENCY],
                             attributes.get(_ERROR, _NAN), attributes.get(_BUSY, _NAN), attributes.get(_EXPOSED, _NAN),
                             attributes.get(_COMMUNICATION, _NAN)))
        if not isinstance(hook, str):
            raise TypeError("a hook name that is not a string")
        steps = attributes.get(_OPTIMIZER_STEPS)
        step_row = None if steps is None else _step_row(rank, attributes, steps, False, line)
        hooks.setdefault(hook, len(hooks))
        self._ints.extend(ints)
        self._floats.extend(floats)
        if step_row is not None:
            self._steps.extend(step_row)

    def _add_join(self, span: dict[str, Any], attributes: dict[str, Any]) -> None:
        rank, shadowed = attributes[Attr.RANK], attributes[Attr.JOIN_SHADOW_ITERATIONS]
        wait_ms = attributes[Attr.JOIN_WAIT_MS]
        if not all(isinstance(value, int) for value in (rank, shadowed)) or not isinstance(wait_ms, (int, float)):
            raise TypeError("rank and shadow iterations must be integers, the wait a number")
        world_size = _world_size(span, attributes, rank)
        for name, value in ((Attr.RANK, rank), (Attr.JOIN_SHADOW_ITERATIONS, shadowed), (_WORLD_SIZE, world_size)):
            if value < 0:
                raise _Implausible(f"{name} = {value} < 0")
        self._joins.append(JoinSpan(rank, self._clock.unix_seconds(span["start_time"]),
                                    self._clock.unix_seconds(span["end_time"]), shadowed, float(wait_ms),
                                    bool(attributes.get(Attr.JOIN_LAST_JOINER, False))))
        self._other_world_sizes.append(world_size)

    def _add_step(self, span: dict[str, Any], attributes: dict[str, Any], line: int) -> None:
        """An unreduced optimizer step's span."""
        rank = attributes[_RANK]
        if isinstance(attributes[Attr.OPTIMIZER_UNREDUCED], bool) or not isinstance(attributes[Attr.OPTIMIZER_UNREDUCED], int):
            raise TypeError(f"{Attr.OPTIMIZER_UNREDUCED} is not an integer")
        row = _step_row(rank, attributes, attributes[_OPTIMIZER_STEPS], True, line)
        world_size = _world_size(span, attributes, rank)
        self._steps.extend(row)
        self._other_world_sizes.append(world_size)

    def _add_advice(self, span: dict[str, Any], attributes: dict[str, Any]) -> None:
        ints = [attributes[name] for name in _ADVICE_INTS]
        hook = attributes[Attr.HOOK]
        if not all(isinstance(value, int) and value >= 0 for value in ints) or not isinstance(hook, str):
            raise TypeError("rank, step and bytes must be whole numbers, the hook a name")
        candidates = {
            name: (float(attributes.get(Attr.ADVICE_ERROR_RATIO.format(candidate=name), _NAN)),
                   float(attributes[Attr.ADVICE_WIRE_RATIO.format(candidate=name)]),
                   int(attributes[Attr.ADVICE_NONFINITE.format(candidate=name)]))
            for name in Candidate.ALL
        }
        rank, step, bucket_bytes = ints
        self._advice.append(AdviceSpan(rank, int(attributes.get(Attr.MODEL, 0)), step, hook,
                                       self._clock.unix_seconds(span["start_time"]),
                                       self._clock.unix_seconds(span["end_time"]), bucket_bytes, candidates))


def _step_row(rank: int, attributes: dict[str, Any], steps: int, unreduced: bool, line: int) -> array:
    """A row of :data:`_STEP_READ_COLUMNS`, checked: whole numbers, a fingerprint with its step, none negative."""
    model = attributes[_OPTIMIZER_MODEL]
    for name, value in ((_RANK, rank), (_OPTIMIZER_MODEL, model), (_OPTIMIZER_STEPS, steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} is not an integer")
        if value < 0:
            raise _Implausible(f"{name} = {value} < 0")
    if (_FINGERPRINT in attributes) != (_FINGERPRINT_STEP in attributes):
        raise TypeError(f"{_FINGERPRINT} without {_FINGERPRINT_STEP}, or the other way round")
    row = array("q", (rank, model, steps, unreduced, attributes.get(_FINGERPRINT_STEP, -1),
                      attributes.get(_FINGERPRINT, -1), line))
    if min(row[4], row[5]) < -1 or (_FINGERPRINT in attributes and min(row[4], row[5]) < 0):
        raise _Implausible(f"a negative {_FINGERPRINT} or {_FINGERPRINT_STEP}")
    return row


def _world_size(span: dict[str, Any], attributes: dict[str, Any], rank: int) -> int:
    """The job's world size a span says: its resource's, else its own attribute's (the hook's group's); 0 if neither.

    A rank not below its resource's world size (the whole job's) is :class:`_Implausible`.
    """
    resource = span.get("resource")
    job = resource["attributes"].get(_WORLD_SIZE) if resource else None
    if job is None:
        return attributes.get(_WORLD_SIZE, 0)
    if rank >= job:
        raise _Implausible(f"{Attr.RANK} = {rank} in a job of {job} ranks (its resource's {_WORLD_SIZE})")
    return job



def _loads(raw: bytes) -> Any:
    try:
        return _fast_loads(raw)
    except ValueError:
        return json.loads(raw)  # NaN and Infinity, which Python writes and only its own parser reads


def _describe(span: Any, error: Exception) -> str:
    """Say what is wrong with a span that could not be read (the slow path: bad spans only)."""
    if not isinstance(span, dict) or not isinstance(span.get("attributes"), dict):
        return "not an OpenTelemetry span as JsonLinesSpanExporter writes it"
    name, attributes = span.get("name"), span["attributes"]
    ints, floats = {HOOK_SPAN_NAME: (_HOOK_INTS, _HOOK_FLOATS), ADVICE_SPAN_NAME: (_ADVICE_INTS, ()),
                    OPTIMIZER_STEP_SPAN_NAME: (_STEP_INTS, ())}.get(name, (_JOIN_INTS, _JOIN_FLOATS))
    wrong = _wrong_type(attributes, ints, floats)
    if wrong is not None:
        return f"{name} without {wrong}"
    return f"{name}: {type(error).__name__}: {error}"


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


_MARKER = _TENSORPLAY_PREFIX.encode()


class _FileProblems:
    """Counts one file's skipped lines by kind, remembering the first of each, for one message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kinds: dict[str, tuple[int, int, str]] = {}

    @property
    def name(self) -> str:
        return self.path.name

    def add(self, kind: str, line: int, detail: str = "", count: int = 1) -> None:
        """Count ``count`` lines of ``kind``, the first of them ``line``; the message names the earliest."""
        seen, first, first_detail = self.kinds.get(kind, (0, line, detail))
        if line < first:
            first, first_detail = line, detail
        self.kinds[kind] = (seen + count, first, first_detail)

    def messages(self) -> list[str]:
        out = []
        for kind, (count, first, detail) in self.kinds.items():
            detail = f": {detail}" if detail else ""
            where = f"line {first}: {kind}" if count == 1 else f"{count} lines: {kind}, the first line {first}"
            out.append(f"{self.path.name}: {where}{detail}; skipped")
        return out


def _read_file(path: Path) -> _FileSpans:
    return _FileReader().read(path)


def _read_files(files: list[Path]) -> list[_FileSpans]:
    """Read every file; large runs in parallel, one process per core (JSON parsing holds the GIL)."""
    workers = min(len(files), os.cpu_count() or 1)
    large = sum(path.stat().st_size for path in files) >= PARALLEL_BYTES
    if workers < 2 or not large or "fork" not in multiprocessing.get_all_start_methods():
        return [_read_file(path) for path in files]
    # fork: the workers need nothing imported again (spawn would import torch in each).
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_read_file, files))


def _drop_implausible(parts: list[_FileSpans]) -> None:
    """Skip and count, in each file, the spans with values no run has (the module's docstring says which)."""
    _drop_implausible_hooks(parts)
    _drop_implausible_step_counts(parts)


def _drop_implausible_hooks(parts: list[_FileSpans]) -> None:
    """Skip and count the hook spans with values no run has, and the optimizer step counts they carried."""
    if not any(len(part.ints) for part in parts):
        return
    spread = np.concatenate([part.ints[:, _SPREAD_COLUMNS] for part in parts])
    medians = np.median(spread, axis=0)
    limits = IMPLAUSIBLE_SPREAD * medians + IMPLAUSIBLE_SLACK
    for part in parts:
        rows = part.ints
        bad = (rows[:, :_LINE_COLUMN] < 0).any(axis=1) | (rows[:, _SPREAD_COLUMNS] > limits).any(axis=1)
        if not bad.any():
            continue
        lines = rows[bad, _LINE_COLUMN]
        first = int(np.argmin(lines))
        part.problems.add(_IMPLAUSIBLE, int(lines[first]), _why_implausible(rows[bad][first], medians, limits),
                          count=int(bad.sum()))
        part.ints, part.floats = rows[~bad], part.floats[~bad]
        part.steps = part.steps[~np.isin(part.steps[:, _STEP_LINE], lines)]


def _drop_implausible_step_counts(parts: list[_FileSpans]) -> None:
    """Skip and count the optimizer step counts far beyond the run's others, as for steps of hook spans."""
    counts = np.concatenate([np.zeros(0, np.int64)] + [part.steps[:, _STEP_COUNT] for part in parts])
    if not len(counts):
        return
    median = float(np.median(counts))
    limit = IMPLAUSIBLE_SPREAD * median + IMPLAUSIBLE_SLACK
    for part in parts:
        bad = part.steps[:, _STEP_COUNT] > limit
        if bad.any():
            first = int(np.argmin(part.steps[bad, _STEP_LINE]))
            part.problems.add(_IMPLAUSIBLE, int(part.steps[bad, _STEP_LINE][first]),
                              f"{_OPTIMIZER_STEPS} = {part.steps[bad, _STEP_COUNT][first]}, where the run's median is "
                              f"{median:g} (more than {IMPLAUSIBLE_SPREAD} x {median:g} + {IMPLAUSIBLE_SLACK} is taken "
                              f"for damage)", count=int(bad.sum()))
            part.steps = part.steps[~bad]


def _why_implausible(row: np.ndarray, medians: np.ndarray, limits: np.ndarray) -> str:
    """The first value of a row that :func:`_drop_implausible` skips, and why it is implausible."""
    for column, name in enumerate(_READ_COLUMNS[:_LINE_COLUMN]):
        if row[column] < 0:
            return f"{_ATTRIBUTE_OF[name]} = {row[column]} < 0"
    for column, median, limit in zip(_SPREAD_COLUMNS, medians, limits):
        if row[column] > limit:
            name = _ATTRIBUTE_OF[_READ_COLUMNS[column]]
            return (f"{name} = {row[column]}, where the run's median is {median:g} (more than "
                    f"{IMPLAUSIBLE_SPREAD} x {median:g} + {IMPLAUSIBLE_SLACK} is taken for damage)")
    return "values no run has"


def _merge(parts: list[_FileSpans]) -> HookSpans:
    """One set of columns from every file's rows, hook indices renumbered into one list of names.

    Columns of the rows beyond :data:`_INT_COLUMNS` (what only reading needs) are left out.
    """
    names: dict[str, int] = {}
    ints, floats = [], []
    for part in parts:
        renumber = np.array([names.setdefault(name, len(names)) for name in part.hook_names], dtype=np.int64)
        rows = part.ints[:, :len(_INT_COLUMNS)].copy()
        if len(rows):
            rows[:, _HOOK_COLUMN] = renumber[rows[:, _HOOK_COLUMN]]
        ints.append(rows)
        floats.append(part.floats)
    all_ints = np.concatenate(ints) if ints else np.zeros((0, len(_INT_COLUMNS)), np.int64)
    all_floats = np.concatenate(floats) if floats else np.zeros((0, len(_FLOAT_COLUMNS)))
    columns = {name: np.ascontiguousarray(all_ints[:, i]) for i, name in enumerate(_INT_COLUMNS)}
    columns |= {name: np.ascontiguousarray(all_floats[:, i]) for i, name in enumerate(_FLOAT_COLUMNS)}
    return HookSpans(**columns, hook_names=list(names))


def _merge_steps(parts: list[_FileSpans]) -> OptimizerSteps:
    """One set of optimizer step columns from every file's rows."""
    merged = np.concatenate([np.zeros((0, len(_STEP_READ_COLUMNS)), np.int64)] + [part.steps for part in parts])
    columns = {name: np.ascontiguousarray(merged[:, i]) for i, name in enumerate(_STEP_COLUMNS)}
    columns["unreduced"] = columns["unreduced"].astype(bool)
    return OptimizerSteps(**columns)


def read_spans(source: Path) -> Spans:
    """Read every tensorplay span under ``source`` (a span file or a run directory).

    Raises :class:`NoSpans` when there is nothing to draw; anything less is a problem listed in
    the result and the rest is read.
    """
    files = span_files(source)
    parts = _read_files(files)
    _drop_implausible(parts)
    world_sizes = {part.problems.name: part.world_sizes() for part in parts}
    hooks = _merge(parts)
    joins = [join for part in parts for join in part.joins]
    problems = [problem for part in parts for problem in part.problems.messages()]
    advice = [advice for part in parts for advice in part.advice]
    steps = _merge_steps(parts)
    if not len(hooks) and not joins and not len(steps):
        raise NoSpans("; ".join(problems) if problems else
                      f"no tensorplay spans in {', '.join(str(path) for path in files)}")
    return Spans(hooks, joins, files, problems, {name: sizes for name, sizes in world_sizes.items() if sizes}, advice,
                 steps)


def merge_spans(parts: list[Spans]) -> Spans:
    """One :class:`Spans` from several reads (each rank's own file, gathered over the process group)."""
    as_rows = [_FileSpans(np.stack([getattr(part.hooks, name) for name in _INT_COLUMNS], axis=1),
                          np.stack([getattr(part.hooks, name) for name in _FLOAT_COLUMNS], axis=1),
                          part.hooks.hook_names, part.joins, [], _FileProblems(Path()),
                          np.stack([getattr(part.optimizer_steps, name).astype(np.int64) for name in _STEP_COLUMNS]
                                   + [np.zeros(len(part.optimizer_steps), np.int64)], axis=1))
               for part in parts]
    return Spans(_merge(as_rows), [join for part in parts for join in part.joins],
                 [path for part in parts for path in part.files], [p for part in parts for p in part.problems],
                 {name: sizes for part in parts for name, sizes in part.world_sizes.items()},
                 [advice for part in parts for advice in part.advice], _merge_steps(as_rows))
