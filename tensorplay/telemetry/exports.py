"""Span exports that fail (no collector listening, a collector that is down) cost training nothing.

Each exporter :func:`~tensorplay.telemetry.configure_tracing` sets up is wrapped in a
:class:`CountingExporter`: every failed export is counted in
``tensorplay_telemetry_errors_total{reason="span_export_failed"}``, the first one gives one
tensorplay warning per process (the OTLP exporter's own per-attempt lines are folded into it).

At exit the provider's final export goes to every exporter, whatever failed earlier in the job,
so a collector that went away and came back still gets the job's last spans. The exit is bounded
all the same: an exporter whose attempt fails during exit is shut at once (no retry back-off is
worth the wait), and one still exporting ``EXIT_EXPORT_S`` after exit began is shut then. A
collector that never comes back costs the exit one failed attempt per exporter.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
import weakref
from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["CountingExporter", "EXIT_EXPORT_S", "fold_exporter_logs"]

_logger = logging.getLogger(__name__)

EXIT_EXPORT_S = 3.0
"""How long exports may go on at exit before the exporters still at it are shut.

It bounds an export that waits to retry when exit begins (its retry reaches a collector that came
back within this time), and several batches to a slow collector.
"""

# Where the OTLP exporters log each failed attempt and retry.
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
)

_exporters: weakref.WeakSet[CountingExporter] = weakref.WeakSet()
_warned = threading.Event()
_exiting = threading.Event()
_exit_bound_registered = False
_registration_lock = threading.Lock()


class CountingExporter(SpanExporter):
    """Count failed exports instead of letting a collector that is down surface in training."""

    def __init__(self, inner: SpanExporter, destination: str) -> None:
        self._inner = inner
        self._destination = destination
        self._shut = False
        self._shut_lock = threading.Lock()
        self.exporting_since: float | None = None
        """When the export in progress began (monotonic), None between exports."""
        self.exporting_thread: int | None = None
        """The thread running the export in progress (the batch processor's), None between exports."""
        _exporters.add(self)
        _bound_exports_at_exit()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shut:
            result = SpanExportResult.FAILURE
        else:
            self.exporting_thread = threading.get_ident()
            self.exporting_since = time.monotonic()
            try:
                result = self._inner.export(spans)
            except Exception as error:
                _logger.debug("tensorplay: span export raised", exc_info=True)
                _warn_once(self._destination, f"{type(error).__name__}: {error}")
                result = SpanExportResult.FAILURE
            finally:
                self.exporting_since = None
                self.exporting_thread = None
        if result is not SpanExportResult.SUCCESS:
            _warn_once(self._destination, "the export failed")
            _count_export_failure()
        return result

    def shutdown(self) -> None:
        with self._shut_lock:
            if self._shut:
                return
            self._shut = True
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def close_inherited_connections(self) -> None:
        """In a forked child: drop the parent's pooled connections, so the child opens its own.

        The OTLP/HTTP exporter keeps its connections to the collector open between exports; a
        child writing on the parent's connection would interleave requests on one socket. Closing
        the child's copies sends nothing to the collector (the parent's copies keep the
        connections open) and the next export connects afresh.
        """
        # Where the pool lives: the HTTP client's transport (SDK 1.45), the exporter's own
        # requests session (earlier releases). Another exporter keeps what it has.
        pool = getattr(getattr(self._inner, "_client", None), "_transport", None) or getattr(self._inner, "_session", None)
        close = getattr(pool, "close", None)
        if close is not None:
            close()


def _count_export_failure() -> None:
    from .metrics import active_metrics, rank_label

    metrics = active_metrics()
    if metrics is not None:
        metrics.telemetry_errors.labels(rank=rank_label(), reason="span_export_failed").inc()


def _warn_once(destination: str, what: str) -> None:
    """The one line a job gets about exports failing (the counter has the rest)."""
    if _warned.is_set():
        return
    _warned.set()
    from .metrics import rank_label

    _logger.warning(
        "tensorplay: rank %s: cannot export spans to %s (%s); training goes on, and spans that cannot be "
        "delivered are dropped and counted in tensorplay_telemetry_errors_total{reason=\"span_export_failed\"}. "
        "Without a collector, use configure_tracing(otlp=False, span_file=\"spans-rank{rank}.jsonl\") or set "
        "OTEL_TRACES_EXPORTER=none",
        rank_label(), destination, _without_retry_plan(what),
    )


_RETRY_PLAN = re.compile(r",? retrying in [0-9.]+ ?s")


def _without_retry_plan(message: str) -> str:
    """The exporter's reason, without its ", retrying in 1.03s": the warning covers every attempt."""
    return _RETRY_PLAN.sub("", message).strip().rstrip(".")


class _FoldIntoOneWarning(logging.Filter):
    """Keep the OTLP exporter's lines (one per attempt and retry) out of stderr: tensorplay warns once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            _warn_once("the OTLP collector", record.getMessage())
            if _exiting.is_set():  # a failed attempt at exit: no retry is worth the wait
                _shut_exporter_on(record.thread)
        _logger.debug("tensorplay: OTLP exporter: %s", record.getMessage())
        return False


_fold = _FoldIntoOneWarning()


def fold_exporter_logs() -> None:
    """Fold the OTLP exporters' own log lines into tensorplay's one warning (idempotent)."""
    for name in _EXPORTER_LOGGERS:
        exporter_logger = logging.getLogger(name)
        if _fold not in exporter_logger.filters:
            exporter_logger.addFilter(_fold)


def _bound_exports_at_exit() -> None:
    """Register, once and after the tracer provider's own exit hook, the bound on exports at exit.

    atexit runs hooks last registered first, so this one runs before the provider shuts its
    processors down (and their final exports begin).
    """
    global _exit_bound_registered
    with _registration_lock:
        if not _exit_bound_registered:
            _exit_bound_registered = True
            atexit.register(_bound_exports)


def _bound_exports() -> None:
    """At exit, before the provider's final export: from now on a failed attempt shuts its exporter."""
    _exiting.set()
    timer = threading.Timer(EXIT_EXPORT_S, _shut_exports_still_running)
    timer.daemon = True
    timer.start()


def _shut_exporter_on(thread: int | None) -> None:
    """Shut the exporter whose export runs on ``thread`` (the one whose attempt just failed)."""
    for exporter in list(_exporters):
        if thread is not None and exporter.exporting_thread == thread:
            exporter.shutdown()


def _shut_exports_still_running() -> None:
    for exporter in list(_exporters):
        if exporter.exporting_since is not None:
            exporter.shutdown()


def _start_afresh_after_fork() -> None:
    """In a forked child: its own one warning, its own connections, a lock no parent thread holds."""
    global _registration_lock, _warned
    _registration_lock = threading.Lock()
    _warned = threading.Event()
    for exporter in list(_exporters):
        exporter.close_inherited_connections()


os.register_at_fork(after_in_child=_start_afresh_after_fork)
