"""Who slows the job, and by how much: a rank's lateness, the straggler rule and its verdict.

The figure (docs/telemetry.md, "Lateness"). At the end of every step each rank waits in the
step's last bucket collective until the last of its peers arrives there; the collective
completes on every rank at about the same moment, so a rank that arrives ``d`` seconds after
its peers waits ``d`` seconds *less* than they do. Its lateness is that difference: the peers'
median end-of-step wait minus its own. Divided by the time the steps took it is the rank's
*share*: the fraction of every step the job waits for it -- what the user pays. Clock-free: each
figure is one rank's own interval, so it holds across hosts.

The rule: a rank straggles when its cost stands out from its peers' by more than the job's own
noise explains, in each of :data:`WINDOWS` disjoint windows (docs/telemetry.md, "Lateness";
deploy/README.md, "Straggler rule"):

* the job's noise is the robust spread of the *peers'* shares (every rank but the one with the
  highest share, whose shares have median 0 by construction): ``1.4826 x`` their median absolute
  share (:data:`MAD_TO_SIGMA`: the median absolute deviation scaled to a normal's standard
  deviation), never less than :data:`SPREAD_FLOOR`. A job of 2 or 3 ranks has one or two peers,
  whose shares say at most one difference: its spread is taken to be at least :data:`SMALL_JOB_SPREAD`;
* the threshold is ``k`` times that spread, ``k`` = :func:`noise_multiplier` of the number of
  ranks: the normal quantile that keeps a healthy job under :data:`FALSE_ALARMS_PER_DAY` false
  stragglers a day (the formula and its assumptions are in :func:`noise_multiplier`);
* the rank also costs at least :data:`MIN_LATENESS_S` per step (tiny steps never page), and at
  most :data:`MAX_RANKS_PER_JOB` of a job are named, the highest shares;
* its severity is ``critical`` from :data:`CRITICAL_SHARE` of every step, ``warning`` under it
  (:func:`severity`); the alert keeps a rank's critical down to :data:`CRITICAL_HOLD_SHARE`, so
  that a share wandering about the line does not turn it over at every evaluation.

deploy/prometheus/rules/tensorplay.rules.yml writes the same rule in PromQL: one 5-minute window
is ``job_rank:tensorplay_step_lateness:outlier_ratio5m``; the windows are the figure now,
``offset 5m`` and ``offset 10m``. A run the verdict judges is often tens of steps long: its
windows are the compared steps split into :data:`WINDOWS` consecutive blocks, each judged as a
5-minute window is (:func:`outliers`), and the rank must pass in every block.
tests/test_straggler_analysis.py evaluates the rule files in ``promtool`` and this module on the
same figures and checks that they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "FALSE_ALARMS_PER_DAY",
    "EVALUATION_INTERVAL_S",
    "WINDOW_S",
    "WINDOWS",
    "SPREAD_FLOOR",
    "SMALL_JOB_RANKS",
    "SMALL_JOB_SPREAD",
    "MAD_TO_SIGMA",
    "MIN_LATENESS_S",
    "CRITICAL_SHARE",
    "CRITICAL_HOLD_SHARE",
    "MAX_RANKS_PER_JOB",
    "evaluations_per_day",
    "noise_multiplier",
    "shares_of",
    "Noise",
    "job_noise",
    "outliers",
    "severity",
    "RankWait",
    "Lateness",
    "Verdict",
    "lateness",
    "straggler_verdict",
]

FALSE_ALARMS_PER_DAY = 0.001
"""The false-alarm rate the threshold is set for: one straggler alert on a healthy job in 1,000 job-days (a
fleet of 100 jobs: one in 10 days). Low enough that the right tail of a lognormal spread, longer than the
normal's that ``k`` assumes, stays under the line too (bench/rules_at_scale.py --noise-floor --spread 0.1)."""
EVALUATION_INTERVAL_S = 15.0
"""Prometheus' rule evaluation interval (deploy/prometheus/prometheus.yml): 5,760 evaluations a day."""
WINDOW_S = 300.0
"""One window: the recording rules' 5m."""
WINDOWS = 3
"""Disjoint windows that must agree: now, ``offset 5m`` and ``offset 10m``; for a run, its compared steps in thirds."""
SPREAD_FLOOR = 0.02
"""The least spread of the peers' shares the rule assumes (2 % of every step): a very tight job is judged
as if its healthy ranks spread this much."""
SMALL_JOB_RANKS = 3
"""A job of this many ranks or fewer has too few peers to measure a spread by: a 2-rank job's one peer has
share 0 by construction (nothing to measure), a 3-rank job's two peers one difference between them."""
SMALL_JOB_SPREAD = 0.08
"""The least spread such a job is taken to have. 8 %: what the ranks of a short run spread on a loaded
shared host (the demo's 4 ranks on 2 busy cores: up to ±9 % per block), so that a straggler of 2 or 3 ranks
is named from 3.5-3.6 x 8 % = 28-29 % of every step, over the 10-14 % by which one rank of a plain 2-rank
demo beside a 3-rank one can be later in every block, or the two healthy ranks of a 3-rank demo can differ
in a block of a few steps."""
MAD_TO_SIGMA = 1.4826
"""The median absolute deviation of a normal distribution is its standard deviation / 1.4826."""
MIN_LATENESS_S = 0.002
"""A straggler costs the job at least this many seconds per step: tiny steps never page."""
CRITICAL_SHARE = 0.20
"""From this share of every step a straggler's severity is ``critical`` (below it, ``warning``)."""
CRITICAL_HOLD_SHARE = 0.18
"""A rank whose critical alert fires stays critical down to this share (the alert's hysteresis)."""
MAX_RANKS_PER_JOB = 8
"""At most this many ranks of a job are named (the highest shares): one node's worth."""

# Abramowitz & Stegun 26.2.23: the upper-tail normal quantile from t = sqrt(-2 ln p), |error| < 4.5e-4.
# The rule file evaluates the same polynomial (job:tensorplay_step_lateness:noise_multiplier5m).
_QUANTILE_NUMERATOR = (2.515517, 0.802853, 0.010328)
_QUANTILE_DENOMINATOR = (1.0, 1.432788, 0.189269, 0.001308)


def evaluations_per_day(interval_s: float = EVALUATION_INTERVAL_S) -> float:
    """How many times a day Prometheus evaluates the rule."""
    return 86400.0 / interval_s


def _tail_t(probability: float) -> float:
    return math.sqrt(-2.0 * math.log(probability))


def _quantile_of_t(t: float) -> float:
    numerator = sum(c * t**i for i, c in enumerate(_QUANTILE_NUMERATOR))
    denominator = sum(d * t**i for i, d in enumerate(_QUANTILE_DENOMINATOR))
    return t - numerator / denominator


def noise_multiplier(ranks: int, windows: int = WINDOWS, interval_s: float = EVALUATION_INTERVAL_S,
                     false_alarms_per_day: float = FALSE_ALARMS_PER_DAY) -> float:
    """``k``: how many spreads above its peers a rank's share must be, for a job of ``ranks`` ranks.

    A healthy rank's share in a window is its lasting offset (its hardware: the same in every
    window) plus the window's own noise (new in every disjoint window); the peers' spread
    measures both together. Taken as normal with that spread, a job fires falsely in two ways:

    * a rank whose lasting offset alone passes the line fires and stays: at most ``N Q(k)`` per
      job, whatever the number of windows (windows that must agree cannot help against it);
    * the window noise pushes a rank over the line in each of ``W`` disjoint windows: at most
      ``N E Q(k)^W`` a day, ``E`` evaluations a day each a new chance (an overcount: overlapping
      windows share their noise).

    ``k`` keeps each under half of :data:`FALSE_ALARMS_PER_DAY` (``F``, for a job that runs a
    day): the larger of ``z(F / 2N)`` and ``z((F / 2NE)^(1/W))``. With 3 windows the first is the
    larger for every ``N`` (it is whenever ``(2N/F)^(W-1) >= E``), so the rule file writes only
    ``z(F / 2N)``; with one window ``k`` would be ``z(F / 2NE)``: 6.7 instead of 5.3 at 10,000 ranks.
    """
    if ranks < 1:
        raise ValueError(f"a job has at least one rank, got {ranks}")
    lasting = false_alarms_per_day / (2.0 * ranks)
    per_window = (false_alarms_per_day / (2.0 * ranks * evaluations_per_day(interval_s))) ** (1.0 / windows)
    return _quantile_of_t(max(_tail_t(min(lasting, 0.5)), _tail_t(min(per_window, 0.5))))


def shares_of(fractions: Sequence[float] | np.ndarray) -> np.ndarray:
    """Each rank's share from the fractions of their stepping time the ranks waited at the steps' ends:
    the peers' median fraction minus its own (the peers: every rank but the one that waits least).

    ``fractions`` is one value per rank, or ranks x columns (each column a step or window on its own).
    """
    waited = np.asarray(fractions, dtype=float)
    return np.median(np.sort(waited, axis=0)[1:], axis=0) - waited


@dataclass(frozen=True)
class Noise:
    """How much a job's healthy ranks' shares spread in one window, and the line it draws."""

    ranks: int
    spread: float
    """The peers' spread as measured: 1.4826 x their median absolute share (0 for a 2-rank job, half the
    difference of the two peers' for 3 ranks)."""
    multiplier: float
    """``k`` for this many ranks (:func:`noise_multiplier`)."""

    @property
    def floor(self) -> float:
        """The least spread taken: :data:`SMALL_JOB_SPREAD` up to :data:`SMALL_JOB_RANKS` ranks, else
        :data:`SPREAD_FLOOR`."""
        return SMALL_JOB_SPREAD if self.ranks <= SMALL_JOB_RANKS else SPREAD_FLOOR

    @property
    def floored(self) -> bool:
        """Whether the floor, not the measured spread, sets the line."""
        return self.spread < self.floor

    @property
    def threshold(self) -> float:
        """The share a straggler passes: ``k x max(spread, floor)``."""
        return self.multiplier * max(self.spread, self.floor)


def job_noise(shares: Sequence[float] | np.ndarray) -> Noise:
    """The job's noise in one window from its ranks' shares (two or more), as
    ``job:tensorplay_step_lateness:threshold_ratio5m`` computes it."""
    values = np.asarray(shares, dtype=float)
    if len(values) < 2:
        raise ValueError("a job's noise needs two or more ranks' shares")
    peers = np.delete(values, int(np.argmax(values)))
    return Noise(len(values), MAD_TO_SIGMA * float(np.median(np.abs(peers))), noise_multiplier(len(values)))


def outliers(shares: Sequence[float] | np.ndarray, seconds_per_step: Sequence[float] | np.ndarray,
             noise: Noise | None = None) -> np.ndarray:
    """One window's decision, per rank: its share passes the job's threshold and costs at least
    :data:`MIN_LATENESS_S` per step (``job_rank:tensorplay_step_lateness:outlier_ratio5m``).
    ``noise``: the window's :func:`job_noise`, when the caller has it already."""
    values = np.asarray(shares, dtype=float)
    threshold = (noise or job_noise(values)).threshold
    return (values >= threshold) & (np.asarray(seconds_per_step, dtype=float) >= MIN_LATENESS_S)


def severity(share: float) -> str:
    """The alert's severity for a straggler of this share of every step (a rank not critical before)."""
    return "critical" if share >= CRITICAL_SHARE else "warning"


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
    """How much of every step the job waits for one rank, over the run, block by block and step by step."""

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
    steps: int
    """Steps compared."""
    median_share: float
    """Its share of the median step (each step's peers' median wait minus its own, over that step)."""
    median_s: float
    """Its lateness at the median step (seconds)."""
    block_shares: tuple[float, ...]
    """Its share in each block of the compared steps (the run's windows)."""
    block_thresholds: tuple[float, ...]
    """The job's threshold in each block."""
    outlier_blocks: int
    """Blocks in which it passed the job's threshold and cost at least :data:`MIN_LATENESS_S` per step."""

    def passes(self) -> bool:
        """The rule: above the job's noise, by the share and the seconds, in every block."""
        return len(self.block_shares) == WINDOWS and self.outlier_blocks == WINDOWS


@dataclass(frozen=True)
class Verdict:
    """Which ranks (if any) straggle, the worst first, and the evidence in words."""

    ranks: tuple[int, ...]
    evidence: str
    share: float | None = None
    """The worst straggler's share of every step (None when no rank straggles)."""
    noise: Noise | None = None
    """The job's noise over the whole run (None without two ranks measured)."""

    @property
    def rank(self) -> int | None:
        """The rank that costs the job the most, if any straggles."""
        return self.ranks[0] if self.ranks else None

    @property
    def severity(self) -> str | None:
        """The worst straggler's severity, as the alert's label (None when no rank straggles)."""
        return None if self.share is None else severity(self.share)


def _fractions(waits: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Per rank, waits over stepping time (0 for a rank whose steps took no time)."""
    total = seconds.sum(axis=1)
    return np.divide(waits.sum(axis=1), total, out=np.zeros(len(total)), where=total > 0)


def lateness(ranks: Sequence[RankWait]) -> list[Lateness]:
    """Each rank's lateness (in the order given), as ``job_rank:tensorplay_step_lateness:ratio5m`` has it.

    Ranks without a counted step have no figure; fewer than 2 such ranks, no peers, no figure.
    The figures are taken over the steps every measured rank compared; the blocks are those steps
    in :data:`WINDOWS` consecutive thirds (fewer blocks when fewer steps were compared).
    """
    measured = [r for r in ranks if r.steps > 0 and r.seconds > 0]
    if len(measured) < 2:
        return []
    steps = min(r.steps for r in measured)
    waits = np.array([r.waits_s[:steps] for r in measured], dtype=float)
    seconds = np.array([r.steps_s[:steps] for r in measured], dtype=float)
    shares = shares_of(_fractions(waits, seconds))
    by_step = shares_of(np.divide(waits, seconds, out=np.zeros_like(waits), where=seconds > 0))
    latest = np.argmax(by_step, axis=0)  # ties: the lowest index, as the order given
    blocks = [b for b in np.array_split(np.arange(steps), WINDOWS) if len(b)]
    block_shares, block_noise, block_outliers = [], [], []
    for block in blocks:
        block_share = shares_of(_fractions(waits[:, block], seconds[:, block]))
        block_shares.append(block_share)
        block_noise.append(job_noise(block_share))
        block_outliers.append(outliers(block_share, block_share * seconds[:, block].mean(axis=1), block_noise[-1]))
    figures = []
    for j, r in enumerate(measured):
        step_s = r.seconds / r.steps
        fraction = r.wait_s / r.seconds
        step_seconds = by_step[j] * seconds[j]
        figures.append(Lateness(
            rank=r.rank, share=float(shares[j]), per_step_s=float(shares[j]) * step_s,
            wait_s_per_step=fraction * step_s, peers_wait_s_per_step=(float(shares[j]) + fraction) * step_s,
            latest_steps=int(np.count_nonzero(latest == j)), steps=steps,
            median_share=float(np.median(by_step[j])), median_s=float(np.median(step_seconds)),
            block_shares=tuple(float(s[j]) for s in block_shares),
            block_thresholds=tuple(n.threshold for n in block_noise),
            outlier_blocks=sum(bool(o[j]) for o in block_outliers),
        ))
    return figures


def _percent(share: float) -> str:
    return f"{100 * share:.0f} %"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms"


def _noise_words(noise: Noise) -> str:
    """The job's noise and the line it draws: "its peers spread ±0.3 %, so the job's noise explains up to 6 % (...)"."""
    if noise.ranks <= SMALL_JOB_RANKS and noise.floored:
        peers = "one peer" if noise.ranks == 2 else "two peers"
        return (f"{peers}, too few to measure a spread by: the job's noise is taken to explain up to "
                f"{_percent(noise.threshold)} ({noise.multiplier:.1f} x ±{100 * noise.floor:.0f} %, a {noise.ranks}-rank job's)")
    used = "the floor" if noise.floored else "their spread"
    return (f"its peers spread ±{100 * noise.spread:.1f} %, so the job's noise explains up to "
            f"{_percent(noise.threshold)} ({noise.multiplier:.1f} x ±{100 * max(noise.spread, noise.floor):.1f} %, {used})")


def _blocks_words(f: Lateness) -> str:
    shares = ", ".join(_percent(max(s, 0.0)) for s in f.block_shares)
    return f"above it in {f.outlier_blocks} of {len(f.block_shares)} blocks of ~{f.steps // max(len(f.block_shares), 1)} steps ({shares})"


def _how_sure(f: Lateness) -> str:
    """On how many steps the rank was the latest, and its median lateness beside the mean."""
    return f"the latest on {f.latest_steps} of {f.steps} steps, median {_ms(max(f.median_s, 0.0))} late"


def straggler_verdict(ranks: Sequence[RankWait]) -> Verdict:
    """Name the ranks that cost the job more than its own noise explains, in words that say how sure."""
    figures = sorted(lateness(ranks), key=lambda f: f.share, reverse=True)
    if not figures:
        return Verdict((), "n/a (needs two or more ranks with end-of-step waits measured)")
    noise = job_noise([f.share for f in figures])
    named = [f for f in figures if f.passes()][:MAX_RANKS_PER_JOB]
    worst = figures[0]
    if not named:
        return Verdict((), f"none (highest: rank {worst.rank} costs the job {_percent(max(worst.share, 0.0))} of every "
                           f"step, {_ms(max(worst.per_step_s, 0.0))}; {_noise_words(noise)}; {_blocks_words(worst)}; "
                           f"{_how_sure(worst)}; a straggler is above the job's noise in each of {WINDOWS} blocks and "
                           f"costs at least {1e3 * MIN_LATENESS_S:g} ms per step)", noise=noise)
    words = [f"rank {f.rank} costs the job {_percent(f.share)} of every step ({_ms(f.per_step_s)}, {severity(f.share)}); "
             f"{_noise_words(noise)}; {_blocks_words(f)}; at each step's end its peers wait "
             f"{_ms(f.peers_wait_s_per_step)}, it waits {_ms(f.wait_s_per_step)}; {_how_sure(f)}" for f in named]
    return Verdict(tuple(f.rank for f in named), "; and ".join(words), named[0].share, noise)
