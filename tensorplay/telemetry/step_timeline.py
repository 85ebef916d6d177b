"""One iteration of one DDP model on this rank, and the step figures read from its stamps.

A rank's iteration, on its own clock, from the stamps its hook records already take::

    previous iteration's        this iteration's            the last of this iteration's
    last collective done  ────► last hook call        ────► hook futures done
                  busy (its own work: data,        exposed communication (what the
                  forward, the whole backward)     backward could not hide)

plus its **communication**: the time during which at least one of the iteration's collectives
was in flight (the union of their launch-to-completion intervals). Busy time and exposed
communication meet at the last hook call, so they share one timeline: their sum is the time from
the previous iteration's end to the last hook future's completion, exactly (the step counted in
``tensorplay_step_seconds_total`` ends at the last bucket's last collective, between the two).

The buckets of an iteration complete in any order (gloo runs callbacks on its worker threads,
two records of one iteration can finish at once), so the iteration is closed by whichever record
finishes last: each finished record folds its stamps into the iteration's :class:`StepTimeline`
under its lock, and the fold that finds the last bucket folded and every traced call of the
iteration folded closes it, once, and returns its :class:`StepFigures`. The training thread only
creates the timeline at the step's first bucket and counts each call (attribute writes, no lock).

On CUDA every stamp is also an event (the call's on the stream that produced the bucket, each
collective's and future's at its completion): intervals are the device's own, read once the events
have happened (``tensorplay-finisher`` finishes a record only then, and never synchronizes), as
offsets from the previous iteration's end, which happened before them all.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from .recorder import CollectiveEnds
from .timing import Stamp, seconds_between

__all__ = ["StepFigures", "StepTimeline", "union_seconds"]


class StepFigures(NamedTuple):
    """The step counters of one closed iteration (seconds)."""

    wait_s: float
    """The last bucket's latency: this rank's wait in the iteration's last collective."""
    step_s: float
    """The previous iteration's last collective done to this one's."""
    busy_s: float
    """The previous iteration's last collective done to this iteration's last hook call."""
    exposed_s: float
    """The last hook call to the completion of the last of the iteration's hook futures."""
    communication_s: float
    """Time during which at least one of the iteration's collectives was in flight."""


class StepTimeline:
    """The stamps of one counted iteration of one model, folded in as its records finish.

    Made on the training thread at the step's first bucket, only for iterations the step
    counters count (a previous iteration to start from, not shadowed inside ``Join``).
    """

    __slots__ = ("step", "previous_end", "calls", "last_called", "_lock", "_folded", "_last_folded",
                 "_closed", "_collectives", "_completions", "_end_of_step")

    def __init__(self, step: int, previous_end: CollectiveEnds) -> None:
        self.step = step
        """The model's step this iteration is (a timeline left from an earlier step is not taken)."""
        self.previous_end = previous_end
        """When the previous iteration's collectives completed; its last is where busy time begins,
        the very stamp ``tensorplay_step_seconds_total`` and the compute time start from."""
        self.calls = 0
        """Traced calls of this iteration so far (written by the training thread only)."""
        self.last_called: Stamp | None = None
        """The last bucket's call stamp, once it was called: where busy time ends and exposed begins."""
        self._lock = threading.Lock()
        """Held by the completion path only, while a record folds in (two can finish at once)."""
        self._folded = 0
        self._last_folded = False
        self._closed = False
        self._collectives: list[tuple[Stamp, Stamp]] = []
        self._completions: list[Stamp] = []
        self._end_of_step: tuple[float, float] | None = None

    def note_call(self, called: Stamp, last: bool) -> None:
        """Count one traced call of this iteration (training thread; ``last``: its model's last bucket)."""
        self.calls += 1
        if last:
            self.last_called = called

    def fold(
        self,
        called: Stamp,
        collectives: list[tuple[Stamp, Stamp]],
        completed: Stamp | None,
        wait_s: float,
        step_s: float | None,
    ) -> StepFigures | None:
        """Fold in one finished call; return the iteration's figures if this fold closed it.

        ``called`` tells the last bucket (its call stamp is the one :meth:`note_call` kept);
        ``wait_s`` and ``step_s`` are that call's latency and step duration. Called once per
        traced call, from the thread that finishes its record. The last bucket's call happens
        after every other call of the iteration, so once it is folded the count of calls is
        final: the fold that brings the folded count to it closes the iteration.
        """
        last = called is self.last_called
        with self._lock:
            self._collectives.extend(collectives)
            if completed is not None:
                self._completions.append(completed)
            if last and step_s is not None:
                self._end_of_step = (wait_s, step_s)
            self._last_folded = self._last_folded or last
            self._folded += 1
            if self._closed or not self._last_folded or self._folded != self.calls:
                return None
            self._closed = True
        return self._figures()

    def _figures(self) -> StepFigures | None:
        """The closed iteration's figures (no lock: it is closed, nobody folds any more)."""
        last_called, origin = self.last_called, self.previous_end.last()
        if self._end_of_step is None or last_called is None or origin is None or not self._completions:
            return None  # a stamp failed: the iteration is not counted, as before the timeline

        def offset(point: Stamp) -> float:
            return seconds_between(origin, point)

        wait_s, step_s = self._end_of_step
        called_at = offset(last_called)
        done_at = max(offset(point) for point in self._completions)
        communication = union_seconds([(offset(start), offset(end)) for start, end in self._collectives])
        # Busy and exposed time are >= 0 by construction on one clock; on CUDA two events of
        # different streams may read a few microseconds apart, and a counter takes no negative.
        return StepFigures(wait_s, step_s, max(called_at, 0.0), max(done_at - called_at, 0.0), communication)


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: time covered by at least one."""
    total = 0.0
    covered_to = float("-inf")
    for start, end in sorted(intervals):
        if end <= covered_to:
            continue
        total += end - max(start, covered_to)
        covered_to = end
    return total
