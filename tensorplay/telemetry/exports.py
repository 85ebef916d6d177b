"""Span exports that fail (no collector listening, a collector that is down) cost training nothing.

Each exporter :func:`~tensorplay.telemetry.configure_tracing` sets up is wrapped in a
:class:`CountingExporter`: every failed export is counted in
``tensorplay_telemetry_errors_total{reason="span_export_failed"}``, the first one gives one
tensorplay warning (the OTLP exporter's own per-retry lines are folded into it), and at exit the
exports are bounded: an exporter that failed, or fails an attempt, is shut at once, and one still
exporting ``EXIT_EXPORT_S`` after exit began is shut then, which ends its retries. Without that, a job
without a collector would wait out the exporter's retry back-off (about 5 s per rank) at exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["CountingExporter", "EXIT_EXPORT_S", "fold_exporter_logs"]

_logger = logging.getLogger(__name__)

EXIT_EXPORT_S = 1.0
"""How long exports may go on at exit before the exporters still at it are shut."""

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
        self.failed = False
        """Whether an export has failed (the destination is not there, or not well)."""
        self.exporting_since: float | None = None
        """When the export in progress began (monotonic), None between exports."""
        _exporters.add(self)
        _bound_exports_at_exit()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shut:
            result = SpanExportResult.FAILURE
        else:
            self.exporting_since = time.monotonic()
            try:
                result = self._inner.export(spans)
            except Exception as error:
                _logger.debug("tensorplay: span export raised", exc_info=True)
                _warn_once(self._destination, f"{type(error).__name__}: {error}")
                result = SpanExportResult.FAILURE
            finally:
                self.exporting_since = None
        if result is not SpanExportResult.SUCCESS:
            self.failed = True
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
        "tensorplay: rank %s: cannot export spans to %s (%s); training goes on, spans are dropped and counted "
        "in tensorplay_telemetry_errors_total{reason=\"span_export_failed\"}. Without a collector, use "
        "configure_tracing(otlp=False, span_file=...) or set OTEL_TRACES_EXPORTER=none",
        rank_label(), destination, what,
    )


class _FoldIntoOneWarning(logging.Filter):
    """Keep the OTLP exporter's lines (one per attempt and retry) out of stderr: tensorplay warns once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            _warn_once("the OTLP collector", record.getMessage())
            if _exiting.is_set():  # a failed attempt at exit: no retry is worth the wait
                _shut_exports_still_running()
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
    _exiting.set()
    for exporter in list(_exporters):
        if exporter.failed:
            exporter.shutdown()
    timer = threading.Timer(EXIT_EXPORT_S, _shut_exports_still_running)
    timer.daemon = True
    timer.start()


def _shut_exports_still_running() -> None:
    for exporter in list(_exporters):
        if exporter.exporting_since is not None:
            exporter.shutdown()
