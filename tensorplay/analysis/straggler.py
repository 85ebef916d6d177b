"""Who slows the job, and by how much: a rank's lateness, the straggler rule and its verdict.

The figure (docs/telemetry.md, "Lateness"). At the end of every step each rank waits in the
step's last bucket collective until the last of its peers arrives there; the collective
completes on every rank at about the same moment, so a rank that arrives ``d`` seconds after
its peers waits ``d`` seconds *less* than they do. Its lateness is that difference: the peers'
median end-of-step wait minus its own. It sees extra work wherever it happens -- before the
first bucket (data loading, forward) or between buckets (a bigger share of backward) -- since
a rank late at any bucket is still as late at the last one. Summing the lateness of every
bucket instead would count the same delay once per bucket (a rank that sleeps 40 ms before its
forward is 40 ms late at each of the demo's 3 buckets: the sum says 120 ms, the step lost 40).
Divided by the time the steps took it is the rank's *share*: the fraction of every step the job
waits for it. Clock-free: each figure is one rank's own interval, so it holds across hosts.

The rule. A rank straggles when its share is at least :data:`SHARE_THRESHOLD` and it costs at
least :data:`MIN_LATENESS_S` per step (tiny steps never page); at most
:data:`MAX_RANKS_PER_JOB` of a job are named. The alert writes the same rule in PromQL
(deploy/prometheus/rules/tensorplay.alerts.yml)::

    job_rank:tensorplay_step_lateness:ratio5m >= 0.2                      # SHARE_THRESHOLD
    and on (job, rank) job_rank:tensorplay_step_lateness_seconds:mean5m >= 0.01   # MIN_LATENESS_S
    and on (job, rank) topk by (job) (8, job_rank:tensorplay_step_lateness:ratio5m)  # MAX_RANKS_PER_JOB

where the share is ``job:tensorplay_step_wait_seconds:peers_median_ratio5m -
job_rank:tensorplay_step_wait_seconds:ratio5m`` (each the fraction of its stepping time a rank
waited at the steps' ends) and the peers' median is the median of the job's ranks without the
one that waits least -- exactly the late rank's peers, for 2 ranks the other rank. :func:`lateness` computes the same figure from totals
(a run's spans) and tests/test_straggler_analysis.py checks that the rule file and this module
agree on the thresholds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "SHARE_THRESHOLD",
    "MIN_LATENESS_S",
    "MAX_RANKS_PER_JOB",
    "RankWait",
    "Lateness",
    "Verdict",
    "lateness",
    "straggler_verdict",
]

SHARE_THRESHOLD = 0.20
"""A straggler costs the job at least this fraction of every step: above the latest healthy rank of
a 10,000-rank job (about 13 % at 5 % between-rank spread, ``bench/rules_at_scale.py --noise-floor``),
below a rank with 1.6 times its peers' compute (about 26 %)."""
MIN_LATENESS_S = 0.010
"""... and at least this many seconds per step, so that noise on tiny steps never pages."""
MAX_RANKS_PER_JOB = 8
"""At most this many ranks of a job are named (the highest shares): one node's worth."""


@dataclass(frozen=True)
class RankWait:
    """What one rank measured over the steps compared: its end-of-step waits and how long they took."""

    rank: int
    wait_s: float
    """Sum over the steps of the wait in each step's last bucket collective (seconds)."""
    steps: int
    """Steps summed (the same steps on every rank: those every rank trained, after the first)."""
    seconds: float
    """Wall time those steps took on this rank's own clock."""


@dataclass(frozen=True)
class Lateness:
    """How much of every step the job waits for one rank."""

    rank: int
    share: float
    """Fraction of every step the job waits for this rank (its peers' fraction of time waited minus its own)."""
    per_step_s: float
    """Seconds per step the job waits for this rank."""
    wait_s_per_step: float
    """This rank's own mean end-of-step wait."""
    peers_wait_s_per_step: float
    """The median end-of-step wait of its peers."""


@dataclass(frozen=True)
class Verdict:
    """Which ranks (if any) straggle, the worst first, and the evidence in words."""

    ranks: tuple[int, ...]
    evidence: str
    share: float | None = None
    """The worst straggler's share of every step (None when no rank straggles)."""

    @property
    def rank(self) -> int | None:
        """The rank that costs the job the most, if any straggles."""
        return self.ranks[0] if self.ranks else None


def lateness(ranks: Sequence[RankWait]) -> list[Lateness]:
    """Each rank's lateness (in the order given), as ``job_rank:tensorplay_step_lateness:ratio5m`` has it.

    Ranks without a counted step have no figure; fewer than 2 such ranks, no peers, no figure.
    """
    measured = [r for r in ranks if r.steps > 0 and r.seconds > 0]
    if len(measured) < 2:
        return []
    waited = {r.rank: r.wait_s / r.seconds for r in measured}  # fraction of its stepping time
    earliest = min(measured, key=lambda r: waited[r.rank])
    peers = statistics.median(waited[r.rank] for r in measured if r is not earliest)
    figures = []
    for r in measured:
        step_s = r.seconds / r.steps
        share = peers - waited[r.rank]
        figures.append(Lateness(r.rank, share, share * step_s, waited[r.rank] * step_s, peers * step_s))
    return figures


def _percent(share: float) -> str:
    return f"{100 * share:.0f} %"


def straggler_verdict(ranks: Sequence[RankWait]) -> Verdict:
    """Name the ranks that cost the job a real share of every step, in words."""
    figures = sorted(lateness(ranks), key=lambda f: f.share, reverse=True)
    if not figures:
        return Verdict((), "n/a (needs two or more ranks with end-of-step waits measured)")
    named = [f for f in figures if f.share >= SHARE_THRESHOLD and f.per_step_s >= MIN_LATENESS_S]
    named = named[:MAX_RANKS_PER_JOB]
    worst = figures[0]
    if not named:
        return Verdict((), f"none (highest: rank {worst.rank} costs the job {_percent(max(worst.share, 0.0))} "
                           f"of every step, {1e3 * max(worst.per_step_s, 0.0):.1f} ms; a straggler costs at least "
                           f"{_percent(SHARE_THRESHOLD)} and {1e3 * MIN_LATENESS_S:g} ms)")
    words = [f"rank {f.rank} costs the job {_percent(f.share)} of every step ({1e3 * f.per_step_s:.1f} ms: "
             f"at each step's end its peers wait {1e3 * f.peers_wait_s_per_step:.1f} ms, it waits "
             f"{1e3 * f.wait_s_per_step:.1f} ms)" for f in named]
    return Verdict(tuple(f.rank for f in named), "; ".join(words), named[0].share)
