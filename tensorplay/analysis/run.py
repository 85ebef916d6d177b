"""Turn the spans of one model of a run into per-rank, per-step and per-bucket arrays.

A traced hook shared by several DDP models (a GAN's generator and discriminator) counts each
model's steps on its own (``tensorplay.model``); each model is aggregated apart (:func:`models`,
``aggregate(spans, model)``), so their latencies and step times never mix. A rank's Join spans
apply to all of its models.

Everything is aggregated here, once, with numpy: the figures draw arrays whose size is bounded
by ranks x steps (x buckets), never one artist per span.

Compute time per step is derived from the spans the way ``tensorplay_step_compute_seconds``
defines it: from the end of a rank's previous step (its last bucket's span ending, when the
last collective completed) to its next first hook call. A rank's *shadowed* steps are those
whose first hook call falls inside one of its ``tensorplay.join`` spans: it had run out of
inputs and only shadowed its peers' collectives, so they are not its compute. The steps every
rank trained are those no rank shadowed (shadowed iterations call the hooks too, so the step
counters of all ranks stay aligned).

A rank's end-of-step waits (what the straggler verdict weighs) are the latencies of each step's
last bucket, over the steps every rank trained after the first, and the time each of those steps
took on its own clock: from the end of the step before to its own end.

The step timeline (busy time, exposed communication, communication) is laid out per rank and step
from the span that closed each counted iteration, and the model's advice spans are kept beside it:
:mod:`.communication` derives what communication costs the step from them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from tensorplay.analysis.straggler import RankWait

from .span_reader import AdviceSpan, HookSpans, JoinSpan, Spans

__all__ = ["Run", "HookBytes", "SampledErrors", "models", "aggregate"]


@dataclass(frozen=True)
class HookBytes:
    """Bytes DDP handed one hook, and bytes the hook sent into collectives, over the whole run."""

    hook: str
    handed_over: int
    wire: int


@dataclass(frozen=True)
class SampledErrors:
    """Compression relative error of the sampled steps: median, min and max over ranks and buckets."""

    steps: np.ndarray
    median: np.ndarray
    low: np.ndarray
    high: np.ndarray


@dataclass
class Run:
    """One model's arrays over a run, rows in the order of :attr:`ranks`."""

    model: int
    """Which of the traced hook's models (``tensorplay.model``)."""
    ranks: np.ndarray
    """Rank ids, ascending."""
    latency_ms: np.ndarray
    """[rank, step, bucket] allreduce latency; NaN where no span."""
    compute_ms: np.ndarray
    """[rank, step] compute time before the step; NaN where not observed (first step, shadowed)."""
    shadowed: np.ndarray
    """[rank, step] whether the rank shadowed that step inside Join."""
    present: np.ndarray
    """[rank, step] whether the rank has a span of that step."""
    step_end_s: np.ndarray
    """[rank, step] unix time the step's last span ended; -inf where no span."""
    hook_bytes: list[HookBytes]
    errors: SampledErrors
    """Of the steps' own work: spans of shadowed iterations are left out."""
    nonfinite: np.ndarray
    """[step] elements compression made non-finite, all ranks."""
    rank_nonfinite: np.ndarray
    """[rank] elements compression made non-finite, every step."""
    rank_wire_bytes: np.ndarray
    """[rank] bytes the hook sent into collectives, every call (shadowed ones included)."""
    rank_bucket_bytes: np.ndarray
    """[rank] bytes DDP handed the hook, every call."""
    rank_relative_error: np.ndarray
    """[rank] mean sampled compression error of its own steps' buckets (NaN: none sampled)."""
    bucket_nonfinite: np.ndarray
    """[step] non-finite elements that reached a compressing hook, all ranks."""
    joins: list[JoinSpan]
    start_s: float
    """Unix time of the first span: the origin of the Join figure."""
    duplicates: int
    """Spans of a (rank, model, step, bucket) already seen: two runs in the same files?"""
    busy_ms: np.ndarray
    """[rank, step] busy time of each counted iteration (``tensorplay.step.busy_ms``); NaN where not counted."""
    exposed_ms: np.ndarray
    """[rank, step] exposed communication of each counted iteration; NaN where not counted."""
    communication_ms: np.ndarray
    """[rank, step] time with one of the iteration's collectives in flight; NaN where not counted."""
    advice: list[AdviceSpan]
    """The model's ``tensorplay.advice`` spans, in rank and step order."""

    @property
    def steps(self) -> int:
        return self.latency_ms.shape[1]

    @property
    def trained_by_all(self) -> np.ndarray:
        """[step] steps every rank trained: each has a span of it and none shadowed it."""
        return self.present.all(axis=0) & ~self.shadowed.any(axis=0)

    def row(self, rank: int) -> int:
        """Index of ``rank`` in the arrays."""
        return int(np.searchsorted(self.ranks, rank))

    def end_waits(self) -> list[RankWait]:
        """Each rank's end-of-step waits over the steps every rank trained after the first, in rank order.

        A step is compared when every rank also trained the step before, so that each rank's time
        is that of the same steps.
        """
        counted = self.trained_by_all.copy()
        if len(counted):
            counted[0] = False
            counted[1:] &= self.trained_by_all[:-1]
        steps = np.flatnonzero(counted)
        if not len(steps) or not self.latency_ms.shape[2]:
            return [RankWait(int(rank), (), ()) for rank in self.ranks]
        last_bucket = np.where(np.isnan(self.latency_ms), -1, np.arange(self.latency_ms.shape[2])).max(axis=2)
        waits = np.take_along_axis(self.latency_ms, np.maximum(last_bucket, 0)[:, :, None], axis=2)[:, :, 0]
        seconds = self.step_end_s[:, steps] - self.step_end_s[:, steps - 1]
        return [RankWait(int(rank), tuple((waits[row, steps] / 1e3).tolist()), tuple(seconds[row].tolist()))
                for row, rank in enumerate(self.ranks)]

    def trained_steps(self) -> np.ndarray:
        """[rank] steps the rank trained itself (it has a span of the step and did not shadow it)."""
        return (self.present & ~self.shadowed).sum(axis=1)

    def compute_ms_mean(self) -> np.ndarray:
        """[rank] mean compute per observed step (NaN if none was observed)."""
        return _quiet(np.nanmean, self.compute_ms, axis=1)

    def compute_ms_band(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[step] 10th percentile, median and 90th percentile of compute over all ranks."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # steps no rank observed (the first)
            low, median, high = np.nanpercentile(self.compute_ms, [10, 50, 90], axis=0)
        return low, median, high

    def latency_ms_p50(self) -> np.ndarray:
        """[rank] median latency per bucket over the steps every rank trained."""
        common = self.latency_ms[:, self.trained_by_all, :]
        return _quiet(np.nanmedian, common.reshape(len(self.ranks), -1), axis=1)

    def latency_by_step(self) -> np.ndarray:
        """[rank, step] mean latency per bucket."""
        return _quiet(np.nanmean, self.latency_ms, axis=2)

    def latency_by_bucket(self) -> np.ndarray:
        """[rank, bucket] median latency over the steps every rank trained."""
        return _quiet(np.nanmedian, self.latency_ms[:, self.trained_by_all, :], axis=1)


def _quiet(reduce, values: np.ndarray, axis: int) -> np.ndarray:
    """``reduce`` (a nan-aware numpy reduction) without the warning for rows that are all NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return reduce(values, axis=axis) if values.size else np.full(values.shape[:axis], np.nan)


def _sampled_errors(hooks: HookSpans, shadowing: np.ndarray) -> SampledErrors:
    """Per sampled step, over the spans of ranks that trained it (a shadowing rank compresses zeros)."""
    sampled = ~np.isnan(hooks.relative_error) & ~shadowing
    steps, errors = hooks.step[sampled], hooks.relative_error[sampled]
    order = np.argsort(steps, kind="stable")
    steps, errors = steps[order], errors[order]
    unique, first = np.unique(steps, return_index=True)
    groups = np.split(errors, first[1:]) if len(unique) else []
    return SampledErrors(
        steps=unique,
        median=np.array([np.median(g) for g in groups]),
        low=np.array([g.min() for g in groups]),
        high=np.array([g.max() for g in groups]),
    )


def _hook_bytes(hooks: HookSpans) -> list[HookBytes]:
    return [HookBytes(name, int(hooks.bucket_bytes[hooks.hook == index].sum()),
                      int(hooks.wire_bytes[hooks.hook == index].sum()))
            for index, name in enumerate(hooks.hook_names) if (hooks.hook == index).any()]


def _shadowed(first_call_s: np.ndarray, rows: np.ndarray, joins: list[JoinSpan]) -> np.ndarray:
    shadowed = np.zeros(first_call_s.shape, dtype=bool)
    for join, row in zip(joins, rows):
        calls = first_call_s[row]
        shadowed[row] |= (calls >= join.start_s) & (calls <= join.end_s)
    return shadowed


def models(spans: Spans) -> list[int]:
    """The traced hook's models the spans hold (``tensorplay.model``), ascending; [0] when none."""
    return sorted(set(np.unique(spans.hooks.model).tolist())) or [0]


def _per_rank(values: np.ndarray, row: np.ndarray, ranks: int) -> np.ndarray:
    return np.bincount(row, weights=values, minlength=ranks).astype(np.int64)


def _rank_errors(row: np.ndarray, errors: np.ndarray, ranks: int) -> np.ndarray:
    sampled = ~np.isnan(errors)
    counts = np.bincount(row[sampled], minlength=ranks)
    sums = np.bincount(row[sampled], weights=errors[sampled], minlength=ranks)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def aggregate(spans: Spans, model: int = 0) -> Run:
    """Aggregate the spans of ``model`` (and every Join span) into a :class:`Run`."""
    hooks, joins = _of_model(spans.hooks, model), spans.joins
    ranks = np.union1d(np.unique(hooks.rank), np.array([join.rank for join in joins], dtype=np.int64))
    steps = int(hooks.step.max()) + 1 if len(hooks) else 0
    buckets = int(hooks.bucket.max()) + 1 if len(hooks) else 0
    row = np.searchsorted(ranks, hooks.rank)

    latency = np.full((len(ranks), steps, buckets), np.nan)
    latency[row, hooks.step, hooks.bucket] = hooks.latency_ms
    cells = np.sort((row * steps + hooks.step) * buckets + hooks.bucket)
    duplicates = int(np.count_nonzero(cells[1:] == cells[:-1]))

    first_call = np.full((len(ranks), steps), np.inf)
    np.minimum.at(first_call, (row, hooks.step), hooks.start_s)
    last_end = np.full((len(ranks), steps), -np.inf)
    np.maximum.at(last_end, (row, hooks.step), hooks.end_s)
    present = np.isfinite(first_call)
    shadowed = _shadowed(first_call, np.searchsorted(ranks, [join.rank for join in joins]), joins)

    compute = np.full((len(ranks), steps), np.nan)
    if steps > 1:
        observed = present[:, 1:] & np.isfinite(last_end[:, :-1]) & ~shadowed[:, 1:]
        gaps = (first_call[:, 1:] - last_end[:, :-1]) * 1e3
        compute[:, 1:] = np.where(observed, gaps, np.nan)

    shadowing = shadowed[row, hooks.step]
    timeline = {name: _per_step(getattr(hooks, column), row, hooks.step, (len(ranks), steps))
                for name, column in (("busy_ms", "busy_ms"), ("exposed_ms", "exposed_communication_ms"),
                                     ("communication_ms", "communication_ms"))}
    starts = np.concatenate([hooks.start_s, [join.start_s for join in joins]])
    return Run(
        model=model,
        ranks=ranks,
        latency_ms=latency,
        compute_ms=compute,
        shadowed=shadowed,
        present=present,
        step_end_s=last_end,
        hook_bytes=_hook_bytes(hooks),
        errors=_sampled_errors(hooks, shadowing),
        nonfinite=np.bincount(hooks.step, weights=hooks.nonfinite, minlength=steps).astype(np.int64),
        rank_nonfinite=_per_rank(hooks.nonfinite, row, len(ranks)),
        rank_wire_bytes=_per_rank(hooks.wire_bytes, row, len(ranks)),
        rank_bucket_bytes=_per_rank(hooks.bucket_bytes, row, len(ranks)),
        rank_relative_error=_rank_errors(row, np.where(shadowing, np.nan, hooks.relative_error), len(ranks)),
        bucket_nonfinite=np.bincount(hooks.step, weights=hooks.bucket_nonfinite, minlength=steps).astype(np.int64),
        joins=sorted(joins, key=lambda join: (join.rank, join.start_s)),
        start_s=float(starts.min()) if len(starts) else 0.0,
        duplicates=duplicates,
        **timeline,
        advice=sorted((advice for advice in spans.advice if advice.model == model),
                      key=lambda advice: (advice.rank, advice.step)),
    )


def _per_step(values: np.ndarray, row: np.ndarray, step: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """[rank, step] of a figure only the span that closed its iteration carries (NaN on the others)."""
    out = np.full(shape, np.nan)
    carried = ~np.isnan(values)
    out[row[carried], step[carried]] = values[carried]
    return out


def _of_model(hooks: HookSpans, model: int) -> HookSpans:
    """The spans of one model (every span when they all belong to it, without a copy)."""
    mine = hooks.model == model
    if mine.all():
        return hooks
    columns = {name: value[mine] for name, value in vars(hooks).items() if isinstance(value, np.ndarray)}
    return HookSpans(**columns, hook_names=hooks.hook_names)
