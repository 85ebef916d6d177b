"""This rank's traced collectives that were launched and have not completed: a live gauge.

``tensorplay_collective_waiting_since_timestamp_seconds`` holds the launch time of the oldest of
them, 0 once none is in flight. Launches and completions (from whichever thread sees them) only
update a dict under a lock; the gauge reads its oldest entry when it is scraped, so the metrics
endpoint serves the truth while the training thread is blocked inside a collective.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import NamedTuple

from prometheus_client import Gauge

__all__ = ["CollectivesInFlight", "WaitingCollective"]


class WaitingCollective(NamedTuple):
    """A traced collective in flight: since when, and which step and bucket it serves.

    A named tuple: one is made at every traced launch, on the training thread, and a tuple is
    the cheapest record to make.
    """

    since_unix: float
    step: int | None = None
    bucket: int | None = None
    """None for a collective outside any hook call (``Join``'s own all-reduce)."""


class CollectivesInFlight:
    """The launch times of the collectives in flight, per rank, oldest first."""

    def __init__(self, waiting_since: Gauge) -> None:
        self._gauge = waiting_since
        self._lock = threading.Lock()
        self._launched: dict[str, dict[int, WaitingCollective]] = {}
        self._tokens = itertools.count()

    def launched(self, rank: str, unix_s: float, step: int | None = None, bucket: int | None = None) -> int:
        """Note a collective launched at ``unix_s``; returns the token for :meth:`completed`."""
        token = next(self._tokens)
        with self._lock:
            pending = self._launched.get(rank)
            if pending is None:
                pending = self._launched[rank] = {}
                # The gauge reads the oldest launch when scraped: a launch and a completion only
                # touch this dict (the training thread pays no gauge update per collective).
                self._gauge.labels(rank=rank).set_function(functools.partial(self._oldest_since, rank))
            pending[token] = WaitingCollective(unix_s, step, bucket)
        return token

    def completed(self, rank: str, token: int) -> None:
        """Note that the collective of ``token`` completed (successfully or not); a second call does nothing."""
        with self._lock:
            pending = self._launched.get(rank)
            if pending:
                pending.pop(token, None)

    def _oldest_since(self, rank: str) -> float:
        """The gauge's value when scraped: the launch time of the oldest collective in flight, else 0."""
        oldest = self.oldest(rank)
        return oldest.since_unix if oldest is not None else 0.0

    def oldest(self, rank: str) -> WaitingCollective | None:
        """The oldest collective of ``rank`` in flight, or None."""
        with self._lock:
            return next(iter(self._launched.get(rank, {}).values()), None)

    def in_flight(self, rank: str) -> int:
        """How many collectives of ``rank`` are in flight now."""
        with self._lock:
            return len(self._launched.get(rank, ()))
