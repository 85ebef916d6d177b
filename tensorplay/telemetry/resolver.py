"""Finishes hook records off the training thread: resolves timings, ends spans, feeds metrics.

Every traced call is counted as pending from the moment it starts; its record arrives here when
the hook's future completes. CUDA timings and figures are resolved here (waiting on events is
fine on this thread), so the training thread never synchronizes the device; CPU records take
the same path and are finished before DDP sees their future complete. :func:`flush` waits
until every pending call has been finished.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from opentelemetry import trace

from .figures import to_number
from .names import Attr
from .recorder import BucketRecord
from .timing import seconds_between

__all__ = ["Resolver", "resolver", "flush"]

# How long a CPU hook future waits for its record to be finished before going on regardless.
_CPU_HANDOFF_TIMEOUT_S = 5.0

_logger = logging.getLogger(__name__)


class Resolver:
    """A daemon thread that finishes :class:`BucketRecord` s in the order they complete."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[BucketRecord, threading.Event | None]] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def started(self) -> None:
        """Count one traced call as pending (call it before the hook runs)."""
        with self._idle:
            self._pending += 1

    def abandoned(self) -> None:
        """Un-count a pending call whose hook raised before returning a future."""
        self._done()

    def submit(self, record: BucketRecord) -> None:
        """Hand over a record whose hook future completed, to be finished on this thread.

        A CUDA record may wait for its events here, so the caller goes on at once and the span
        ends later. A CPU record holds clock readings and numbers only: the caller waits (briefly)
        until it is finished, so the span has ended by the time DDP sees the hook's future
        complete, and the CPU path runs through the very same thread and queue as the CUDA one.
        """
        if self._thread is None:
            self._start()
        finished = threading.Event() if record.device.type == "cpu" else None
        self._queue.put((record, finished))
        if finished is not None and not finished.wait(_CPU_HANDOFF_TIMEOUT_S):
            _logger.warning("tensorplay: a hook record is finishing late; training goes on")

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

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tensorplay-resolver", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            record, finished = self._queue.get()
            try:
                finish(record)
            except Exception:
                _logger.warning("tensorplay: could not finish a hook record; training goes on", exc_info=True)
                _count_failure(record)
            finally:
                if finished is not None:
                    finished.set()
                self._done()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()


def _count_failure(record: BucketRecord) -> None:
    """Count a record that could not be finished, unless counting fails too (the thread lives on)."""
    try:
        if record.metrics is not None:
            record.metrics.count_error(record.rank, "resolver")
    except Exception:
        _logger.debug("tensorplay: could not count a resolver failure", exc_info=True)


def latency_seconds(record: BucketRecord) -> float:
    """Launch of the first reported collective to completion of the last.

    A hook that reports no collectives (a user's own hook) is timed from its call to its
    future's completion; a tensorplay hook that launched none (``noop_hook``) took no time.
    """
    if record.launches:
        end = record.end_stamp()
        return seconds_between(record.launches[0], end) if end is not None else 0.0
    if record.reports_collectives or record.completed is None:
        return 0.0
    return seconds_between(record.called, record.completed)


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


def finish(record: BucketRecord) -> None:
    """Resolve ``record`` and emit its span attributes, span end and metric observations."""
    latency = latency_seconds(record)
    stages = record.stages
    nonfinite = sum(int(to_number(stage.nonfinite)) for stage in stages)
    # What the first stage compressed is the bucket as DDP handed it over.
    bucket_nonfinite = int(to_number(stages[0].input_nonfinite)) if stages else None
    errors = [to_number(stage.relative_error) for stage in stages if stage.relative_error is not None]
    # Stages compose (a wrapper around a compressing hook): their relative errors add up, which
    # bounds the end-to-end error to first order (triangle inequality). One stage is exact.
    relative_error = float(sum(errors)) if stages and len(errors) == len(stages) else None
    compute = _compute_seconds(record)

    span = record.span
    exemplar = _exemplar(span)
    if span.is_recording():
        attributes = {
            Attr.HOOK: record.hook,
            Attr.RANK: record.rank,
            Attr.WORLD_SIZE: record.world_size,
            Attr.STEP: record.step,
            Attr.BUCKET_INDEX: record.bucket_index,
            Attr.BUCKET_NUMEL: record.numel,
            Attr.BUCKET_BYTES: record.bytes,
            Attr.BUCKET_WIRE_BYTES: wire_bytes(record),
            Attr.BUCKET_DTYPE: record.dtype,
            Attr.COMPRESSION_NONFINITE: nonfinite,
            Attr.ALLREDUCE_LATENCY_MS: latency * 1e3,
            Attr.ALLREDUCE_COUNT: collective_count(record),
        }
        if stages:
            attributes[Attr.COMPRESSION_DTYPE] = "+".join(stage.kind for stage in stages)
            attributes[Attr.BUCKET_NONFINITE] = bucket_nonfinite
            if relative_error is not None:
                attributes[Attr.COMPRESSION_RELATIVE_ERROR] = relative_error
        span.set_attributes(attributes)
        if record.failed:
            span.set_status(trace.Status(trace.StatusCode.ERROR, "tensorplay telemetry incomplete"))
        end = record.completed.unix_ns if record.completed is not None else None
        span.end(end_time=end)

    metrics = record.metrics
    if metrics is None:
        return
    rank = str(record.rank)
    metrics.allreduce_latency.labels(rank=rank, hook=record.hook).observe(latency, exemplar)
    metrics.bucket_bytes.labels(rank=rank, hook=record.hook).inc(record.bytes)
    metrics.wire_bytes.labels(rank=rank, hook=record.hook).inc(wire_bytes(record))
    metrics.nonfinite.labels(rank=rank, hook=record.hook).inc(nonfinite)
    if bucket_nonfinite is not None:
        metrics.bucket_nonfinite.labels(rank=rank, hook=record.hook).inc(bucket_nonfinite)
    if relative_error is not None:
        metrics.compression_error.labels(rank=rank, hook=record.hook).observe(relative_error)
    if compute is not None:
        metrics.step_compute.labels(rank=rank).observe(compute)
    metrics.last_step_timestamp.labels(rank=rank).set(record.called.unix_ns / 1e9)


def _compute_seconds(record: BucketRecord) -> float | None:
    previous = record.previous_step_end
    if previous is None:
        return None
    end = previous.end_stamp()
    return seconds_between(end, record.called) if end is not None else None


def _exemplar(span: trace.Span) -> dict[str, str] | None:
    if not span.is_recording():
        return None
    context = span.get_span_context()
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}


_resolver = Resolver()


def resolver() -> Resolver:
    """The process's resolver."""
    return _resolver


def flush(timeout: float | None = 30.0) -> bool:
    """Wait until every traced hook call so far has its span ended and metrics recorded."""
    return _resolver.flush(timeout)
