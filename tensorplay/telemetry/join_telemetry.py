"""Turns each ``Join``'s report into the ``tensorplay_join_*`` metrics and a join-phase span."""

from . import probe
from .metrics import active_metrics
from .names import JOIN_SPAN_NAME, Attr
from .tracing import tracer

__all__ = ["record_join"]


def record_join(report: probe.JoinReport) -> None:
    """Export ``report``: per-rank gauges and counters, and a span from joining to all joined."""
    metrics = active_metrics()
    if metrics is not None:
        rank = str(report.rank)
        metrics.join_timestamp.labels(rank=rank).set(report.joined_unix)
        metrics.join_shadow_iterations.labels(rank=rank).set(report.shadow_iterations)
        metrics.join_wait.labels(rank=rank).observe(report.wait_seconds)
        metrics.join_last_joiner.labels(rank=rank).set(1 if report.last_joiner else 0)
        metrics.joins.labels(rank=rank).inc()
    span = tracer().start_span(JOIN_SPAN_NAME, start_time=int(report.joined_unix * 1e9))
    if span.is_recording():
        span.set_attributes(
            {
                Attr.RANK: report.rank,
                Attr.WORLD_SIZE: report.world_size,
                Attr.JOIN_SHADOW_ITERATIONS: report.shadow_iterations,
                Attr.JOIN_WAIT_MS: report.wait_seconds * 1e3,
                Attr.JOIN_LAST_JOINER: report.last_joiner,
            }
        )
        span.end(end_time=int(report.all_joined_unix * 1e9))


# Join measures only while someone listens; this listener exports to whatever is on (metrics,
# an SDK tracer provider) and does nothing otherwise. A Join costs a few clock reads per context.
probe.add_join_listener(record_join)
