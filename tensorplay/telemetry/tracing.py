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
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

from tensorplay import __version__

from .exports import CountingExporter, fold_exporter_logs
from .metrics import rank_label
from .names import TRACER_NAME

__all__ = ["tracer", "may_record", "configure_tracing", "JsonLinesSpanExporter", "SystemRandomIdGenerator"]

_logger = logging.getLogger(__name__)


class SystemRandomIdGenerator(IdGenerator):
    """Draw trace and span IDs from the operating system, never from Python's ``random``.

    OpenTelemetry's default generator draws from the global ``random``, which training scripts
    seed (``seed_everything``, ``set_seed``, ``random.seed``): every rank, and every run with the
    same seed, would then make the same IDs, and each span would advance the script's own random
    sequence. Drawing from ``os.urandom`` keeps IDs unique and leaves ``random`` as the script
    left it. IDs are never all zeros (invalid in W3C Trace Context).
    """

    def generate_span_id(self) -> int:
        return _nonzero_bits(8)

    def generate_trace_id(self) -> int:
        return _nonzero_bits(16)

    def is_trace_id_random(self) -> bool:
        return True


def _nonzero_bits(size: int) -> int:
    while True:
        value = int.from_bytes(os.urandom(size), "big")
        if value:
            return value


_SYSTEM_IDS = SystemRandomIdGenerator()


def _draws_from_random(owner: object) -> bool:
    """True if ``owner`` (an SDK provider or tracer) uses the SDK's stock, ``random``-based generator."""
    return type(getattr(owner, "id_generator", None)) is RandomIdGenerator


def tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """Return tensorplay's tracer from ``provider``, else the current global one (a no-op without an SDK).

    The global provider is looked up on every use, so a provider set or replaced later (tests
    do) is honoured, and the tracer is made once per provider. Whoever made the provider, tensorplay's own spans never take IDs from
    Python's ``random``: a tracer on the SDK's default generator gets
    :class:`SystemRandomIdGenerator` instead (a generator the application chose is kept).
    """
    global _cached
    source = provider if provider is not None else trace.get_tracer_provider()
    cached = _cached
    if cached is not None and cached[0] is source:
        return cached[1]
    found = source.get_tracer(TRACER_NAME, __version__)
    if _draws_from_random(found):
        found.id_generator = _SYSTEM_IDS  # type: ignore[attr-defined]  # an SDK Tracer's public attribute
    _cached = (source, found)
    return found


_cached: tuple[trace.TracerProvider, trace.Tracer] | None = None
"""The tracer last made, with its provider: the SDK's ``get_tracer`` costs ~20 us per hook call."""


def may_record(tracer: trace.Tracer) -> bool:
    """Whether ``tracer`` may record spans, told without starting one: not OpenTelemetry's no-op.

    A ``ProxyTracer`` is what the API hands out while no SDK provider is set (a provider set
    later is picked up at the next call, since the tracer is looked up at every call).
    """
    if isinstance(tracer, trace.NoOpTracer):
        return False
    if isinstance(tracer, trace.ProxyTracer):
        return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return True


class JsonLinesSpanExporter(SpanExporter):
    """Append finished spans to a file, one JSON object per line (what ``tensorplay demo`` reads)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        _file_exporters.add(self)

    def renew_lock(self) -> None:
        """In a forked child: a lock the parent's export thread held at the fork would stay held."""
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(span.to_json(indent=None))) + "\n" for span in spans)
        with self._lock, open(self._path, "a", encoding="utf-8") as sink:
            sink.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


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
            and world size are added to the Resource: the process group's once it exists, else
            ``RANK`` and ``WORLD_SIZE``; call it after the process group is set up where no
            launcher sets ``RANK`` (Lightning: in ``LightningModule.setup``).
        endpoint: OTLP endpoint (default: ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, else the
            exporter's localhost default). An http base URL gets ``/v1/traces`` appended.
        protocol: ``http/protobuf`` or ``grpc`` (default: ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``,
            else ``http/protobuf``).
        span_file: also append spans as JSON lines to this file. ``{rank}`` in it is replaced by
            this process's rank (as for the Resource below), so
            ``span_file="spans-rank{rank}.jsonl"`` gives every rank its own file, the names
            ``tensorplay report`` reads.
        otlp: set to False to export to ``span_file`` only (``OTEL_TRACES_EXPORTER=none`` does the
            same). Without a collector, that is the set-up to use:
            ``configure_tracing(otlp=False, span_file="spans-rank{rank}.jsonl")``.
        resource_attributes: more Resource attributes.

    Spans leave through a batch processor: a collector that is down or slow drops spans (each
    failed export counted in ``tensorplay_telemetry_errors_total``, one warning per process) and
    never blocks training. At exit the final spans go to every exporter, so a collector that came
    back gets them; an attempt that fails at exit ends its exporter's retries, and exports still
    going 3 s after exit began are cut short (:mod:`tensorplay.telemetry.exports`).
    If the application already set an SDK provider, the exporters are added to it.

    tensorplay's spans take their trace and span IDs from the operating system
    (:class:`SystemRandomIdGenerator`), so they are unique across ranks and runs however the
    script seeds Python's ``random``, and tracing never advances that seed's sequence. A provider
    the application set is left as it is: its own tracers keep the ID generator it has (the SDK's
    default follows ``random.seed``), and only tensorplay's tracer draws from the operating system
    (see :func:`tracer`).

    Calling it again is harmless: it returns the same provider and adds only exporters that no
    earlier call added to it (an OTLP exporter per endpoint and protocol, one per span file), so
    no span is ever exported twice to one destination.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        provider = current  # as the application made it: its own tracers keep its ID generator
    else:
        provider = TracerProvider(resource=_resource(service_name, resource_attributes), id_generator=_SYSTEM_IDS)
        trace.set_tracer_provider(provider)
    # Unless the environment says otherwise, give up on an export after 5 s rather than 10 s.
    env_timeout = any(k in os.environ for k in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"))
    timeout_s = None if env_timeout else 5.0
    if otlp and os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() != "none":
        resolved = _resolved_protocol(protocol)
        fold_exporter_logs()
        _add_once(
            provider,
            ("otlp", endpoint, resolved),
            lambda: _otlp_exporter(endpoint, resolved, timeout_s),
            endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "the default OTLP endpoint",
        )
    if span_file is not None:
        path = os.path.abspath(span_file.replace("{rank}", rank_label()))
        _add_once(provider, ("file", path), lambda: JsonLinesSpanExporter(path), path)
    return provider


_added_exporters: weakref.WeakKeyDictionary[TracerProvider, set[tuple]] = weakref.WeakKeyDictionary()
_added_lock = threading.Lock()
_file_exporters: weakref.WeakSet[JsonLinesSpanExporter] = weakref.WeakSet()


def _renew_locks_after_fork() -> None:
    global _added_lock
    _added_lock = threading.Lock()
    for exporter in list(_file_exporters):
        exporter.renew_lock()


os.register_at_fork(after_in_child=_renew_locks_after_fork)


def _add_once(provider: TracerProvider, key: tuple, make: Callable[[], SpanExporter], destination: str) -> None:
    """Add a batch processor for the exporter ``make`` builds, unless ``key`` was added to ``provider``."""
    with _added_lock:
        added = _added_exporters.setdefault(provider, set())
        if key in added:
            return
        provider.add_span_processor(BatchSpanProcessor(CountingExporter(make(), destination)))
        added.add(key)


def _resource(service_name: str | None, resource_attributes: dict[str, object] | None) -> Resource:
    """The Resource of a new provider: rank and world size, the standard variables, the arguments.

    Rank and world size come from the process group once it exists (Lightning's launchers set
    no ``RANK``), else from torchrun's ``RANK`` and ``WORLD_SIZE``.
    """
    import torch.distributed as dist

    attributes: dict[str, object] = {"tensorplay.rank": int(rank_label())}
    if dist.is_available() and dist.is_initialized():
        attributes["tensorplay.world_size"] = dist.get_world_size()
    elif "WORLD_SIZE" in os.environ:
        attributes["tensorplay.world_size"] = int(os.environ["WORLD_SIZE"])
    attributes.update(resource_attributes or {})
    if service_name is not None:
        attributes["service.name"] = service_name
    elif "service.name" not in attributes and "service.name" not in OTELResourceDetector().detect().attributes:
        attributes["service.name"] = "tensorplay"  # neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one
    return Resource.create(attributes)
