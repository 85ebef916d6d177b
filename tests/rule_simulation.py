"""The straggler rule run in Python over simulated jobs: what Prometheus would fire, evaluation by evaluation.

Over a job's steps summed per 15 s scrape interval (:func:`tests.step_timing.simulate`), every
evaluation takes each rank's 5-minute window as the recording rules do -- its end-of-step waits
over its stepping time -- and judges it with ``tensorplay.analysis.straggler.outliers``, the
function tests/test_straggler_analysis.py ties to the rule files; a rank is a straggler once the
windows 5 and 10 minutes back agree (at most 8 a job), and its alert fires once it has been one
for the alert's ``for:`` (2m), at one severity at a time as the two rules of the alert have it:
``critical`` from 20 % of every step (held down to 18 % once firing, and firing on for its
``keep_firing_for`` once under that), ``warning`` for every other straggler. This is how
bench/rules_at_scale.py runs a whole day of 10,000 ranks, which backfilling Prometheus cannot reach. The windows are whole: the first
evaluation is 5 minutes into the job (Prometheus has partial windows before; a job younger than
its three windows has no straggler either way).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from tensorplay.analysis.straggler import (
    CRITICAL_HOLD_SHARE, CRITICAL_SHARE, MAX_RANKS_PER_JOB, WINDOW_S, WINDOWS, job_noise, outliers, shares_of,
)

from .step_timing import Timeline

__all__ = ["ALERT_FOR_S", "RuleRun", "run_rule"]

ALERT_FOR_S = 120.0
"""TensorplayStragglerRank's ``for:``, and its critical rule's ``keep_firing_for``."""


@dataclass
class RuleRun:
    """What the rule did over a job, evaluation by evaluation."""

    windows: int
    evaluations: int = 0
    outlier_evaluations: int = 0
    """Evaluations at which some rank was above the job's noise in its current window."""
    straggler_evaluations: int = 0
    """Evaluations at which some rank was a straggler (its windows agreed)."""
    alerts: list[tuple[int, str, float]] = field(default_factory=list)
    """Alerts that fired: (rank, severity, seconds into the job)."""
    first_named_s: dict[int, float] = field(default_factory=dict)
    """Each rank named a straggler, and when first (seconds into the job)."""
    highest_share: float = float("-inf")
    """The highest share of any rank at any evaluation."""
    lowest_threshold: float = float("inf")
    highest_threshold: float = float("-inf")
    """The job's threshold over the evaluations."""

    def fired(self, rank: int | None = None) -> int:
        """Alerts that fired (of ``rank``)."""
        return sum(1 for r, _, _ in self.alerts if rank is None or r == rank)


def run_rule(timelines: Iterable[Timeline], windows: int = WINDOWS, hold_s: float = ALERT_FOR_S) -> RuleRun:
    """Evaluate the rule after every scrape interval of the job whose steps ``timelines`` hold, in order
    (a long job in pieces: each piece's intervals follow the last's). ``windows``: how many disjoint
    windows must agree (1: the current window alone)."""
    run = RuleRun(windows)
    recent: deque = deque()  # the last window's intervals: (waits[rank], seconds, steps)
    outlying: deque = deque()  # each evaluation's outliers, as far back as the oldest window read
    held: dict[tuple[int, str], int] = {}  # evaluations each (rank, severity) has been returned since it went pending
    critical_firing: set[int] = set()
    kept: dict[int, int] = {}  # a firing critical no longer returned: evaluations since it last was
    elapsed = 0
    for timeline in timelines:
        interval_s = timeline.interval_s
        per_window = int(round(WINDOW_S / interval_s))
        hold = int(round(hold_s / interval_s))
        waits = timeline.waits
        for column in range(len(timeline.steps)):
            elapsed += 1
            recent.append((waits[:, column], timeline.seconds[column], timeline.steps[column]))
            if len(recent) > per_window:
                recent.popleft()
            if len(recent) < per_window:
                continue
            waited = np.sum([w for w, _, _ in recent], axis=0)
            seconds = sum(s for _, s, _ in recent)
            steps = sum(n for _, _, n in recent)
            shares = shares_of(waited / seconds)
            noise = job_noise(shares)
            outlier = outliers(shares, shares * seconds / steps, noise)
            run.lowest_threshold = min(run.lowest_threshold, noise.threshold)
            run.highest_threshold = max(run.highest_threshold, noise.threshold)
            outlying.append(outlier)
            if len(outlying) > (windows - 1) * per_window + 1:
                outlying.popleft()
            run.evaluations += 1
            run.highest_share = max(run.highest_share, float(shares.max()))
            run.outlier_evaluations += bool(outlier.any())
            agreed = outlier.copy()
            for back in range(1, windows):
                agreed &= outlying[-1 - back * per_window] if len(outlying) > back * per_window else False
            named = sorted(np.flatnonzero(agreed), key=lambda r: -shares[r])[:MAX_RANKS_PER_JOB]
            run.straggler_evaluations += bool(named)
            now_s = elapsed * interval_s
            for r in named:
                run.first_named_s.setdefault(int(r), now_s)
            # The critical rule first, then the warning, which reads whether the critical fires now.
            holding = {int(r) for r in named if shares[r] >= CRITICAL_HOLD_SHARE}
            critical = {int(r) for r in named if shares[r] >= CRITICAL_SHARE} | (holding & critical_firing)
            critical_firing = _hold(held, "critical", critical, hold, now_s, run.alerts, keeps_firing=True)
            for r in critical_firing - critical:  # keep_firing_for: 0 at the first evaluation not returned
                kept[r] = kept.get(r, -1) + 1
            for r in list(kept):
                if r in critical or r not in critical_firing:
                    del kept[r]
                elif kept[r] >= hold:
                    del kept[r], held[(r, "critical")]
                    critical_firing.discard(r)
            _hold(held, "warning", {int(r) for r in named} - (holding & critical_firing), hold, now_s, run.alerts,
                  keeps_firing=False)
    return run


def _hold(held: dict[tuple[int, str], int], severity: str, returned: set[int], hold: int, now_s: float,
          alerts: list[tuple[int, str, float]], keeps_firing: bool) -> set[int]:
    """One rule's evaluation: the ranks it returned go pending or stay, fire once held ``hold``
    evaluations more; the others are dropped, but for firing ones of a rule that ``keeps_firing``
    (the caller ends them after its keep_firing_for). Returns the ranks firing at this severity."""
    for rank in returned:
        key = (rank, severity)
        held[key] = held.get(key, 0) + 1
        if held[key] == hold + 1:
            alerts.append((*key, now_s))
    for key in [k for k in held if k[1] == severity and k[0] not in returned]:
        if not keeps_firing or held[key] <= hold:
            del held[key]
    return {rank for rank, sev in held if sev == severity and held[(rank, sev)] > hold}

