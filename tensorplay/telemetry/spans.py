"""The life of tensorplay's spans: each ends exactly once, and never on the path training waits for.

An :class:`OwnedSpan` is the only way tensorplay ends a span: once, with its attributes, and with
ERROR status and the exception recorded when the hook, one of its collectives or the telemetry
failed. Span processors run inside ``span.end()`` (an application's ``SimpleSpanProcessor``
exports there, to a collector that may be slow or dead), so spans are ended on the
:class:`SpanEnder`'s own thread, from a bounded queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from opentelemetry import trace

from .metrics import rank_label

__all__ = ["OwnedSpan", "SpanEnd", "SpanEnder"]

_logger = logging.getLogger(__name__)

SLOW_END_S = 0.1
"""An ``end()`` this long means a span processor that exports in line to somewhere slow (a healthy
batch processor only enqueues, in microseconds; a busy machine delays a thread by milliseconds)."""

BACKLOG = 256
"""This many spans waiting to be ended means the processor does not keep up."""


class OwnedSpan:
    """A started span that tensorplay ends exactly once, whatever happens in between."""

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self._ended = False
        self._lock = threading.Lock()

    @property
    def is_recording(self) -> bool:
        """Whether an SDK records this span (attributes are only built for such spans)."""
        return self._span.is_recording()

    @property
    def context(self) -> trace.SpanContext:
        return self._span.get_span_context()

    def end(
        self,
        attributes: dict[str, Any] | None = None,
        end_time: int | None = None,
        error: BaseException | None = None,
        incomplete: str | None = None,
    ) -> None:
        """End the span; later calls do nothing.

        ``error`` (the hook's or a collective's exception) is recorded and sets ERROR status;
        ``incomplete`` sets ERROR status with that description when telemetry itself failed.
        """
        with self._lock:
            if self._ended:
                return
            self._ended = True
        span = self._span
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
class SpanEnd:
    """One span to end on the ender's thread, and what to call once it has ended (or was dropped)."""

    span: OwnedSpan
    attributes: dict[str, Any] | None = None
    end_time: int | None = None
    error: BaseException | None = None
    incomplete: str | None = None
    then: Callable[[], None] = lambda: None
    dropped: Callable[[], None] = lambda: None
    """Called instead of ending the span when the queue is full (to count the loss)."""
    done: threading.Event = field(default_factory=threading.Event)


class SpanEnder:
    """A daemon thread that ends spans from a bounded queue.

    A caller may wait briefly for its span (so that on a healthy exporter a hook's span has ended
    by the time DDP sees its future complete), but only within ``budget_s``: once a wait runs
    out, callers stop waiting for a cool-down that doubles up to a minute, so a span processor
    that hangs costs training at most one budget per cool-down. When the queue is full the span
    is dropped and counted: memory stays bounded while the processor is stuck.

    A wait that runs out warns only when the ender's thread measured a slow processor (an
    ``end()`` running or done in ``SLOW_END_S`` or more, or ``BACKLOG`` spans queued); a wait that
    ran out because the machine is busy (the thread had not run yet) is logged at debug level.
    """

    def __init__(
        self,
        capacity: int = 2048,
        budget_s: float = 0.01,
        max_cooldown_s: float = 60.0,
    ) -> None:
        self._queue: queue.Queue[SpanEnd] = queue.Queue(maxsize=capacity)
        self._budget_s = budget_s
        self._max_cooldown_s = max_cooldown_s
        self._cooldown_s = 1.0
        self._no_wait_until = 0.0
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._ending_since: float | None = None
        """When the ``end()`` running on the ender's thread began (monotonic), None between ends."""
        self._slowest_end_s = 0.0
        """The longest ``end()`` since the last wait that ran out."""
        self.late_waits = 0
        """Waits that ran out although the processor was not measured slow (a busy machine)."""

    def submit(self, job: SpanEnd) -> bool:
        """Queue ``job``; False if the queue is full (``job.dropped`` then ``job.then`` are called)."""
        if self._thread is None:
            self._start()
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self._dropped(job)
            return False

    def wait_briefly(self, job: SpanEnd) -> None:
        """Wait for ``job``'s span to end, within the budget, unless a recent wait ran out."""
        if time.monotonic() < self._no_wait_until:
            return
        if job.done.wait(self._budget_s):
            return
        slow = self._slowness()
        cooldown_s = self._cooldown_s
        self._no_wait_until = time.monotonic() + cooldown_s
        self._cooldown_s = min(self._cooldown_s * 2, self._max_cooldown_s)
        if slow is None:
            self.late_waits += 1
            _logger.debug(
                "tensorplay: stopped waiting for a span to end after %.3f s; its processor is not slow "
                "(the ender's thread had not got to it yet)", self._budget_s,
            )
            return
        _logger.warning(
            "tensorplay: rank %s: the span processor is slow: %s; training does not wait for spans "
            "for the next %.0f s", rank_label(), slow, cooldown_s,
        )

    def _slowness(self) -> str | None:
        """What the ender's thread measured that shows a slow span processor, or None."""
        since = self._ending_since
        running_s = time.monotonic() - since if since is not None else 0.0
        slowest_s, self._slowest_end_s = self._slowest_end_s, 0.0
        queued = self._queue.qsize()
        if running_s >= SLOW_END_S:
            return f"ending one span has taken {running_s:.2f} s so far"
        if slowest_s >= SLOW_END_S:
            return f"ending one span took {slowest_s:.2f} s"
        if queued >= BACKLOG:
            return f"{queued} spans wait to be ended"
        return None

    def queued(self) -> int:
        """Spans waiting to be ended."""
        return self._queue.qsize()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tensorplay-span-ender", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            self._ending_since = started = time.monotonic()
            try:
                job.span.end(job.attributes, job.end_time, job.error, job.incomplete)
            except Exception:
                _logger.warning("tensorplay: a span processor failed ending a span; training goes on", exc_info=True)
            finally:
                self._ending_since = None
                self._slowest_end_s = max(self._slowest_end_s, time.monotonic() - started)
                job.done.set()
                _call_safely(job.then)

    def _dropped(self, job: SpanEnd) -> None:
        _call_safely(job.dropped)
        job.done.set()
        _call_safely(job.then)


def _call_safely(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        _logger.debug("tensorplay: span bookkeeping failed", exc_info=True)
