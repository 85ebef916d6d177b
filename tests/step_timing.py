"""When each rank of a synchronous job arrives at the end of each step, and what its end-of-step wait is.

The timing model behind the synthetic jobs (tests/synthetic_job.py) and the straggler rule's
simulations (bench/rules_at_scale.py). Every step, rank r works ``mean[r] x noise`` seconds (its
data, forward and backward up to its last bucket; the noise new every step); the step's last
collective completes once the slowest rank's work is done, plus the collectives; every rank then
waits there ``collective + slowest - own`` (the latest rank waits least) and the step took
``slowest + buckets x collective`` on every rank. A rank's persistent spread (its hardware) is in
``mean``; :class:`Spread` draws both the persistent and the per-step factors, lognormal or
heavy-tailed.

:func:`simulate` runs the steps one by one (no averaging shortcut: a heavy-tailed step both makes
its rank late and holds every other rank) and sums them per scrape interval, the way the counters
``tensorplay_step_wait_seconds_total``, ``tensorplay_step_seconds_total`` and
``tensorplay_steps_total`` would grow between two scrapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["COLLECTIVE_S", "BUCKETS_PER_STEP", "KINDS", "Spread", "Timeline", "simulate"]

COLLECTIVE_S = 0.01
"""One bucket's collective, no waiting."""
BUCKETS_PER_STEP = 4
"""Gradient buckets (hook calls, collectives) per step."""
KINDS = ("lognormal", "pareto")
_PARETO_ALPHA = 3.0  # Pareto II (Lomax) shape: a tail P(X > x) ~ x^-3, the least heavy with a finite variance
_LOMAX_MEAN = 1.0 / (_PARETO_ALPHA - 1.0)
_LOMAX_SD = math.sqrt(_PARETO_ALPHA / ((_PARETO_ALPHA - 1.0) ** 2 * (_PARETO_ALPHA - 2.0)))
_CHUNK_CELLS = 2**21  # steps x ranks drawn at once (8 MB of float32)


@dataclass(frozen=True)
class Spread:
    """Multiplicative factors around 1 with a relative spread ``sigma``.

    ``lognormal``: ``exp(N(0, sigma))`` (median 1). ``pareto``: ``1 + sigma (X - E X) / sd X`` with X
    Pareto II of shape 3 -- mean 1, standard deviation ``sigma``, never below ``1 - 0.58 sigma``, and
    a tail in which one draw in a thousand is 10 spreads above the mean (a normal's: one in 10^23).
    """

    sigma: float
    kind: str = "lognormal"

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.sigma < 0:
            raise ValueError(f"a spread is one of {KINDS} with sigma >= 0, got {self}")

    def draw(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """Factors of ``shape`` (float32)."""
        if self.sigma == 0:
            return np.ones(shape, dtype=np.float32)
        if self.kind == "lognormal":
            factors = rng.standard_normal(shape, dtype=np.float32)
            factors *= self.sigma
            return np.exp(factors, out=factors)
        # Inverse CDF of Pareto II on (0, 1], in float64: float32's uniform draws are multiples of
        # 2^-24 and include 0, a tail cut off at 1 in 17 million draws (and 0 made one ~10^4 long).
        survival = 1.0 - rng.random(shape)
        lomax = survival ** (-1.0 / _PARETO_ALPHA) - 1.0
        return (1.0 + (self.sigma / _LOMAX_SD) * (lomax - _LOMAX_MEAN)).astype(np.float32)


@dataclass
class Timeline:
    """A job's steps summed per scrape interval: what the step counters grew by between two scrapes."""

    interval_s: float
    steps: np.ndarray
    """[interval] steps that ended in it."""
    seconds: np.ndarray
    """[interval] their summed duration (the same on every rank: all leave the collective together)."""
    slowest: np.ndarray
    """[interval] the summed work of each step's slowest rank."""
    work: np.ndarray
    """[rank, interval] each rank's summed work."""
    latest: np.ndarray
    """[rank, interval] steps at which the rank was the slowest (the latest to arrive)."""

    @property
    def waits(self) -> np.ndarray:
        """[rank, interval] each rank's summed end-of-step wait: per step, the collective plus how much
        longer the slowest rank worked than it did."""
        return self.steps * COLLECTIVE_S + self.slowest - self.work


def simulate(mean_s: np.ndarray, noise: Spread, duration_s: float, interval_s: float,
             rng: np.random.Generator) -> Timeline:
    """Run a job of ``len(mean_s)`` ranks for ``duration_s`` seconds, step by step.

    Arguments:
        mean_s: each rank's mean work per step (seconds), persistent spread and stragglers included.
        noise: each step's factor on each rank's work.
        duration_s, interval_s: how long, and the scrape interval the sums are taken over.
        rng: the draws (the same generator state gives the same job).
    """
    ranks = len(mean_s)
    intervals = int(math.ceil(duration_s / interval_s))
    mean32 = np.asarray(mean_s, dtype=np.float32)
    steps = np.zeros(intervals)
    seconds = np.zeros(intervals)
    slowest = np.zeros(intervals)
    work = np.zeros((ranks, intervals))
    latest = np.zeros((ranks, intervals))
    chunk = max(1, _CHUNK_CELLS // ranks)
    now = 0.0
    while now < duration_s:
        step_work = noise.draw(rng, (chunk, ranks))
        step_work *= mean32
        last = step_work.argmax(axis=1)
        longest = step_work[np.arange(chunk), last].astype(np.float64)
        ends = now + np.cumsum(longest + BUCKETS_PER_STEP * COLLECTIVE_S)
        kept = ends < duration_s
        which = (ends[kept] // interval_s).astype(np.int64)
        if len(which):
            starts = np.flatnonzero(np.r_[True, which[1:] != which[:-1]])
            columns = which[starts]
            steps[columns] += np.diff(np.r_[starts, len(which)])
            seconds[columns] += np.add.reduceat(longest[kept] + BUCKETS_PER_STEP * COLLECTIVE_S, starts)
            slowest[columns] += np.add.reduceat(longest[kept], starts)
            work[:, columns] += np.add.reduceat(step_work[kept], starts, axis=0).T
            np.add.at(latest, (last[kept], which), 1)
        now = float(ends[-1])
    return Timeline(interval_s, steps, seconds, slowest, work, latest)
