"""OpenTelemetry side: the library's tracer (API only) and a one-call SDK set-up for applications.

The hooks only ever use :func:`tracer`, an API tracer that is a no-op until the application
configures an SDK; :func:`configure_tracing` is that configuration in one call for users who
want it, honouring the standard ``OTEL_*`` environment variables.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from typing import Callable, Sequence
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from tensorplay import __version__

from .names import TRACER_NAME

__all__ = ["tracer", "configure_tracing", "JsonLinesSpanExporter"]

_logger = logging.getLogger(__name__)

def tracer() -> trace.Tracer:
    """Return tensorplay's tracer from the current global provider (a no-op without an SDK).

    The provider is looked up on every use, so one set or replaced later (tests do) is honoured;
    the tracer is made once per provider (the SDK's ``get_tracer`` costs ~20 us per hook call).
    """
    global _cached
    provider = trace.get_tracer_provider()
    cached = _cached
    if cached is not None and cached[0] is provider:
        return cached[1]
    made = provider.get_tracer(TRACER_NAME, __version__)
    _cached = (provider, made)
    return made


_cached: tuple[trace.TracerProvider, trace.Tracer] | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Append finished spans to a file, one JSON object per line (what ``tensorplay demo`` reads)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(span.to_json(indent=None))) + "\n" for span in spans)
        with self._lock, open(self._path, "a", encoding="utf-8") as sink:
            sink.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class _CountingExporter(SpanExporter):
    """Count failed exports instead of letting a collector that is down surface in training."""

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            _logger.warning("tensorplay: span export failed", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            _count_export_failure()
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _count_export_failure() -> None:
    from .metrics import active_metrics, rank_label

    metrics = active_metrics()
    if metrics is not None:
        metrics.telemetry_errors.labels(rank=rank_label(), reason="span_export_failed").inc()


def _resolved_protocol(protocol: str | None) -> str:
    return (
        protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )


def _otlp_exporter(endpoint: str | None, protocol: str, timeout_s: float | None) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, timeout=timeout_s)
    if protocol != "http/protobuf":
        raise ValueError(f"configure_tracing: unsupported OTLP protocol {protocol!r} (use 'grpc' or 'http/protobuf')")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    if endpoint is not None and urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"  # a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT takes
    return HttpExporter(endpoint=endpoint, timeout=timeout_s)


def configure_tracing(
    service_name: str | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    span_file: str | None = None,
    otlp: bool = True,
    resource_attributes: dict[str, object] | None = None,
) -> TracerProvider:
    """Set up the OpenTelemetry SDK so tensorplay's spans are exported, in one call.

    Arguments:
        service_name: ``service.name`` of the Resource. OpenTelemetry's precedence holds: this
            argument, else ``service.name`` in ``resource_attributes``, else ``OTEL_SERVICE_NAME``,
            else ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, else ``tensorplay``. The rank
            (``RANK``) and world size are added to the Resource.
        endpoint: OTLP endpoint (default: ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, else the
            exporter's localhost default). An http base URL gets ``/v1/traces`` appended.
        protocol: ``http/protobuf`` or ``grpc`` (default: ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``,
            else ``http/protobuf``).
        span_file: also append spans as JSON lines to this file.
        otlp: set to False to export to ``span_file`` only.
        resource_attributes: more Resource attributes.

    Spans leave through a batch processor: a collector that is down or slow drops spans (each
    failed export counted in ``tensorplay_telemetry_errors_total``) and never blocks training.
    If the application already set an SDK provider, the exporters are added to it.

    Calling it again is harmless: it returns the same provider and adds only exporters that no
    earlier call added to it (an OTLP exporter per endpoint and protocol, one per span file), so
    no span is ever exported twice to one destination.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        provider = current
    else:
        provider = TracerProvider(resource=_resource(service_name, resource_attributes))
        trace.set_tracer_provider(provider)
    # Unless the environment says otherwise, give up on an export after 5 s rather than 10 s.
    env_timeout = any(k in os.environ for k in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"))
    timeout_s = None if env_timeout else 5.0
    if otlp:
        resolved = _resolved_protocol(protocol)
        _add_once(provider, ("otlp", endpoint, resolved), lambda: _otlp_exporter(endpoint, resolved, timeout_s))
    if span_file is not None:
        path = os.path.abspath(span_file)
        _add_once(provider, ("file", path), lambda: JsonLinesSpanExporter(path))
    return provider


_added_exporters: weakref.WeakKeyDictionary[TracerProvider, set[tuple]] = weakref.WeakKeyDictionary()
_added_lock = threading.Lock()


def _add_once(provider: TracerProvider, key: tuple, make: Callable[[], SpanExporter]) -> None:
    """Add a batch processor for the exporter ``make`` builds, unless ``key`` was added to ``provider``."""
    with _added_lock:
        added = _added_exporters.setdefault(provider, set())
        if key in added:
            return
        provider.add_span_processor(BatchSpanProcessor(_CountingExporter(make())))
        added.add(key)


def _resource(service_name: str | None, resource_attributes: dict[str, object] | None) -> Resource:
    """The Resource of a new provider: rank and world size, the standard variables, the arguments."""
    attributes: dict[str, object] = {"tensorplay.rank": int(os.environ.get("RANK", "0"))}
    if "WORLD_SIZE" in os.environ:
        attributes["tensorplay.world_size"] = int(os.environ["WORLD_SIZE"])
    attributes.update(resource_attributes or {})
    if service_name is not None:
        attributes["service.name"] = service_name
    elif "service.name" not in attributes and "service.name" not in OTELResourceDetector().detect().attributes:
        attributes["service.name"] = "tensorplay"  # neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one
    return Resource.create(attributes)
