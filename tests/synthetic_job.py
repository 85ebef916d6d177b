"""A synthetic training job: what N tensorplay ranks would have served Prometheus for T minutes.

The series come from the real exposition: :func:`exposition` gives every family of
``tensorplay.telemetry.metrics.TensorplayMetrics`` a child for one rank (and each hook), renders
it with prometheus_client's OpenMetrics writer and reads back names, types, labels and histogram
``le`` buckets. A family added to or dropped from the code changes the synthetic job with it; a
family this module has no model of is an error, so nothing is generated that the code does not
serve and nothing the code serves is left out.

:class:`SyntheticJob` fills those series for ``ranks`` ranks at a 15 s scrape interval:

* compute per step: the job's typical step (0.2 s) times a per-rank factor of 5 % spread
  (``spread``; lognormal, or heavy-tailed with ``spread_kind="pareto"``: its hardware); a rank of
  ``Scenario.slow_ranks`` computes ``slow_factor`` times the typical step (its draw replaced, so a
  x1.6 straggler is x1.6 of the job's typical rank, not of its own draw); ``uniform_factor``
  slows every rank alike. Every rank runs the same number of steps (synchronous DDP: the slowest
  rank sets the pace);
* backward between the buckets: 0.1 s a step on every rank; a rank of ``Scenario.backward_ranks``
  takes ``backward_factor`` times that (a bigger batch: work its compute time never sees). A
  rank's *work* per step is its compute plus its backward;
* allreduce latency: a fixed collective time per bucket, plus, in the first bucket of a step, the
  wait for the slowest rank (a straggler waits least);
* the end-of-step wait (``tensorplay_step_wait_seconds_total``, ``tensorplay_step_seconds_total``,
  ``tensorplay_steps_total``) and the steps themselves: run step by step by tests/step_timing.py
  -- every step each rank's work times the step's own noise (``step_noise``: 10 % lognormal by
  default), the step as long as its slowest rank's work plus the collectives, each rank's wait the
  collective plus how much longer the slowest worked; a rank counts none of them while it
  shadows in the Join, and a rank with several hooks splits the wait between them (one DDP model
  each, every one a whole iteration long);
* the step timeline over the same counted steps: exposed communication is the end-of-step wait
  (what follows the last hook call), communication adds the other buckets' collectives, which the
  backward hides, and busy time is the rest of the step (busy + exposed = the step);
* bytes, compression error and wire bytes from the hook's name (fp16/bf16 halve the bytes);
* one Join halfway through the job: on a healthy job every rank shadows 0-2 iterations; with
  ``uneven_join`` 90 % of the ranks shadow 10 or more (each a different count); the Join series
  exist from that Join on, as they do on a real rank;
* ``overflow_hooks``: from halfway on, 70 % of the ranks make elements non-finite with these hooks
  every scrape (a different rate per rank);
* one optimizer step and one gradient reduction per step; a replica fingerprint every 100 steps,
  the same on every rank; ``unreduced_ranks``: from halfway on, these ranks reduce no gradient
  (every step of theirs is unreduced) and each holds a fingerprint of its own.
* the compression advice of each hook's gradients: every candidate's error (a typical value per
  candidate, a different factor per rank), its wire ratio (that of float32 buckets), and the
  elements it would make non-finite: none, but fp16's on the ranks that overflow (the same gradients
  overflow its cast), from halfway on, where its error is then +Inf.

:meth:`SyntheticJob.write_openmetrics` writes ranks ``[first, last)`` as OpenMetrics text with
timestamps, the input of ``promtool tsdb create-blocks-from openmetrics``; a large job is written
in several files, each a block of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, ClassVar, Iterable, Sequence, TextIO

import numpy as np
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tensorplay.telemetry.metrics import ReplicaFingerprints, TensorplayMetrics
from tensorplay.telemetry.names import Candidate, Metric

from .step_timing import BUCKETS_PER_STEP, COLLECTIVE_S, Spread, Timeline, simulate

__all__ = [
    "SCRAPE_INTERVAL_S",
    "RANKS_PER_NODE",
    "Family",
    "Scenario",
    "Series",
    "SyntheticJob",
    "exposition",
    "series_per_rank",
    "standard_scenarios",
]

SCRAPE_INTERVAL_S = 15.0
RANKS_PER_NODE = 8
"""Ranks of one node: `instance` is ``node-<rank // 8>:<9400 + rank % 8>``; a slow node is 8 ranks."""

_STEP_S = 0.2  # the job's typical compute per step
_BACKWARD_S = 0.1  # backward between the first and the last bucket, every rank alike
_STEP_NOISE = 0.1  # lognormal sigma of one step's work around its rank's mean
_BUCKET_BYTES = 25 * 2**20
_LATENCY_NOISE = 0.3
_ERROR_NOISE = 0.3
_UNEVEN_SHARE = 0.9  # ranks that run out of inputs early in an uneven Join
_OVERFLOW_SHARE = 0.7  # ranks that overflow in an overflow scenario
_SERIES_LABELS = frozenset({"rank", "hook", "candidate"})
_CANDIDATE_ERROR = {Candidate.FP16: 3e-4, Candidate.BF16: 2.3e-3, Candidate.POWERSGD_RANK1: 0.56,
                    Candidate.POWERSGD_RANK2: 0.40, Candidate.POWERSGD_RANK4: 0.33}
"""A candidate's typical error (the demo's model's gradients: tensorplay demo's table)."""
_CANDIDATE_WIRE_RATIO = {Candidate.FP16: 0.5, Candidate.BF16: 0.5, Candidate.POWERSGD_RANK1: 0.009,
                         Candidate.POWERSGD_RANK2: 0.015, Candidate.POWERSGD_RANK4: 0.028}
_FINGERPRINT_EVERY = 100  # optimizer steps between replica fingerprints (TENSORPLAY_FINGERPRINT_EVERY's default)


# -- the real exposition --------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """One series of a rank: sample name and the labels besides ``rank`` (``hook``, ``le``)."""

    name: str
    labels: tuple[tuple[str, str], ...]

    def label(self, name: str) -> str | None:
        return dict(self.labels).get(name)


@dataclass(frozen=True)
class Family:
    """A metric family as served: name (counters without ``_total``), type and one rank's series."""

    name: str
    type: str
    series: tuple[Series, ...]


def exposition(hooks: Sequence[str]) -> list[Family]:
    """The families one rank serves with ``hooks``, read from tensorplay's own exposition.

    Every family labelled by ``rank`` (and ``hook``, ``candidate``) gets a child for rank 0 and each
    hook (and candidate).
    ``tensorplay_telemetry_errors_total`` (labelled by ``reason`` too) has children only while
    telemetry problems are counted, so it is not part of a healthy rank's exposition.
    """
    metrics = TensorplayMetrics()
    for family in vars(metrics).values():
        if isinstance(family, ReplicaFingerprints):  # the fingerprint and its step, one pair per rank
            family.set("0", 0, 0)
            continue
        # prometheus_client keeps a family's label names in `_labelnames` (no public accessor).
        names = getattr(family, "_labelnames", None) if isinstance(family, MetricWrapperBase) else None
        if names is None or not set(names) <= _SERIES_LABELS:
            continue
        for hook in hooks if "hook" in names else hooks[:1]:
            for candidate in Candidate.ALL if "candidate" in names else ("",):
                values = {"rank": "0", "hook": hook, "candidate": candidate}
                family.labels(**{name: values[name] for name in names})
    text = generate_latest(metrics.registry).decode()
    families = []
    for parsed in text_string_to_metric_families(text):
        series = tuple(
            Series(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "rank")))
            for sample in parsed.samples
        )
        if series:
            families.append(Family(parsed.name, parsed.type, series))
    return families


def series_per_rank(hooks: Sequence[str]) -> int:
    """How many series one rank serves with ``hooks``."""
    return sum(len(family.series) for family in exposition(hooks))


# -- scenarios ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One synthetic job: its `job` label and what is wrong with it (nothing by default)."""

    job: str
    hooks: tuple[str, ...] = ("fp16_compress_hook",)
    slow_ranks: tuple[int, ...] = ()
    slow_factor: float = 1.0
    backward_ranks: tuple[int, ...] = ()
    backward_factor: float = 1.0
    uniform_factor: float = 1.0
    uneven_join: bool = False
    overflow_hooks: tuple[str, ...] = ()
    unreduced_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not set(self.overflow_hooks) <= set(self.hooks):
            raise ValueError(f"{self.job}: overflow hooks {self.overflow_hooks} not among {self.hooks}")


def standard_scenarios(ranks: int, hooks: Sequence[str] = ("fp16_compress_hook",), prefix: str = "") -> list[Scenario]:
    """The jobs the scale bench and test run, each a `job` of its own (``prefix`` + name).

    healthy; one straggler at x1.6 compute (rank ranks // 3) and one at x1.2 (which must stay
    silent: within the noise of a large job); one with x2.5 the backward of its peers (rank
    ranks // 3: its compute is like theirs); a slow node (the 8 ranks of node 1 at x1.6); every rank
    x1.6 (uniformly slow); an uneven Join; an overflow on every hook; node 1's ranks stepping on
    unreduced gradients (a no_sync() that never ends there), their replicas apart.
    """
    hooks = tuple(hooks)
    straggler = ranks // 3
    node = tuple(range(RANKS_PER_NODE, 2 * RANKS_PER_NODE))
    return [
        Scenario(f"{prefix}healthy", hooks),
        Scenario(f"{prefix}straggler-x1.6", hooks, slow_ranks=(straggler,), slow_factor=1.6),
        Scenario(f"{prefix}straggler-x1.2", hooks, slow_ranks=(straggler,), slow_factor=1.2),
        Scenario(f"{prefix}backward-x2.5", hooks, backward_ranks=(straggler,), backward_factor=2.5),
        Scenario(f"{prefix}slow-node", hooks, slow_ranks=node, slow_factor=1.6),
        Scenario(f"{prefix}uniformly-slow", hooks, uniform_factor=1.6),
        Scenario(f"{prefix}uneven-join", hooks, uneven_join=True),
        Scenario(f"{prefix}overflow", hooks, overflow_hooks=hooks),
        Scenario(f"{prefix}unreduced-node", hooks, unreduced_ranks=node),
    ]


# -- the job --------------------------------------------------------------------------------------


def _lognormal_cdf(x: np.ndarray, mean: np.ndarray, sigma: float) -> np.ndarray:
    """P(X <= x) for X lognormal with the given mean (not median) and log-sigma."""
    median = mean * math.exp(-sigma * sigma / 2)
    with np.errstate(divide="ignore"):
        z = (np.log(x) - np.log(median)) / (sigma * math.sqrt(2))
    return 0.5 * (1 + np.vectorize(math.erf)(z))


def _wire_ratio(hook: str) -> float:
    """Bytes a hook sends per byte handed to it (fp16/bf16 compression halves them)."""
    return 0.5 if ("fp16" in hook or "bf16" in hook) else 1.0


def _compression_error(hook: str) -> float:
    """A hook's typical relative error: fp16 keeps 11 significant bits, bf16 8, no compression 0."""
    return 3e-4 if "fp16" in hook else 2.5e-3 if "bf16" in hook else 0.0


@dataclass
class SyntheticJob:
    """The series of one job of ``ranks`` ranks over ``minutes`` minutes from ``start_unix``.

    Values are computed per rank range on demand (:meth:`values`), so a 4,096-rank job is never
    held in memory at once. The same ``seed`` gives the same job.
    """

    scenario: Scenario
    ranks: int
    minutes: float
    start_unix: float
    seed: int = 0
    spread: float = 0.05
    spread_kind: str = "lognormal"
    step_noise: Spread = Spread(_STEP_NOISE)
    families: list[Family] = field(init=False)

    def __post_init__(self) -> None:
        self.families = exposition(self.scenario.hooks)
        unknown = {f.name for f in self.families} - set(self._models)
        if unknown:
            raise ValueError(f"no model of {sorted(unknown)}: add one to tests/synthetic_job.py")

    # -- the job's shape ---------------------------------------------------------------------

    @cached_property
    def times(self) -> np.ndarray:
        """Scrape times (unix seconds), every 15 s from ``start_unix`` through ``end_unix``."""
        return self.start_unix + SCRAPE_INTERVAL_S * np.arange(int(round(self.minutes * 60 / SCRAPE_INTERVAL_S)) + 1)

    @property
    def end_unix(self) -> float:
        return float(self.times[-1])

    @cached_property
    def _rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.ranks, *self.scenario.job.encode()])

    @cached_property
    def compute_mean_s(self) -> np.ndarray:
        """Each rank's mean compute per step (seconds)."""
        scenario = self.scenario
        factor = Spread(self.spread, self.spread_kind).draw(self._rng, (self.ranks,)).astype(float)
        factor[list(scenario.slow_ranks)] = scenario.slow_factor
        return _STEP_S * scenario.uniform_factor * factor

    @cached_property
    def work_mean_s(self) -> np.ndarray:
        """Each rank's mean work per step (seconds): its compute, then its backward between buckets."""
        backward = np.full(self.ranks, _BACKWARD_S * self.scenario.uniform_factor)
        backward[list(self.scenario.backward_ranks)] *= self.scenario.backward_factor
        return self.compute_mean_s + backward

    @cached_property
    def timeline(self) -> Timeline:
        """The job's steps, one by one, summed per scrape interval (tests/step_timing.py)."""
        rng = np.random.default_rng([self.seed, self.ranks, 17, *self.scenario.job.encode()])
        return simulate(self.work_mean_s, self.step_noise, self.end_unix - self.start_unix, SCRAPE_INTERVAL_S, rng)

    @cached_property
    def step_period_s(self) -> float:
        """Mean seconds per step of the whole job: its slowest rank's work plus the collectives."""
        return float(self.timeline.seconds.sum() / max(self.timeline.steps.sum(), 1))

    @cached_property
    def steps(self) -> np.ndarray:
        """Steps done by each scrape (every rank alike)."""
        return np.concatenate([[0], np.cumsum(self.timeline.steps)]).astype(np.int64)

    def _per_scrape(self, per_interval: np.ndarray) -> np.ndarray:
        """[rank, scrape] what grew between each scrape and the one before (0 at the first), less
        the intervals in which the rank shadowed in the Join."""
        grown = np.concatenate([np.zeros((per_interval.shape[0], 1)), per_interval], axis=1)
        return grown * ~self._shadowing

    @cached_property
    def _compute_sum_s(self) -> np.ndarray:
        """Each rank's cumulative compute (ranks x scrapes): its mean, with the noise of each
        interval's steps (the mean of n lognormal steps has a spread of sigma / sqrt(n))."""
        new_steps = np.diff(self.steps, prepend=0)
        noise = self._rng.normal(0.0, 1.0, (self.ranks, len(self.times))) * self.step_noise.sigma / np.sqrt(np.maximum(new_steps, 1))
        return np.cumsum(new_steps * self.compute_mean_s[:, None] * np.exp(noise), axis=1)

    @cached_property
    def _shadowing(self) -> np.ndarray:
        """[rank, scrape] whether the rank shadowed in the Join in the interval up to that scrape (the
        iterations before the Join moment, from the start at most)."""
        shadow_from = self._join_unix - self.shadow_iterations * self.step_period_s
        return (self.times[None, :] > shadow_from[:, None]) & (self.times[None, :] <= self._join_unix)

    @cached_property
    def _counted_steps(self) -> np.ndarray:
        """Steps each rank counted in its end-of-step wait by each scrape (ranks x scrapes): all but
        those it shadowed in the Join."""
        return np.cumsum(self._per_scrape(np.broadcast_to(self.timeline.steps, (self.ranks, len(self.timeline.steps)))),
                         axis=1)

    @cached_property
    def _end_wait_s(self) -> np.ndarray:
        """Each rank's cumulative end-of-step wait (ranks x scrapes), over its counted steps."""
        return np.cumsum(self._per_scrape(self.timeline.waits), axis=1)

    @cached_property
    def _step_seconds_s(self) -> np.ndarray:
        """Each rank's cumulative stepping time (ranks x scrapes), over its counted steps."""
        seconds = np.broadcast_to(self.timeline.seconds, (self.ranks, len(self.timeline.seconds)))
        return np.cumsum(self._per_scrape(seconds), axis=1)

    @cached_property
    def join_index(self) -> int:
        """The first scrape after the job's one Join (halfway)."""
        return len(self.times) // 2

    @cached_property
    def shadow_iterations(self) -> np.ndarray:
        """Iterations each rank shadowed in the Join: distinct counts >= 10 for the ranks of an
        uneven Join that ran out early, 0-2 for the others; at least one rank (the last to join) 0."""
        rng = np.random.default_rng([self.seed, self.ranks, 7, *self.scenario.job.encode()])
        shadow = rng.integers(0, 3, self.ranks)
        if self.scenario.uneven_join:
            early = rng.random(self.ranks) < _UNEVEN_SHARE
            shadow[early] = 10 + rng.permutation(20 * self.ranks)[: int(early.sum())]
        shadow[int(np.argmin(shadow))] = 0
        return shadow

    @cached_property
    def _overflow_rate(self) -> np.ndarray:
        """Elements made non-finite per scrape by each rank once the overflow starts (0 for ranks
        that do not overflow); a different rate per rank."""
        rng = np.random.default_rng([self.seed, self.ranks, 11, *self.scenario.job.encode()])
        rate = np.exp(rng.normal(math.log(200.0), 1.0, self.ranks)).round() + 1
        rate[rng.random(self.ranks) >= _OVERFLOW_SHARE] = 0
        return rate

    # -- values ------------------------------------------------------------------------------

    def values(self, family: Family, first: int, last: int) -> Iterable[tuple[Series, np.ndarray]]:
        """``(series, values)`` for each series of ``family``: values of ranks ``[first, last)``
        at every scrape (ranks x scrapes); NaN where the series does not exist yet."""
        ranks = slice(first, last)
        model = self._models[family.name]
        for series in family.series:
            yield series, model(self, series, ranks)

    def _histogram(self, series: Series, observations: np.ndarray, mean: np.ndarray, sigma: float) -> np.ndarray:
        """Cumulative histogram sample: ``observations`` (scrapes) of a lognormal around each
        rank's ``mean`` (ranks), as bucket counts, ``_count`` or ``_sum``."""
        if series.name.endswith("_count"):
            return np.broadcast_to(observations, (len(mean), len(observations))).astype(float)
        if series.name.endswith("_sum"):
            return observations[None, :] * mean[:, None]
        upper = float(series.label("le"))
        share = np.ones_like(mean) if math.isinf(upper) else _lognormal_cdf(np.float64(upper), mean, sigma)
        return np.round(observations[None, :] * share[:, None])

    def _step_compute(self, series: Series, ranks: slice) -> np.ndarray:
        if series.name.endswith("_sum"):
            return self._compute_sum_s[ranks]
        return self._histogram(series, self.steps.astype(float), self.compute_mean_s[ranks], self.step_noise.sigma)

    def _allreduce_latency(self, series: Series, ranks: slice) -> np.ndarray:
        wait = (self.work_mean_s.max() - self.work_mean_s[ranks]) / BUCKETS_PER_STEP
        return self._histogram(series, self._bucket_calls, COLLECTIVE_S + wait, _LATENCY_NOISE)

    def _compression_error(self, series: Series, ranks: slice) -> np.ndarray:
        error = _compression_error(series.label("hook"))
        if error == 0:  # no compression: every call observes 0, in every bucket
            return self._zeros(series, ranks) + (0 if series.name.endswith("_sum") else self._bucket_calls)
        return self._histogram(series, self._bucket_calls, np.full(ranks.stop - ranks.start, error), _ERROR_NOISE)

    @cached_property
    def _bucket_calls(self) -> np.ndarray:
        return (self.steps * BUCKETS_PER_STEP).astype(float)

    def _bucket_bytes(self, series: Series, ranks: slice) -> np.ndarray:
        return np.broadcast_to(self._bucket_calls * _BUCKET_BYTES, (ranks.stop - ranks.start, len(self.times)))

    def _wire_bytes(self, series: Series, ranks: slice) -> np.ndarray:
        return self._bucket_bytes(series, ranks) * _wire_ratio(series.label("hook"))

    def _nonfinite(self, series: Series, ranks: slice) -> np.ndarray:
        if series.label("hook") not in self.scenario.overflow_hooks:
            return self._zeros(series, ranks)
        scrapes_overflowing = np.maximum(np.arange(len(self.times)) - self.join_index + 1, 0)
        return self._overflow_rate[ranks, None] * scrapes_overflowing[None, :]

    def _overflowing(self, series: Series, ranks: slice) -> np.ndarray:
        """[rank, scrape] whether the rank makes elements non-finite with the series' hook by then."""
        return self._nonfinite(series, ranks) > 0

    def _candidate_error(self, series: Series, ranks: slice) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.ranks, 13, *self.scenario.job.encode()])
        factor = np.exp(rng.normal(0.0, _ERROR_NOISE, self.ranks))[ranks]
        error = _CANDIDATE_ERROR[series.label("candidate")] * factor[:, None] + self._zeros(series, ranks)
        if series.label("candidate") == Candidate.FP16:
            error[self._overflowing(series, ranks)] = np.inf
        return error

    def _candidate_wire_ratio(self, series: Series, ranks: slice) -> np.ndarray:
        return self._zeros(series, ranks) + _CANDIDATE_WIRE_RATIO[series.label("candidate")]

    def _candidate_nonfinite(self, series: Series, ranks: slice) -> np.ndarray:
        if series.label("candidate") != Candidate.FP16:
            return self._zeros(series, ranks)
        return np.where(self._overflowing(series, ranks), self._overflow_rate[ranks, None], 0.0)

    def _step_wait(self, series: Series, ranks: slice) -> np.ndarray:
        return self._end_wait_s[ranks] / len(self.scenario.hooks)

    def _step_seconds(self, series: Series, ranks: slice) -> np.ndarray:
        return self._step_seconds_s[ranks]

    def _steps(self, series: Series, ranks: slice) -> np.ndarray:
        return self._counted_steps[ranks].astype(float)

    def _optimizer_steps(self, series: Series, ranks: slice) -> np.ndarray:
        return self.steps[None, :] + self._zeros(series, ranks)

    @cached_property
    def _unreduced_steps(self) -> np.ndarray:
        """Unreduced steps of each rank by each scrape (ranks x scrapes): of ``unreduced_ranks`` the
        steps from halfway on, the i-th of them starting i scrapes later (each rank its own count)."""
        unreduced = np.zeros((self.ranks, len(self.times)))
        for i, rank in enumerate(self.scenario.unreduced_ranks):
            since = self.steps[min(self.join_index + i, len(self.times) - 1)]
            unreduced[rank] = np.maximum(self.steps - since, 0)
        return unreduced

    def _gradient_reductions(self, series: Series, ranks: slice) -> np.ndarray:
        return self.steps[None, :] - self._unreduced_steps[ranks]

    def _unreduced(self, series: Series, ranks: slice) -> np.ndarray:
        return self._unreduced_steps[ranks]

    @cached_property
    def _fingerprint_steps(self) -> np.ndarray:
        """The latest multiple of 100 steps by each scrape; NaN before the first (no series yet)."""
        taken = (self.steps // _FINGERPRINT_EVERY * _FINGERPRINT_EVERY).astype(float)
        taken[taken == 0] = np.nan
        return taken

    def _fingerprint_step(self, series: Series, ranks: slice) -> np.ndarray:
        return self._fingerprint_steps[None, :] + self._zeros(series, ranks)

    def _fingerprint(self, series: Series, ranks: slice) -> np.ndarray:
        """A function of the step (below 2^53); a rank that stopped reducing adds its own rank + 1 from then on."""
        steps = np.nan_to_num(self._fingerprint_steps).astype(np.int64)
        equal = (steps * 2654435761) % 2**52
        own = (self._unreduced_steps[ranks] > 0) * (np.arange(ranks.start, ranks.stop)[:, None] + 1)
        values = (equal[None, :] + own).astype(float)
        values[:, np.isnan(self._fingerprint_steps)] = np.nan
        return values

    def _step_busy(self, series: Series, ranks: slice) -> np.ndarray:
        return (self._step_seconds_s[ranks] - self._end_wait_s[ranks]) / len(self.scenario.hooks)

    def _step_communication(self, series: Series, ranks: slice) -> np.ndarray:
        hidden = self._counted_steps[ranks] * (BUCKETS_PER_STEP - 1) * COLLECTIVE_S
        return (hidden + self._end_wait_s[ranks]) / len(self.scenario.hooks)

    def _zeros(self, series: Series, ranks: slice) -> np.ndarray:
        return np.zeros((ranks.stop - ranks.start, len(self.times)))

    def _last_step_timestamp(self, series: Series, ranks: slice) -> np.ndarray:
        return self.start_unix + self.steps[None, :] * self.step_period_s + self._zeros(series, ranks)

    def _after_join(self, per_rank: np.ndarray) -> np.ndarray:
        """A Join figure per rank, served from the Join on (NaN before: no series yet)."""
        out = np.repeat(per_rank[:, None].astype(float), len(self.times), axis=1)
        out[:, : self.join_index] = np.nan
        return out

    @property
    def _join_unix(self) -> float:
        return float(self.times[self.join_index]) - SCRAPE_INTERVAL_S / 2

    def _join_timestamp(self, series: Series, ranks: slice) -> np.ndarray:
        return self._after_join(self._join_unix - self.shadow_iterations[ranks] * self.step_period_s)

    def _join_shadow(self, series: Series, ranks: slice) -> np.ndarray:
        return self._after_join(self.shadow_iterations[ranks])

    def _join_last_joiner(self, series: Series, ranks: slice) -> np.ndarray:
        return self._after_join((self.shadow_iterations[ranks] == 0).astype(float))

    def _joins(self, series: Series, ranks: slice) -> np.ndarray:
        return self._after_join(np.ones(ranks.stop - ranks.start))

    def _join_wait(self, series: Series, ranks: slice) -> np.ndarray:
        wait = self.shadow_iterations[ranks] * self.step_period_s
        if series.name.endswith("_sum"):
            return self._after_join(wait)
        upper = float(series.label("le") or "inf")
        return self._after_join((wait <= upper).astype(float))

    _models: ClassVar[dict[str, Callable[["SyntheticJob", Series, slice], np.ndarray]]] = {
        Metric.STEP_COMPUTE: _step_compute,
        Metric.ALLREDUCE_LATENCY: _allreduce_latency,
        Metric.COMPRESSION_ERROR: _compression_error,
        Metric.BUCKET_BYTES: _bucket_bytes,
        Metric.WIRE_BYTES: _wire_bytes,
        Metric.NONFINITE: _nonfinite,
        Metric.BUCKET_NONFINITE: _zeros,
        Metric.STEP_WAIT: _step_wait,
        Metric.STEP_SECONDS: _step_seconds,
        Metric.STEPS: _steps,
        Metric.STEP_BUSY: _step_busy,
        Metric.STEP_EXPOSED_COMMUNICATION: _step_wait,
        Metric.STEP_COMMUNICATION: _step_communication,
        Metric.LAST_STEP_TIMESTAMP: _last_step_timestamp,
        Metric.COLLECTIVE_WAITING_SINCE: _zeros,
        Metric.JOIN_TIMESTAMP: _join_timestamp,
        Metric.JOIN_SHADOW_ITERATIONS: _join_shadow,
        Metric.JOIN_WAIT: _join_wait,
        Metric.JOIN_LAST_JOINER: _join_last_joiner,
        Metric.JOINS: _joins,
        Metric.OPTIMIZER_STEPS: _optimizer_steps,
        Metric.GRADIENT_REDUCTIONS: _gradient_reductions,
        Metric.UNREDUCED_OPTIMIZER_STEPS: _unreduced,
        Metric.REPLICA_FINGERPRINT: _fingerprint,
        Metric.REPLICA_FINGERPRINT_STEP: _fingerprint_step,
        Metric.CANDIDATE_ERROR: _candidate_error,
        Metric.CANDIDATE_WIRE: _candidate_wire_ratio,
        Metric.CANDIDATE_NONFINITE: _candidate_nonfinite,
    }

    # -- OpenMetrics -------------------------------------------------------------------------

    def instance(self, rank: int) -> str:
        return f"node-{rank // RANKS_PER_NODE}:{9400 + rank % RANKS_PER_NODE}"

    def write_openmetrics(self, out: TextIO, first: int = 0, last: int | None = None) -> int:
        """Write ranks ``[first, last)`` as OpenMetrics text with timestamps; return the samples."""
        last = self.ranks if last is None else last
        stamps = [f"{t:.3f}" for t in self.times]
        samples = 0
        for family in self.families:
            out.write(f"# TYPE {family.name} {family.type}\n")
            for series, values in self.values(family, first, last):
                extra = "".join(f',{k}="{v}"' for k, v in series.labels)
                for offset, row in enumerate(values):
                    rank = first + offset
                    prefix = f'{series.name}{{job="{self.scenario.job}",instance="{self.instance(rank)}",rank="{rank}"{extra}}} '
                    lines = [f"{prefix}{v!r} {t}\n" for v, t in zip(row.tolist(), stamps) if v == v]
                    out.writelines(lines)
                    samples += len(lines)
        out.write("# EOF\n")
        return samples
