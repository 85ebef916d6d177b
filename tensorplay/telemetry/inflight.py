"""This rank's traced collectives that were launched and have not completed: a live gauge.

``tensorplay_collective_waiting_since_timestamp_seconds`` holds the launch time of the oldest of
them, 0 once none is in flight. It is written at launch and completion only (when the oldest
changes), from whichever thread sees the event, so the metrics endpoint serves the truth while
the training thread is blocked inside a collective.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge

__all__ = ["CollectivesInFlight", "WaitingCollective"]


@dataclass(frozen=True)
class WaitingCollective:
    """A traced collective in flight: since when, and which step and bucket it serves."""

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
        self._children: dict[str, Any] = {}
        """Rank label -> its gauge child, looked up once (``labels()`` costs more than ``set()``)."""

    def launched(self, rank: str, unix_s: float, step: int | None = None, bucket: int | None = None) -> int:
        """Note a collective launched at ``unix_s``; returns the token for :meth:`completed`."""
        token = next(self._tokens)
        with self._lock:
            pending = self._launched.setdefault(rank, {})
            pending[token] = WaitingCollective(unix_s, step, bucket)
            if len(pending) == 1:
                self._child(rank).set(unix_s)
        return token

    def completed(self, rank: str, token: int) -> None:
        """Note that the collective of ``token`` completed (successfully or not)."""
        with self._lock:
            pending = self._launched.get(rank)
            if not pending or token not in pending:
                return
            was_oldest = next(iter(pending)) == token
            del pending[token]
            if was_oldest:
                oldest = next(iter(pending.values()), None)
                self._child(rank).set(oldest.since_unix if oldest is not None else 0.0)

    def _child(self, rank: str) -> Any:
        child = self._children.get(rank)
        if child is None:
            child = self._children[rank] = self._gauge.labels(rank=rank)
        return child

    def oldest(self, rank: str) -> WaitingCollective | None:
        """The oldest collective of ``rank`` in flight, or None."""
        with self._lock:
            return next(iter(self._launched.get(rank, {}).values()), None)

    def in_flight(self, rank: str) -> int:
        """How many collectives of ``rank`` are in flight now."""
        with self._lock:
            return len(self._launched.get(rank, ()))
