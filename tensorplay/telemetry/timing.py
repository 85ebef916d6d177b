"""Points in time a hook call passes through, and the intervals between them.

On CPU a stamp is a clock reading. On CUDA it also records an event on the current stream, so
intervals are the device's own. Events are only read off the training thread, and only once
:func:`happened` says so: they are polled, never waited on, since a blocking synchronize would
hang along with a hung collective (pytorch#115301).
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["Stamp", "stamp", "happened", "seconds_between", "unix_ns"]


class Stamp:
    """A point in time: wall clock for spans, monotonic clock for intervals, maybe a CUDA event.

    A plain class with slots, not a frozen dataclass: every traced bucket takes two or more on the
    training thread, and a frozen dataclass's ``__init__`` costs several times as much.
    """

    __slots__ = ("unix_ns", "monotonic_ns", "event")

    def __init__(self, unix_ns: int, monotonic_ns: int, event: Any = None) -> None:
        self.unix_ns = unix_ns
        self.monotonic_ns = monotonic_ns
        self.event = event
        """A ``torch.cuda.Event`` recorded with timing on the stream that reached this point."""


def stamp(device: torch.device | None = None) -> Stamp:
    """Take a stamp now; given a CUDA device, also record an event on its current stream (callers pass None on CPU)."""
    if device is None or device.type != "cuda":
        return Stamp(time.time_ns(), time.perf_counter_ns())
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return Stamp(time.time_ns(), time.perf_counter_ns(), event)


def happened(point: Stamp | None) -> bool:
    """Whether ``point`` has been reached: always for a clock reading, once its event completed on CUDA."""
    return point is not None and (point.event is None or bool(point.event.query()))


def seconds_between(start: Stamp, end: Stamp) -> float:
    """Seconds from ``start`` to ``end``; CUDA stamps must both have :func:`happened`."""
    if start.event is not None and end.event is not None:
        return start.event.elapsed_time(end.event) / 1e3
    return (end.monotonic_ns - start.monotonic_ns) / 1e9


def unix_ns(point: Stamp, origin: Stamp) -> int:
    """Wall-clock time at which ``point`` was reached.

    The host clock of a CUDA stamp says when its event was enqueued, not when the device got
    there (on NCCL a collective's future completes at enqueue): the device time is ``origin``'s
    wall clock plus the device's own interval from ``origin`` to ``point``.
    """
    if point.event is not None and origin.event is not None:
        return origin.unix_ns + round(seconds_between(origin, point) * 1e9)
    return point.unix_ns
