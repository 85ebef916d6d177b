"""The last stage of a traced bucket: its span, its numbers, its metrics; and tensorplay's one thread.

A record reaches :meth:`Finisher.completed` from the callback that completes the hook's future
(on whichever thread torch completes it: gloo's, or the training thread when the collective had
completed before the hook chained on it). A CPU record is finished right there: its span is
started (with the parent and start time the training thread noted), :mod:`.outcome` reads its
numbers and writes the hook metrics (the latency with the span's IDs as exemplar), and the span
goes to the queue of tensorplay's thread. So metrics never wait for a span processor, and the
training thread starts no span unless the collective had already completed.

That one daemon thread, ``tensorplay-finisher``, does the rest of tensorplay's own work: it polls
(never waits on) the CUDA events a CUDA record's numbers are read from, then finishes it the same
way, and it ends every span tensorplay started -- hook spans and ``Join`` spans -- because span
processors run inside ``span.end()`` and an application's processor may export in line to a slow
or dead collector. It never completes a future and never runs a user's callback, so nothing a
user chained can wait on it. It has two queues. Spans to end are bounded: when that queue is
full a span is dropped and counted. CUDA records are never dropped, since each holds its metrics
and its collectives' place in the in-flight gauge: the thread finishes every record whose events
happened between two span ends, and when the records outnumber the spans' bound (a span
processor stuck in ``end()``), the thread that hands one over finishes those already done itself.

Every traced call is pending from the moment its record is handed over (its hook's future
completed, or the hook raised) until its span has ended (or was dropped); :func:`flush` waits
until nothing is. DDP's backward returns only once every bucket's future completed, so a flush
after it waits for every call of that backward. A hook that raised after launching collectives
hands its record over too: it is finished on the thread once they completed, and they stay in
flight until then.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from .metrics import rank_label
from .outcome import observe, outcome, span_attributes
from .recorder import BucketRecord
from .timing import happened

__all__ = ["OwnedSpan", "Finisher", "finisher", "flush", "wait_before_flush"]

_logger = logging.getLogger(__name__)

_EXIT_FLUSH_S = 5.0
"""How long the exit hook waits for the spans of the last steps."""

CAPACITY = 2048
"""Spans the thread may have waiting to end; beyond that a span is dropped and counted. Also the
number of CUDA records waiting beyond which the thread handing one over finishes those already done."""

SLOW_END_S = 0.1
"""An ``end()`` this long means a span processor that exports in line to somewhere slow (a healthy
batch processor only enqueues, in microseconds)."""

_FIRST_POLL_S = 0.0005
_SLOWEST_POLL_S = 0.01


class OwnedSpan:
    """A span that tensorplay ends exactly once, whatever happens in between.

    Either a started span (``Join``'s), or one still to start (:meth:`later`, a hook call's): the
    training thread takes only its parent context and start time, and the span is started, with
    that parent and time, where the record is finished (the thread that completed the hook's
    future). Starting an SDK span costs a thread about 10 us warm, and over 100 us after a
    backward pass has evicted the SDK's code and data from the caches (as the buckets of
    ``bench/training_thread_cost.py`` do).
    """

    __slots__ = ("_span", "_start", "_ended")

    def __init__(self, span: trace.Span | None = None) -> None:
        self._span = span
        self._start: tuple[trace.Tracer, str, Any, int] | None = None
        """(tracer, name, parent context, start time in Unix ns) of a span not started yet."""
        self._ended = False
        """Spans end on tensorplay's one thread only, so a flag (no lock) keeps it to once."""

    @classmethod
    def later(cls, tracer: trace.Tracer, name: str, start_unix_ns: int) -> "OwnedSpan":
        """A span named ``name``, child of the current context, begun at ``start_unix_ns``; started on first use."""
        owned = cls()
        owned._start = (tracer, name, otel_context.get_current(), start_unix_ns)
        return owned

    def _started(self) -> trace.Span:
        span = self._span
        if span is None:
            tracer, name, parent, start_unix_ns = self._start  # type: ignore[misc]
            span = self._span = tracer.start_span(name, context=parent, start_time=start_unix_ns)
            self._start = None
        return span

    @property
    def is_recording(self) -> bool:
        """Whether an SDK records this span (attributes are only built for such spans); starts it."""
        return self._started().is_recording()

    @property
    def context(self) -> trace.SpanContext:
        return self._started().get_span_context()

    def end(
        self,
        attributes: dict[str, Any] | None = None,
        end_time: int | None = None,
        error: BaseException | None = None,
        incomplete: str | None = None,
    ) -> None:
        """End the span (starting it first if it was not); later calls do nothing.

        ``error`` (the hook's or a collective's exception) is recorded and sets ERROR status;
        ``incomplete`` sets ERROR status with that description when telemetry itself failed.
        """
        if self._ended:
            return
        self._ended = True
        span = self._started()
        try:
            if span.is_recording():
                if attributes:
                    span.set_attributes(attributes)
                if error is not None:
                    span.record_exception(error)
                    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
                elif incomplete is not None:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, incomplete))
        finally:
            span.end(end_time=end_time)


@dataclass
class _SpanEnd:
    """A span to end on the thread (each one counted as pending until it has ended or was dropped)."""

    span: OwnedSpan
    attributes: dict[str, Any] | None = None
    end_time: int | None = None
    error: BaseException | None = None
    incomplete: str | None = None
    record: BucketRecord | None = None
    """The hook call whose span this is, if any: a drop is counted against it."""


class Finisher:
    """Finishes records, ends spans on its one thread, and knows how many calls are pending."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._pending = 0
        self._wake = threading.Condition()
        self._spans: deque[_SpanEnd] = deque()
        """Spans to end: at most ``capacity``."""
        self._records: deque[BucketRecord] = deque()
        """Records waiting for their events (CUDA) or collectives (a hook that raised): never dropped (see :meth:`_hold`)."""
        self._thread: threading.Thread | None = None
        self._exit_flush_registered = False
        self._slow_warned_at: float | None = None

    def start_afresh(self) -> None:
        """Forget every pending call and the thread: what a forked child must do.

        The parent's calls will never complete in the child and its thread did not come along;
        a lock the parent held at the fork would stay held for good. The exit flush registered
        in the parent still runs, on this same object.
        """
        self._pending = 0
        self._wake = threading.Condition()
        self._spans = deque()
        self._records = deque()
        self._thread = None

    # -- the training thread and the callbacks of futures --

    def _admit(self) -> None:
        """Count one job as pending: a record or span handed over, until its span has ended or was dropped.

        Counted when handed over, not when the hook is called: the training thread takes no lock
        for it, and by the time DDP's backward returns every record of it has been handed over.
        """
        with self._wake:
            self._pending += 1
            if not self._exit_flush_registered:
                # Registered at the first traced call, after the application's tracer provider
                # exists, so it runs before that provider's own exit hook shuts its exporters.
                self._exit_flush_registered = True
                atexit.register(self.flush, _EXIT_FLUSH_S)

    def completed(self, record: BucketRecord) -> None:
        """The hook's future of ``record`` completed (with a value or an error): finish the record.

        Called from the callback that completes the hook's future, on whichever thread torch
        completes it (gloo's, or the training thread when the collective had completed before the
        hook chained on it). A CPU record is finished right there, so its metrics never wait for
        a span processor; a CUDA record goes to the thread, which waits for its events.
        """
        self._admit()
        if record.device is not None:
            self._hold(record)
        else:
            self._finish(record)

    def raised(self, record: BucketRecord, error: BaseException) -> None:
        """The hook of ``record`` raised ``error``: its span ends with it.

        A record that launched collectives is finished on the thread once they all completed (on
        CUDA, once their events happened too): they stay in flight until then, and its metrics
        count what was sent. One that launched none only ends its span.
        """
        if not record.launches:
            self.abandoned(record.span, error=error)
            return
        record.error = record.error or error
        self._admit()
        self._hold(record)

    def abandoned(self, span: OwnedSpan, error: BaseException | None = None, incomplete: str | None = None) -> None:
        """End the span of a call that produced no record to finish (the hook raised before launching, say)."""
        self._admit()
        self._submit(_SpanEnd(span, error=error, incomplete=incomplete))

    def end_span(self, span: OwnedSpan, attributes: dict[str, Any], end_time: int | None = None) -> None:
        """End a span that belongs to no hook call (``Join``'s) on the thread; :func:`flush` waits for it too."""
        self._admit()
        self._submit(_SpanEnd(span, attributes=attributes, end_time=end_time))

    def pending(self) -> int:
        """Traced calls handed over (and ``Join`` spans) whose span has not ended yet."""
        with self._wake:
            return self._pending

    def waiting(self) -> int:
        """Jobs queued for the thread (spans to end, CUDA records waiting for their events)."""
        with self._wake:
            return len(self._spans) + len(self._records)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending call is finished; False if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._wake.wait(remaining)
        return True

    def _finish(self, record: BucketRecord) -> None:
        """Start the span, read the numbers, write the metrics, and end the span on the thread.

        The span is started first (on this thread, with the parent and start time the training
        thread noted) so that the latency observation carries its IDs as exemplar. On the
        thread (CUDA records) the span is ended at once, elsewhere it is queued for the thread.
        """
        job = _SpanEnd(record.span, error=record.error, record=record)
        record.collectives_seen_done()  # on CUDA, the in-flight gauge waited for their events
        recording = False
        try:
            recording = record.span.is_recording
            numbers = outcome(record)
            observe(record, numbers, record.span if recording else None)
            if recording:
                job.attributes = span_attributes(record, numbers)
            job.end_time = numbers.end_unix_ns
            if record.failures:
                job.incomplete = f"tensorplay telemetry incomplete ({', '.join(record.failures)})"
        except Exception:
            _logger.warning("tensorplay: could not finish a hook record; training goes on", exc_info=True)
            _count(record, "resolver")
            job.incomplete = "tensorplay could not finish this record"
            recording = True  # end it, whatever it is, with the failure
        if not recording:  # no SDK records it: nothing to end
            self._done()
        elif threading.current_thread() is self._thread:
            self._end(job)
        else:
            self._submit(job)

    def _submit(self, job: _SpanEnd) -> None:
        """Queue a span to end on the thread, or drop it (counted) when the queue is full."""
        with self._wake:
            if len(self._spans) < self._capacity:
                self._spans.append(job)
                self._started()
                return
        if job.record is not None:
            _count(job.record, "span_dropped")
        self._done()

    def _hold(self, record: BucketRecord) -> None:
        """Keep a record until its collectives completed and its events happened; it is never dropped.

        What bounds them: the thread finishes every record whose events happened before it ends
        the next span, and the host runs only so far ahead of the device (on NCCL a hook's future
        completes at enqueue, but CUDA's launch queue holds the host back). Only a span processor
        stuck in ``end()`` stops the thread: then, beyond ``capacity`` records, the thread handing
        one over finishes the oldest ones that are done (reading them waits for nothing).
        """
        with self._wake:
            self._records.append(record)
            self._started()
            crowded = len(self._records) > self._capacity
        if crowded:
            self._finish_done_records()

    def _started(self) -> None:
        """Start the thread if it is not running, and wake it (the caller holds the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tensorplay-finisher", daemon=True)
            self._thread.start()
        self._wake.notify()

    def _finish_done_records(self) -> bool:
        """Finish, oldest first, the held records whose events have happened; whether any was."""
        finished = False
        while True:
            with self._wake:
                if not self._records or not _events_happened(self._records[0]):
                    return finished
                record = self._records.popleft()
            self._finish(record)
            finished = True

    def _done(self) -> None:
        with self._wake:
            self._pending -= 1
            if not self._pending:
                self._wake.notify_all()

    # -- tensorplay's thread --

    def _run(self) -> None:
        pause = _FIRST_POLL_S
        while True:
            with self._wake:
                while not self._spans and not self._records:
                    self._wake.wait()
                records, self._records = self._records, deque()
                span = self._spans.popleft() if self._spans else None
            taken = len(records)
            waiting: deque[BucketRecord] = deque()
            while records:  # popped one by one: each record is let go once it is finished
                record = records.popleft()
                if _events_happened(record):
                    self._finish(record)
                else:
                    waiting.append(record)
                del record
            progressed = len(waiting) < taken
            if waiting:
                with self._wake:
                    self._records.extendleft(reversed(waiting))
            if span is not None:  # one span per round: records that became done meanwhile come first
                self._end(span)
                del span
                continue
            if not waiting:
                pause = _FIRST_POLL_S
                continue
            pause = _FIRST_POLL_S if progressed else min(pause * 2, _SLOWEST_POLL_S)
            del waiting
            time.sleep(pause)

    def _end(self, job: _SpanEnd) -> None:
        started = time.monotonic()
        try:
            job.span.end(job.attributes, job.end_time, job.error, job.incomplete)
        except Exception:
            _logger.warning("tensorplay: a span processor failed ending a span; training goes on", exc_info=True)
        finally:
            took = time.monotonic() - started
            if took >= SLOW_END_S:
                self._warn_slow(took)
            self._done()

    def _warn_slow(self, took: float) -> None:
        """Warn, at most once a minute, that span processing is slow (what the thread measured)."""
        now = time.monotonic()
        if self._slow_warned_at is not None and now - self._slow_warned_at < 60.0:
            return
        self._slow_warned_at = now
        _logger.warning(
            "tensorplay: rank %s: the span processor is slow: ending one span took %.2f s; training does "
            "not wait for spans, but they queue (%d waiting) and beyond %d are dropped",
            rank_label(), took, self.waiting(), self._capacity,
        )


def _events_happened(record: BucketRecord) -> bool:
    """Whether every collective's future completed and every CUDA event the numbers are read from happened.

    A collective whose future has not completed (of a hook that raised, say) is in flight: its
    record waits with it, so that it leaves the in-flight gauge only once it is done.
    """
    if None in record.ends.stamps:
        return False
    points = [record.called, record.ends.completed, *record.launches, *record.ends.stamps]
    points += [stage.ready for stage in record.stages if stage.ready is not None]
    for previous in (record.previous_step_end, record.step_start):
        if previous is not None and previous.last() is not None:
            points.append(previous.last())
    try:
        return all(happened(point) for point in points if point is not None)
    except Exception:  # a broken event: let finishing find out and report it
        _logger.debug("tensorplay: polling an event failed", exc_info=True)
        return True


def _count(record: BucketRecord, reason: str) -> None:
    """Count a telemetry problem of ``record``, unless counting fails too."""
    try:
        if record.metrics is not None:
            record.metrics.count_error(record.rank, reason)
    except Exception:
        _logger.debug("tensorplay: could not count %s", reason, exc_info=True)


_finisher = Finisher()

os.register_at_fork(after_in_child=_finisher.start_afresh)


def finisher() -> Finisher:
    """The process's finisher."""
    return _finisher


_waits_before_flush: list[Callable[[float | None], bool]] = []


def wait_before_flush(wait: Callable[[float | None], bool]) -> None:
    """Have :func:`flush` first call ``wait(timeout left)``: work that hands the finisher its spans later (the advice)."""
    _waits_before_flush.append(wait)


def flush(timeout: float | None = 30.0) -> bool:
    """Wait until every traced hook call so far has its metrics recorded and its span ended (the advice of
    every advised iteration so far too); False if ``timeout`` ran out first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    waited = [wait(_left(deadline)) for wait in _waits_before_flush]
    return _finisher.flush(_left(deadline)) and all(waited)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
