"""Points in time a hook call passes through, and the intervals between them.

On CPU a stamp is a clock reading. On CUDA it also records an event on the current stream, so
the interval is the device's own; events are only ever resolved off the training thread
(:func:`seconds_between` blocks until the later event has happened).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["Stamp", "stamp", "seconds_between"]


@dataclass(frozen=True)
class Stamp:
    """A point in time: wall clock for spans, monotonic clock for intervals, maybe a CUDA event."""

    unix_ns: int
    monotonic_ns: int
    event: torch.cuda.Event | None = None


def stamp(device: torch.device | None = None) -> Stamp:
    """Take a stamp now; on a CUDA device also record an event on its current stream."""
    event = None
    if device is not None and device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
    return Stamp(time.time_ns(), time.perf_counter_ns(), event)


def seconds_between(start: Stamp, end: Stamp) -> float:
    """Seconds from ``start`` to ``end``; waits for CUDA events, so call it off the hot path."""
    if start.event is not None and end.event is not None:
        end.event.synchronize()
        return start.event.elapsed_time(end.event) / 1e3
    return (end.monotonic_ns - start.monotonic_ns) / 1e9
