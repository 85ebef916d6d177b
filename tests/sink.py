"""Where a test's telemetry goes: finished spans kept in memory, metrics in a registry of their own.

One :class:`MemorySink` is what a test (or a rank of one) hands to ``traced`` — or installs as the
process's global tracer provider and metrics — and then reads back: the spans' attributes and the
metrics' samples. The ``sink`` fixture gives a fresh one to a test run in the pytest process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from tensorplay import traced
from tensorplay.telemetry import TensorplayMetrics, enable_metrics
from tensorplay.telemetry.names import HOOK_SPAN_NAME

__all__ = ["CountingExporter", "MemorySink", "hook_spans", "memory_sink", "sink"]


@dataclass
class MemorySink:
    """A tracer provider exporting to memory as each span ends, and metrics no other test shares."""

    exporter: SpanExporter
    provider: TracerProvider
    metrics: TensorplayMetrics

    def traced(self, hook: Callable, **options: Any) -> Callable:
        """``traced(hook, **options)`` reporting to this sink."""
        return traced(hook, metrics=self.metrics, tracer_provider=self.provider, **options)

    def finished(self) -> Sequence[ReadableSpan]:
        """Every span ended so far."""
        return self.exporter.get_finished_spans()  # type: ignore[attr-defined]

    def spans(self, name: str | None = HOOK_SPAN_NAME) -> list[dict]:
        """The attributes of every span named ``name`` ended so far (of every span if None)."""
        return [dict(span.attributes) for span in self.finished() if name is None or span.name == name]

    def sample(self, metric: str, **labels: str) -> float | None:
        """The value of one sample of the sink's metrics, None if there is none."""
        return self.metrics.registry.get_sample_value(metric, labels)


def memory_sink(exporter: SpanExporter | None = None, *, install: bool = False) -> MemorySink:
    """A fresh sink; ``exporter`` replaces the in-memory one (e.g. a :class:`CountingExporter`).

    With ``install``, the sink is the process's own: its provider the global tracer provider and
    its metrics those ``enable_metrics`` turns on (not served), as an application would set them
    up. Only in a process of its own (a rank): OpenTelemetry sets the global provider once.
    """
    exporter = exporter if exporter is not None else InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    if install:
        trace.set_tracer_provider(provider)
        metrics = enable_metrics(registry=CollectorRegistry(), serve=False)
    else:
        metrics = TensorplayMetrics(CollectorRegistry())
    return MemorySink(exporter, provider, metrics)


@pytest.fixture
def sink() -> MemorySink:
    """A fresh in-memory sink for a test run in the pytest process."""
    return memory_sink()


class CountingExporter(SpanExporter):
    """Keeps only the count of the hook calls' spans exported (not the advice's): a long run's spans take no memory."""

    def __init__(self) -> None:
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exported += hook_spans(spans)
        return SpanExportResult.SUCCESS


def hook_spans(spans: Sequence[ReadableSpan]) -> int:
    """How many of ``spans`` are hook calls' spans (one per traced call)."""
    return sum(span.name == HOOK_SPAN_NAME for span in spans)
