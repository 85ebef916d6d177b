"""Turns each ``Join``'s reports into the ``tensorplay_join_*`` metrics and a join-phase span.

The join time and shadow count are live: set when a rank joins and after every round it shadows,
so a long skew shows while it lasts. The wait histogram, the counter, the last-joiner gauge and
the span follow once every rank has joined. The span is ended on the finisher's thread, as every
span tensorplay starts: never inline in ``Join.__exit__`` on the training thread, where an
application's span processor could export to a slow collector.
"""

import functools
import time
from typing import Callable

from . import probe
from .finish import OwnedSpan, finisher
from .metrics import active_metrics, rank_label
from .names import JOIN_SPAN_NAME, Attr
from .tracing import tracer

__all__ = ["listen", "record_join", "record_join_progress", "watch_collective"]


def watch_collective() -> Callable[[], None] | None:
    """Count a blocking collective of ``Join`` as in flight until the returned function is called."""
    metrics = active_metrics()
    if metrics is None:
        return None
    rank = rank_label()
    token = metrics.collectives_in_flight.launched(rank, time.time())
    return functools.partial(metrics.collectives_in_flight.completed, rank, token)


def record_join_progress(progress: probe.JoinProgress) -> None:
    """Keep this rank's join time and shadowed iterations current while it shadows."""
    metrics = active_metrics()
    if metrics is not None:
        rank = str(progress.rank)
        if progress.shadow_iterations == 0:
            metrics.join_timestamp.labels(rank=rank).set(progress.joined_unix)
        metrics.join_shadow_iterations.labels(rank=rank).set(progress.shadow_iterations)


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
        attributes = {
            Attr.RANK: report.rank,
            Attr.WORLD_SIZE: report.world_size,
            Attr.JOIN_SHADOW_ITERATIONS: report.shadow_iterations,
            Attr.JOIN_WAIT_MS: report.wait_seconds * 1e3,
            Attr.JOIN_LAST_JOINER: report.last_joiner,
        }
        finisher().end_span(OwnedSpan(span), attributes, end_time=int(report.all_joined_unix * 1e9))


def listen() -> None:
    """Export every ``Join``'s timing from now on; calling it again changes nothing.

    ``Join`` measures only while someone listens, and these listeners export to whatever is on
    (metrics, an SDK tracer provider) and do nothing otherwise: a listening ``Join`` costs a few
    clock reads per context. The telemetry's public names call it when first used
    (``tensorplay.telemetry``'s ``__getattr__``), never an import of the algorithms.
    """
    probe.add_join_listener(record_join)
    probe.add_join_progress_listener(record_join_progress)
    probe.set_collective_watch(watch_collective)
