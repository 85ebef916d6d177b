"""The straggler verdict of a run read from its spans: the demo's rule, on figures from the spans.

The rule itself lives in :func:`tensorplay.demo.report.straggler_verdict` (the one the demo's
text report and the ``TensorplayStragglerRank`` alert follow); this module only feeds it each
rank's mean compute and median allreduce latency as :class:`~tensorplay.report.aggregate.Run`
derives them from the spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tensorplay.demo.report import Verdict, straggler_verdict

from .aggregate import Run

__all__ = ["SpanTiming", "rank_timings", "run_verdict"]


@dataclass(frozen=True)
class SpanTiming:
    """One rank's mean compute per step and median allreduce latency, from its spans."""

    rank: int
    compute_ms_mean: float | None
    latency_ms_p50: float | None


def _or_none(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


def rank_timings(run: Run) -> list[SpanTiming]:
    """Each rank's figures the verdict weighs, in rank order."""
    return [SpanTiming(int(rank), _or_none(compute), _or_none(latency))
            for rank, compute, latency in zip(run.ranks, run.compute_ms_mean(), run.latency_ms_p50())]


def run_verdict(run: Run) -> Verdict:
    """Which rank straggles in ``run``, with the evidence in words."""
    return straggler_verdict(rank_timings(run))
