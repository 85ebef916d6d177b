"""Turns what the algorithms report into OpenTelemetry spans and Prometheus metrics.

Public entry points: :func:`traced`, :func:`enable_metrics` / :func:`disable_metrics`,
:func:`configure_tracing` (with :class:`SystemRandomIdGenerator`), :func:`flush` and :func:`wait_for_final_scrape`.
"""

from . import join_telemetry  # noqa: F401  (exports every Join's timing)
from .metrics import (
    TensorplayMetrics,
    active_metrics,
    disable_metrics,
    enable_metrics,
    served_address,
    wait_for_final_scrape,
)
from .finish import flush
from .traced import DEFAULT_ERROR_EVERY, traced
from .tracing import SystemRandomIdGenerator, configure_tracing

__all__ = [
    "traced",
    "DEFAULT_ERROR_EVERY",
    "TensorplayMetrics",
    "enable_metrics",
    "disable_metrics",
    "active_metrics",
    "served_address",
    "wait_for_final_scrape",
    "configure_tracing",
    "SystemRandomIdGenerator",
    "flush",
]
