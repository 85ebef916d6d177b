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
least :data:`MIN_LATENESS_S` per step (tiny steps never page), and does so *most of the time*:
on two steps in three (:data:`LATE_STEPS_FRACTION`) it passes both thresholds too; at most :data:`MAX_RANKS_PER_JOB` of a job are
named. The alert writes the same rule in PromQL (deploy/prometheus/rules/tensorplay.alerts.yml)::

    job_rank:tensorplay_step_lateness:ratio5m >= 0.2                      # SHARE_THRESHOLD
    and on (job, rank) job_rank:tensorplay_step_lateness_seconds:mean5m >= 0.01   # MIN_LATENESS_S
    and on (job, rank) topk by (job) (8, job_rank:tensorplay_step_lateness:ratio5m)  # MAX_RANKS_PER_JOB

where the share is ``job:tensorplay_step_wait_seconds:peers_median_ratio5m -
job_rank:tensorplay_step_wait_seconds:ratio5m`` (each the fraction of its stepping time a rank
waited at the steps' ends) and the peers' median is the median of the job's ranks without the
one that waits least -- exactly the late rank's peers, for 2 ranks the other rank; "most of the
time" is the alert's ``for: 10m``: the 5-minute figure must pass at every evaluation for 10
minutes, so a burst of contention (a few bad steps in a window of hundreds) never fires. A run
the verdict judges is often only tens of steps long, where a few bad steps move the mean as much
as a rank late on every step does; so the verdict weighs each step as the alert weighs each
window: :func:`lateness` computes the same figure for every step and the rank is named only if
it was that late on two steps in three. How sure the verdict is, is said in its words: on how
many steps the rank was late and on how many the latest to arrive, and its median lateness
beside the mean. tests/test_straggler_analysis.py checks that the rule
file and this module agree on the thresholds and on the persistence.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "SHARE_THRESHOLD",
    "ALERT_FOR_WINDOWS",
    "MIN_LATENESS_S",
    "MAX_RANKS_PER_JOB",
    "LATE_STEPS_FRACTION",
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
LATE_STEPS_FRACTION = 2 / 3
"""... and is late past both thresholds on at least this fraction of the steps compared: two steps
in three. Contention on a shared host comes and goes within a run and makes a healthy rank late
on some of its steps (and its median step, at times); a rank with more work than its peers is
late on nearly every step."""
ALERT_FOR_WINDOWS = 2
"""The alert's ``for:`` spans this many of its 5-minute windows: it holds for more than one window, as the
verdict asks two steps in three to pass the thresholds: a rank named is late most of the time, not in one burst."""


@dataclass(frozen=True)
class RankWait:
    """What one rank measured over the steps compared: each step's end-of-step wait and how long it took."""

    rank: int
    waits_s: tuple[float, ...]
    """Per step compared, the wait in its last bucket collective (seconds)."""
    steps_s: tuple[float, ...]
    """Per step compared, the wall time it took on this rank's own clock (end of the step before to its end)."""

    @property
    def steps(self) -> int:
        """Steps compared (the same steps on every rank: those every rank trained, after the first)."""
        return len(self.waits_s)

    @property
    def wait_s(self) -> float:
        """Sum of the waits over the steps compared."""
        return float(sum(self.waits_s))

    @property
    def seconds(self) -> float:
        """Wall time the steps compared took on this rank's clock."""
        return float(sum(self.steps_s))


@dataclass(frozen=True)
class Lateness:
    """How much of every step the job waits for one rank, over the run and step by step."""

    rank: int
    share: float
    """Fraction of every step the job waits for this rank (its peers' fraction of time waited minus its own)."""
    per_step_s: float
    """Seconds per step the job waits for this rank (the mean)."""
    wait_s_per_step: float
    """This rank's own mean end-of-step wait."""
    peers_wait_s_per_step: float
    """The median end-of-step wait of its peers."""
    latest_steps: int
    """Steps at which it was the latest to arrive (it waited the least)."""
    late_steps: int
    """Steps at which it cost the job at least the threshold share and seconds."""
    steps: int
    """Steps compared."""
    median_share: float
    """Its share of the median step (each step's peers' median wait minus its own, over that step)."""
    median_s: float
    """Its lateness at the median step (seconds)."""

    def passes(self) -> bool:
        """The rule: the run's mean costs the job the threshold share and seconds, and so do two steps in three."""
        return (self.share >= SHARE_THRESHOLD and self.per_step_s >= MIN_LATENESS_S
                and self.late_steps >= LATE_STEPS_FRACTION * self.steps)


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


def _shares(fractions: Sequence[float]) -> list[float]:
    """Each rank's peers' median fraction waited minus its own: the peers are all but the one that waits least."""
    earliest = min(range(len(fractions)), key=fractions.__getitem__)
    peers = statistics.median(f for i, f in enumerate(fractions) if i != earliest)
    return [peers - f for f in fractions]


def lateness(ranks: Sequence[RankWait]) -> list[Lateness]:
    """Each rank's lateness (in the order given), as ``job_rank:tensorplay_step_lateness:ratio5m`` has it.

    Ranks without a counted step have no figure; fewer than 2 such ranks, no peers, no figure.
    The per-step figures are taken over the steps every measured rank compared.
    """
    measured = [r for r in ranks if r.steps > 0 and r.seconds > 0]
    if len(measured) < 2:
        return []
    waited = [r.wait_s / r.seconds for r in measured]  # fraction of its stepping time
    shares = _shares(waited)
    steps = min(r.steps for r in measured)
    by_step = [_shares([r.waits_s[i] / r.steps_s[i] if r.steps_s[i] > 0 else 0.0 for r in measured])
               for i in range(steps)]
    latest = [min(range(len(measured)), key=lambda j: (-row[j], j)) for row in by_step]
    figures = []
    for j, r in enumerate(measured):
        step_s = r.seconds / r.steps
        share = shares[j]
        peers = share + waited[j]
        step_shares = [row[j] for row in by_step]
        step_seconds = [s * r.steps_s[i] for i, s in enumerate(step_shares)]
        figures.append(Lateness(
            rank=r.rank, share=share, per_step_s=share * step_s, wait_s_per_step=waited[j] * step_s,
            peers_wait_s_per_step=peers * step_s, latest_steps=latest.count(j),
            late_steps=sum(share >= SHARE_THRESHOLD and seconds >= MIN_LATENESS_S
                           for share, seconds in zip(step_shares, step_seconds)),
            steps=steps, median_share=statistics.median(step_shares), median_s=statistics.median(step_seconds),
        ))
    return figures


def _percent(share: float) -> str:
    return f"{100 * share:.0f} %"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms"


def _how_sure(f: Lateness) -> str:
    """On how many steps the rank was late and the latest, and its median lateness beside the mean."""
    return (f"late on {f.late_steps} and the latest on {f.latest_steps} of {f.steps} steps, median "
            f"{_ms(max(f.median_s, 0.0))} late (mean {_ms(max(f.per_step_s, 0.0))})")


def straggler_verdict(ranks: Sequence[RankWait]) -> Verdict:
    """Name the ranks that cost the job a real share of most steps, in words that say how sure."""
    figures = sorted(lateness(ranks), key=lambda f: f.share, reverse=True)
    if not figures:
        return Verdict((), "n/a (needs two or more ranks with end-of-step waits measured)")
    named = [f for f in figures if f.passes()][:MAX_RANKS_PER_JOB]
    worst = figures[0]
    if not named:
        return Verdict((), f"none (highest: rank {worst.rank} costs the job {_percent(max(worst.share, 0.0))} "
                           f"of every step, {_how_sure(worst)}; a straggler costs at least "
                           f"{_percent(SHARE_THRESHOLD)} and {1e3 * MIN_LATENESS_S:g} ms, on two steps in three too)")
    words = [f"rank {f.rank} costs the job {_percent(f.share)} of every step ({_ms(f.per_step_s)}: "
             f"at each step's end its peers wait {_ms(f.peers_wait_s_per_step)}, it waits "
             f"{_ms(f.wait_s_per_step)}; {_how_sure(f)})" for f in named]
    return Verdict(tuple(f.rank for f in named), "; ".join(words), named[0].share)
