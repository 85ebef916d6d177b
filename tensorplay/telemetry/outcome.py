"""The numbers of a finished hook record, and the one place the per-bucket hook metrics are written.

:func:`outcome` reads a completed record (on CUDA once its events happened) and folds it into its
iteration's :class:`~tensorplay.telemetry.step_timeline.StepTimeline`, :func:`observe` writes its
metric observations (and the step counters, once per iteration, from the record that closed it),
:func:`span_attributes` builds the contract's span attributes.
The live gauges (the last hook call, the collectives in flight) are set where they change, in
:mod:`.traced` and :mod:`.recorder`, so they stay true while a collective hangs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, NamedTuple

from .compression_figures import Figure, error_value, to_number
from .names import Attr
from .recorder import BucketRecord
from .step_timeline import StepFigures
from .timing import Stamp, seconds_between, unix_ns

if TYPE_CHECKING:
    from .finish import OwnedSpan

__all__ = ["Outcome", "outcome", "observe", "span_attributes"]


class Outcome(NamedTuple):
    """The numbers of one finished hook call (a named tuple: made once per bucket, cheaply)."""

    latency_s: float
    compute_s: float | None
    step_s: float | None
    """For a counted step's last bucket: the end of the previous step to the end of this one."""
    wire_bytes: int
    collectives: int
    nonfinite: int | None
    """None where a stage's count was not measured (its compression never completed)."""
    bucket_nonfinite: int | None
    relative_error: float | None
    end_unix_ns: int | None
    step: StepFigures | None = None
    """The step figures of the iteration this record closed (the last of its records to finish)."""


def outcome(record: BucketRecord) -> Outcome:
    """Read the numbers of a completed record (on CUDA: once its events happened)."""
    stages = record.stages
    errors = [error_value(stage.relative_error) for stage in stages]
    completed = record.ends.completed
    latency_s, step_s = latency_seconds(record), _step_seconds(record)
    return Outcome(
        latency_s=latency_s,
        compute_s=_compute_seconds(record),
        step_s=step_s,
        wire_bytes=wire_bytes(record),
        collectives=collective_count(record),
        nonfinite=_total(stage.nonfinite for stage in stages),
        # What the first stage compressed is the bucket as DDP handed it over.
        bucket_nonfinite=_total([stages[0].input_nonfinite]) if stages else None,
        # Stages compose (a wrapper around a compressing hook): their relative errors add up,
        # which bounds the end-to-end error to first order (triangle inequality). One stage is
        # exact. A stage without a finite figure leaves the call without one.
        relative_error=float(sum(errors)) if stages and None not in errors else None,  # type: ignore[arg-type]
        end_unix_ns=unix_ns(completed, record.called) if completed is not None else None,
        step=_folded(record, latency_s, step_s),
    )


def _folded(record: BucketRecord, latency_s: float, step_s: float | None) -> StepFigures | None:
    """Fold the record into its iteration (once); the iteration's figures if that closed it."""
    timeline, record.timeline = record.timeline, None
    if timeline is None:
        return None
    completed = record.ends.completed if record.ends.completed is not None else record.ends.last()
    return timeline.fold(record.called, collective_intervals(record), completed, latency_s, step_s)


def collective_intervals(record: BucketRecord) -> list[tuple[Stamp, Stamp]]:
    """Launch to completion of each collective the call ran, as the latency reads them.

    A user's hook, which reports none, is one collective from its call to its future's completion.
    """
    if record.reports_collectives:
        return [(launch, end) for launch, end in zip(record.launches, record.ends.stamps) if end is not None]
    completed = record.ends.completed
    return [(record.called, completed)] if completed is not None else []


def latency_seconds(record: BucketRecord) -> float:
    """Launch of the first reported collective to completion of the last.

    A hook that reports no collectives (a user's own hook) is timed from its call to its
    future's completion; a tensorplay hook that launched none (``noop_hook``) took no time.
    """
    if record.launches:
        end = record.ends.last()
        return seconds_between(record.launches[0], end) if end is not None else 0.0
    if record.reports_collectives or record.ends.completed is None:
        return 0.0
    return seconds_between(record.called, record.ends.completed)


def collective_count(record: BucketRecord) -> int:
    """Collectives launched; a user's hook is assumed to have reduced its buffer once."""
    if record.reports_collectives:
        return len(record.launches)
    return 1


def wire_bytes(record: BucketRecord) -> int:
    """Bytes sent into collectives; for a user's hook, the buffer it was left holding."""
    if record.reports_collectives:
        return record.wire_bytes
    return record.returned_buffer_bytes if record.returned_buffer_bytes is not None else record.bytes


def span_attributes(record: BucketRecord, numbers: Outcome) -> dict[str, object]:
    """The contract's span attributes of one hook call."""
    attributes: dict[str, object] = {
        Attr.HOOK: record.hook,
        Attr.RANK: record.rank,
        Attr.WORLD_SIZE: record.world_size,
        Attr.STEP: record.step,
        Attr.BUCKET_INDEX: record.bucket_index,
        Attr.BUCKET_NUMEL: record.numel,
        Attr.BUCKET_BYTES: record.bytes,
        Attr.BUCKET_WIRE_BYTES: numbers.wire_bytes,
        Attr.BUCKET_DTYPE: str(record.dtype).removeprefix("torch."),
        Attr.ALLREDUCE_LATENCY_MS: numbers.latency_s * 1e3,
        Attr.ALLREDUCE_COUNT: numbers.collectives,
        Attr.MODEL: record.model,
    }
    if numbers.nonfinite is not None:  # left out where it was not measured
        attributes[Attr.COMPRESSION_NONFINITE] = numbers.nonfinite
    step = numbers.step
    if step is not None:  # the span of the call that closed its iteration
        attributes[Attr.STEP_BUSY_MS] = step.busy_s * 1e3
        attributes[Attr.STEP_EXPOSED_COMMUNICATION_MS] = step.exposed_s * 1e3
        attributes[Attr.STEP_COMMUNICATION_MS] = step.communication_s * 1e3
    if record.stages:
        attributes[Attr.COMPRESSION_DTYPE] = "+".join(stage.kind for stage in record.stages)
    if numbers.bucket_nonfinite is not None:
        attributes[Attr.BUCKET_NONFINITE] = numbers.bucket_nonfinite
        if numbers.relative_error is not None:
            attributes[Attr.COMPRESSION_RELATIVE_ERROR] = numbers.relative_error
    if record.sync_attributes is not None:  # the last call of a reduced iteration (docs/telemetry.md, "Replicas")
        attributes.update(record.sync_attributes)
    return attributes


def observe(record: BucketRecord, numbers: Outcome, exemplar: OwnedSpan | None = None) -> None:
    """Write the call's metric observations (nothing when metrics are off).

    ``exemplar``: the call's recording span, whose IDs the latency observation carries.
    """
    metrics = record.metrics
    if metrics is None:
        return
    rank, hook, child = record.rank_label, record.hook_label, metrics.child
    child(metrics.allreduce_latency, rank, hook).observe(numbers.latency_s, _exemplar(exemplar))
    child(metrics.bucket_bytes, rank, hook).inc(record.bytes)
    child(metrics.wire_bytes, rank, hook).inc(numbers.wire_bytes)
    if numbers.nonfinite is not None:
        child(metrics.nonfinite, rank, hook).inc(numbers.nonfinite)
    if numbers.bucket_nonfinite is not None:
        child(metrics.bucket_nonfinite, rank, hook).inc(numbers.bucket_nonfinite)
    if numbers.relative_error is not None:
        child(metrics.compression_error, rank, hook).observe(numbers.relative_error)
    if numbers.compute_s is not None:
        child(metrics.step_compute, rank).observe(numbers.compute_s)
    step = numbers.step
    if step is not None:
        # The last bucket's wait is how long this rank stood at the step's end for the last of its
        # peers to arrive: what the peers did not wait for it (docs/telemetry.md, "Lateness").
        # Every step counter is written here, once per iteration, by the record that closed it
        # (docs/telemetry.md, "Busy time and exposed communication").
        child(metrics.step_wait, rank, hook).inc(step.wait_s)
        child(metrics.step_seconds, rank, hook).inc(step.step_s)
        child(metrics.step_busy, rank, hook).inc(step.busy_s)
        child(metrics.step_exposed_communication, rank, hook).inc(step.exposed_s)
        child(metrics.step_communication, rank, hook).inc(step.communication_s)
        child(metrics.steps, rank, hook).inc()


def _total(counts: Iterable[Figure | None]) -> int | None:
    """The sum of counts, None if one of them was not measured."""
    total = 0
    for count in counts:
        if count is None:
            return None
        total += int(to_number(count))
    return total


def _compute_seconds(record: BucketRecord) -> float | None:
    previous = record.previous_step_end
    if previous is None:
        return None
    end = previous.last()
    return seconds_between(end, record.called) if end is not None else None


def _step_seconds(record: BucketRecord) -> float | None:
    start = record.step_start.last() if record.step_start is not None else None
    end = record.ends.last()
    return seconds_between(start, end) if start is not None and end is not None else None


def _exemplar(span: OwnedSpan | None) -> dict[str, str] | None:
    if span is None:
        return None
    context = span.context
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}
