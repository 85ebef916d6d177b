"""Finishes hook records: resolves timings and figures, records metrics, hands spans to be ended.

Every traced call is counted as pending from the moment it starts until its span has ended (or
was dropped). A CPU record holds clock readings and numbers, so it is finished in the callback
that completes the hook's future: when DDP's wait returns, the metrics are recorded. A CUDA
record waits, on the event watcher's thread, for its events and figures to be ready; the
training thread never synchronizes the device. Spans are ended by the :class:`SpanEnder`,
never on the path DDP waits for. :func:`flush` waits until every pending call is finished.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .device_events import EventWatcher
from .figures import error_value, to_number
from .names import Attr
from .recorder import BucketRecord
from .spans import OwnedSpan, SpanEnd, SpanEnder
from .timing import Stamp, happened, seconds_between, unix_ns

__all__ = ["Resolver", "resolver", "flush"]

_logger = logging.getLogger(__name__)

# How long the exit hook waits for the spans of the last steps.
_EXIT_FLUSH_S = 5.0


@dataclass(frozen=True)
class Outcome:
    """The numbers of one finished hook call."""

    latency_s: float
    compute_s: float | None
    step_s: float | None
    """For a counted step's last bucket: the end of the previous step to the end of this one."""
    wire_bytes: int
    collectives: int
    nonfinite: int
    bucket_nonfinite: int | None
    relative_error: float | None
    end_unix_ns: int | None


class Resolver:
    """Turns completed records into metrics and spans, and knows how many are still pending."""

    def __init__(self) -> None:
        self._pending = 0
        self._idle = threading.Condition()
        self._ender = SpanEnder()
        self._watcher = EventWatcher()
        self._exit_flush_registered = False

    def start_afresh(self) -> None:
        """Forget every pending call and the threads: what a forked child must do.

        The parent's calls will never complete in the child and its threads did not come along;
        a lock the parent held at the fork would stay held for good. So the child gets a new
        count, condition, span ender and event watcher, as a fresh process would. The exit flush
        registered in the parent still runs, on this same object.
        """
        self._pending = 0
        self._idle = threading.Condition()
        self._ender = SpanEnder()
        self._watcher = EventWatcher()

    def started(self) -> None:
        """Count one traced call as pending (call it once its record exists)."""
        with self._idle:
            self._pending += 1
            if not self._exit_flush_registered:
                # Registered at the first traced call, after the application's tracer provider
                # exists, so it runs before that provider's own exit hook shuts its exporters.
                self._exit_flush_registered = True
                atexit.register(self.flush, _EXIT_FLUSH_S)

    def pending(self) -> int:
        """Traced calls whose span has not ended yet."""
        with self._idle:
            return self._pending

    def completed(self, record: BucketRecord) -> None:
        """The hook's future of ``record`` completed (with a value or an error): finish the record."""
        if record.device.type == "cuda":
            self._watcher.when(lambda: _events_happened(record), lambda: self._finish(record, wait=False))
        else:
            self._finish(record, wait=True)

    def abandoned(self, span: OwnedSpan, error: BaseException | None = None, incomplete: str | None = None) -> None:
        """End the span of a pending call that produced no record to finish (the hook raised, say)."""
        self._ender.submit(SpanEnd(span, error=error, incomplete=incomplete, then=self._done))

    def after_collective(self, end: Stamp, action: Callable[[], None]) -> None:
        """Run ``action`` once a collective's completion stamp ``end`` has happened."""
        if end.event is None:
            action()
        else:
            self._watcher.when(lambda: happened(end), action)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending call is finished; False if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def _finish(self, record: BucketRecord, wait: bool) -> None:
        job = SpanEnd(record.span, error=record.error, then=self._done, dropped=lambda: _count(record, "span_dropped"))
        try:
            outcome = resolve(record)
            observe(record, outcome)
            if record.span.is_recording:
                job.attributes = span_attributes(record, outcome)
            job.end_time = outcome.end_unix_ns
            if record.failures:
                job.incomplete = f"tensorplay telemetry incomplete ({', '.join(record.failures)})"
        except Exception:
            _logger.warning("tensorplay: could not finish a hook record; training goes on", exc_info=True)
            _count(record, "resolver")
            job.incomplete = "tensorplay could not finish this record"
        if not record.span.is_recording:  # no SDK records it: nothing to end, no thread to wait for
            self._done()
        elif self._ender.submit(job) and wait:
            self._ender.wait_briefly(job)

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()


def _events_happened(record: BucketRecord) -> bool:
    """Whether every CUDA event the record's numbers are read from has completed."""
    points = [record.called, record.ends.completed, *record.launches, *record.ends.stamps]
    points += [stage.ready for stage in record.stages if stage.ready is not None]
    for previous in (record.previous_step_end, record.step_start):
        if previous is not None and previous.last() is not None:
            points.append(previous.last())
    return all(happened(point) for point in points if point is not None)


def _count(record: BucketRecord, reason: str) -> None:
    """Count a telemetry problem of ``record``, unless counting fails too."""
    try:
        if record.metrics is not None:
            record.metrics.count_error(record.rank, reason)
    except Exception:
        _logger.debug("tensorplay: could not count %s", reason, exc_info=True)


def resolve(record: BucketRecord) -> Outcome:
    """Read the numbers of a completed record (on CUDA: once its events happened)."""
    stages = record.stages
    errors = [error_value(stage.relative_error) for stage in stages]
    completed = record.ends.completed
    return Outcome(
        latency_s=latency_seconds(record),
        compute_s=_compute_seconds(record),
        step_s=_step_seconds(record),
        wire_bytes=wire_bytes(record),
        collectives=collective_count(record),
        nonfinite=sum(int(to_number(stage.nonfinite)) for stage in stages),
        # What the first stage compressed is the bucket as DDP handed it over.
        bucket_nonfinite=int(to_number(stages[0].input_nonfinite)) if stages else None,
        # Stages compose (a wrapper around a compressing hook): their relative errors add up,
        # which bounds the end-to-end error to first order (triangle inequality). One stage is
        # exact. A stage without a finite figure leaves the call without one.
        relative_error=float(sum(errors)) if stages and None not in errors else None,  # type: ignore[arg-type]
        end_unix_ns=unix_ns(completed, record.called) if completed is not None else None,
    )


def latency_seconds(record: BucketRecord) -> float:
    """Launch of the first reported collective to completion of the last.

    A hook that reports no collectives (a user's own hook) is timed from its call to its
    future's completion; a tensorplay hook that launched none (``noop_hook``) took no time.
    """
    if record.launches:
        end = record.ends.last()
        return seconds_between(record.launches[0], end) if end is not None else 0.0
    if record.reports_collectives or record.ends.completed is None:
        return 0.0
    return seconds_between(record.called, record.ends.completed)


def collective_count(record: BucketRecord) -> int:
    """Collectives launched; a user's hook is assumed to have reduced its buffer once."""
    if record.reports_collectives:
        return len(record.launches)
    return 1


def wire_bytes(record: BucketRecord) -> int:
    """Bytes sent into collectives; for a user's hook, the buffer it was left holding."""
    if record.reports_collectives:
        return record.wire_bytes
    return record.returned_buffer_bytes if record.returned_buffer_bytes is not None else record.bytes


def span_attributes(record: BucketRecord, outcome: Outcome) -> dict[str, object]:
    """The contract's span attributes of one hook call."""
    attributes: dict[str, object] = {
        Attr.HOOK: record.hook,
        Attr.RANK: record.rank,
        Attr.WORLD_SIZE: record.world_size,
        Attr.STEP: record.step,
        Attr.BUCKET_INDEX: record.bucket_index,
        Attr.BUCKET_NUMEL: record.numel,
        Attr.BUCKET_BYTES: record.bytes,
        Attr.BUCKET_WIRE_BYTES: outcome.wire_bytes,
        Attr.BUCKET_DTYPE: record.dtype,
        Attr.COMPRESSION_NONFINITE: outcome.nonfinite,
        Attr.ALLREDUCE_LATENCY_MS: outcome.latency_s * 1e3,
        Attr.ALLREDUCE_COUNT: outcome.collectives,
        Attr.MODEL: record.model,
    }
    if record.stages:
        attributes[Attr.COMPRESSION_DTYPE] = "+".join(stage.kind for stage in record.stages)
        attributes[Attr.BUCKET_NONFINITE] = outcome.bucket_nonfinite
        if outcome.relative_error is not None:
            attributes[Attr.COMPRESSION_RELATIVE_ERROR] = outcome.relative_error
    return attributes


def observe(record: BucketRecord, outcome: Outcome) -> None:
    """Record the call's metric observations (nothing when metrics are off)."""
    metrics = record.metrics
    if metrics is None:
        return
    rank, hook = record.rank_label, record.hook_label
    metrics.allreduce_latency.labels(rank=rank, hook=hook).observe(outcome.latency_s, _exemplar(record.span))
    metrics.bucket_bytes.labels(rank=rank, hook=hook).inc(record.bytes)
    metrics.wire_bytes.labels(rank=rank, hook=hook).inc(outcome.wire_bytes)
    metrics.nonfinite.labels(rank=rank, hook=hook).inc(outcome.nonfinite)
    if outcome.bucket_nonfinite is not None:
        metrics.bucket_nonfinite.labels(rank=rank, hook=hook).inc(outcome.bucket_nonfinite)
    if outcome.relative_error is not None:
        metrics.compression_error.labels(rank=rank, hook=hook).observe(outcome.relative_error)
    if outcome.compute_s is not None:
        metrics.step_compute.labels(rank=rank).observe(outcome.compute_s)
    if outcome.step_s is not None:
        # The last bucket's wait is how long this rank stood at the step's end for the last of its
        # peers to arrive: what the peers did not wait for it (docs/telemetry.md, "Lateness").
        metrics.step_wait.labels(rank=rank, hook=hook).inc(outcome.latency_s)
        metrics.step_seconds.labels(rank=rank, hook=hook).inc(outcome.step_s)
        metrics.steps.labels(rank=rank, hook=hook).inc()


def _compute_seconds(record: BucketRecord) -> float | None:
    previous = record.previous_step_end
    if previous is None:
        return None
    end = previous.last()
    return seconds_between(end, record.called) if end is not None else None


def _step_seconds(record: BucketRecord) -> float | None:
    start = record.step_start.last() if record.step_start is not None else None
    end = record.ends.last()
    return seconds_between(start, end) if start is not None and end is not None else None


def _exemplar(span: OwnedSpan) -> dict[str, str] | None:
    if not span.is_recording:
        return None
    context = span.context
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}


_resolver = Resolver()


os.register_at_fork(after_in_child=_resolver.start_afresh)


def resolver() -> Resolver:
    """The process's resolver."""
    return _resolver


def flush(timeout: float | None = 30.0) -> bool:
    """Wait until every traced hook call so far has its metrics recorded and its span ended."""
    return _resolver.flush(timeout)
