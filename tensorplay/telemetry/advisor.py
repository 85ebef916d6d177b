"""The compression advice: on one iteration in N, what each candidate would make of this rank's gradients.

``traced(hook, advise_every=N)`` (telemetry contract, section 6; docs/telemetry.md, "What another
hook would give"). On an advised iteration of a model, the training thread copies each bucket
right before the hook runs -- the bucket as DDP handed it over, which the hook's collective then
overwrites -- and hands the copy to ``tensorplay-advisor``. That thread computes every candidate's
sums (:mod:`.candidate_figures`), frees the copy, and pools the sums over the iteration's buckets;
after the iteration's last bucket it sets the candidate gauges and hands a ``tensorplay.advice``
span to the finisher. The candidates are about the gradients, not the running hook, so this works
under any hook, compressing or not, a user's own too.

Why a copy on the training thread: nothing else sees the bucket as DDP handed it over. Every hook
rewrites it (``allreduce_hook`` divides it in place before its collective, PowerSGD adds its error
feedback) or its collective does. A copy costs the training thread a third of what the arithmetic
would: 16.5 against 56 ms of thread CPU for a 33.6 MB float32 bucket (``bench/advice_cost.py``).

Why a thread of its own (tensorplay's second): the arithmetic takes tens of milliseconds per
bucket. On gloo's thread it would delay the completion of the hook's future, which DDP's backward
waits for; on ``tensorplay-finisher`` it would hold up span ends and CUDA records behind it.

Bounded: a model has at most one advised iteration in the making. An iteration whose turn comes
while its model's previous one is still being computed is not advised (the next one in N is), so
at most one iteration's bucket copies exist per model, and each is freed once computed.

On CUDA the copy is enqueued on the current stream (so before the hook's collective) with an
event after it; the thread computes on a side stream of its own that waits for that event, copies
the sums to host memory there, and reads them once an event recorded after them has happened:
polled, never waited on (a blocking synchronize would hang along with a hung collective).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch
from opentelemetry import trace

from .candidate_figures import CandidateSums, Layout, bucket_sums
from .finish import OwnedSpan, _count, finisher, wait_before_flush
from .names import ADVICE_SPAN_NAME, Attr, Candidate
from .timing import Stamp, happened, stamp

if TYPE_CHECKING:
    from .model_identity import CallPlace
    from .recorder import BucketRecord

__all__ = ["Advisor", "DEFAULT_ADVISE_EVERY", "pooled_error", "wait_for_advice"]

_logger = logging.getLogger(__name__)

DEFAULT_ADVISE_EVERY = 250
"""Default: the advice of one iteration in 250 (docs/telemetry.md, "Cost", says why)."""

_FIRST_POLL_S = 0.0005
_SLOWEST_POLL_S = 0.01


class _Iteration:
    """One advised iteration of one model: its sums pooled over the buckets computed so far."""

    __slots__ = ("step", "rank", "rank_label", "world_size", "hook", "hook_label", "model", "metrics", "span",
                 "generation", "taken", "processed", "sums", "bucket_bytes", "buckets", "failed")

    def __init__(self, step: int, record: BucketRecord, span: OwnedSpan | None, generation: int) -> None:
        self.step = step
        # What it reports, and to which metrics, read from its first bucket's record (not the
        # record itself: the latest iteration stays with its model, records must not).
        self.rank, self.rank_label, self.world_size = record.rank, record.rank_label, record.world_size
        self.hook, self.hook_label, self.model, self.metrics = record.hook, record.hook_label, record.model, record.metrics
        self.span = span
        self.generation = generation
        self.taken = 0
        """Buckets copied (written by the training thread only)."""
        self.processed = 0
        """Buckets computed and freed (written by the advice thread only)."""
        self.sums = {name: [0.0, 0.0, 0, 0] for name in Candidate.ALL}
        """Per candidate: Σ‖x − x̂‖², Σ‖x‖², Σ elements made non-finite, Σ bytes it would send."""
        self.bucket_bytes = 0
        self.buckets = 0
        self.failed = False

    def computing(self, generation: int) -> bool:
        """Whether some of its bucket copies are still waiting or being computed (none after a fork)."""
        return self.generation == generation and self.taken != self.processed

    def add(self, sums: dict[str, list[float]], bucket_bytes: int) -> None:
        for name, (error_sq, reference_sq, nonfinite, wire_bytes) in sums.items():
            pooled = self.sums[name]
            pooled[0] += error_sq
            pooled[1] += reference_sq
            pooled[2] += int(nonfinite)
            pooled[3] += wire_bytes
        self.bucket_bytes += bucket_bytes
        self.buckets += 1


class _BucketCopy:
    """One bucket of an advised iteration, copied as DDP handed it over, waiting to be computed."""

    __slots__ = ("iteration", "copy", "layout", "bytes", "last", "copied")

    def __init__(self, iteration: _Iteration, copy: torch.Tensor, layout: Layout, nbytes: int, last: bool,
                 copied: Stamp | None) -> None:
        self.iteration = iteration
        self.copy: torch.Tensor | None = copy
        self.layout = layout
        self.bytes = nbytes
        self.last = last
        self.copied = copied
        """On CUDA, reached once the copy is made (recorded on the stream that made it)."""


class Advisor:
    """The advice of one traced hook: which iterations are advised, and their bucket copies."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._iterations: dict[int, _Iteration] = {}
        """Model number -> its latest advised iteration."""
        self.iterations_advised = 0
        """Advised iterations begun (of every model): what the bench and tests count."""

    def take(self, bucket: Any, place: CallPlace, record: BucketRecord, tracer: trace.Tracer | None) -> None:
        """Copy ``bucket`` for the advice (training thread, before the hook runs); never raises.

        ``place`` is on an advised step. ``tracer`` is the hook's when it may record spans, else None.
        """
        iteration: _Iteration | None = None
        try:
            model = place.model.index
            latest = self._iterations.get(model)
            if place.first_of_step:
                if latest is not None and latest.computing(_thread.generation):
                    return  # its previous advised iteration is still being computed: not this one
                span = OwnedSpan.later(tracer, ADVICE_SPAN_NAME, record.called.unix_ns) if tracer is not None else None
                iteration = self._iterations[model] = _Iteration(place.step, record, span, _thread.generation)
                self.iterations_advised += 1
            elif latest is None or latest.step != place.step:
                return  # an iteration not advised, or one that began before its first bucket was seen
            else:
                iteration = latest
            buffer = bucket.buffer()
            layout = [(gradient.storage_offset() - buffer.storage_offset(), gradient.shape) for gradient in bucket.gradients()]
            copy = buffer.clone()  # on CUDA: enqueued on the current stream, before the hook's collective
            job = _BucketCopy(iteration, copy, layout, record.bytes, place.last_of_step,
                              stamp(record.device) if record.device is not None else None)
            iteration.taken += 1
            _thread.submit(job)
        except Exception:  # telemetry must never break training
            _logger.warning("tensorplay: could not take a bucket for the compression advice; training goes on", exc_info=True)
            _count(record, "advice")
            if iteration is not None:
                iteration.failed = True  # a bucket is missing: its pool is not the iteration's


def pooled_error(error_sq: float, reference_sq: float) -> float:
    """sqrt(Σ‖x − x̂‖²) / sqrt(Σ‖x‖²), the contract's pooled error: 0 for all-zero gradients,
    +inf where the candidate made finite gradients non-finite, NaN where they were not all finite."""
    if reference_sq == 0.0 and error_sq == 0.0:
        return 0.0
    if reference_sq == float("inf"):
        return float("nan")
    return error_sq**0.5 / reference_sq**0.5  # the powers traced(fp16_compress_hook)'s one-bucket figure takes


class _AdviceThread:
    """``tensorplay-advisor``: computes bucket copies one at a time, in the order they were taken."""

    def __init__(self) -> None:
        self.generation = 0
        """Counts forks: an iteration of an older generation lost its copies with the parent's thread."""
        self._start()

    def _start(self) -> None:
        self._wake = threading.Condition()
        self._jobs: deque[_BucketCopy] = deque()
        self._pending = 0
        """Iterations whose last bucket was taken and whose advice is not published yet."""
        self._thread: threading.Thread | None = None
        self._streams: dict[torch.device, Any] = {}

    def start_afresh(self) -> None:
        """In a forked child: the parent's copies and thread did not come along."""
        self.generation += 1
        self._start()

    def submit(self, job: _BucketCopy) -> None:
        with self._wake:
            if job.last:
                self._pending += 1
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tensorplay-advisor", daemon=True)
                self._thread.start()
            self._wake.notify()

    def wait(self, timeout: float | None) -> bool:
        """Wait until every iteration whose last bucket was taken is published; False if ``timeout`` ran out."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._pending, timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
                job = self._jobs.popleft()
            self._process(job)
            del job

    def _process(self, job: _BucketCopy) -> None:
        iteration = job.iteration
        try:
            if not iteration.failed:
                iteration.add(self._sums(job), job.bytes)
        except Exception:
            iteration.failed = True
            _logger.warning("tensorplay: could not compute the compression advice; training goes on", exc_info=True)
            _count(iteration, "advice")
        finally:
            job.copy = None  # freed before the next copy is computed
        if job.last and not iteration.failed:
            try:
                _publish(iteration)
            except Exception:
                _logger.warning("tensorplay: could not publish the compression advice; training goes on", exc_info=True)
                _count(iteration, "advice")
        iteration.processed += 1
        if job.last:
            with self._wake:
                self._pending -= 1
                if not self._pending:
                    self._wake.notify_all()

    def _sums(self, job: _BucketCopy) -> dict[str, list[float]]:
        copy, world_size = job.copy, job.iteration.world_size
        assert copy is not None
        if job.copied is None:
            return {name: [s.error_sq, s.reference_sq, s.nonfinite, s.wire_bytes]  # type: ignore[misc]
                    for name, s in bucket_sums(copy, job.layout, world_size).items()}
        device = copy.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(job.copied.event)
            sums = bucket_sums(copy, job.layout, world_size)
            on_host = device_figures(sums).to("cpu", non_blocking=True)
            computed = stamp(device)
        copy.record_stream(stream)  # the allocator may reuse it only once the side stream is past it
        job.copy = None
        when_happened(computed)
        return figures_from(sums, on_host.tolist())


def device_figures(sums: dict[str, CandidateSums]) -> torch.Tensor:
    """The sums' figures (error, reference, non-finite of each candidate, in order) as one float64 tensor on their device."""
    device = next(s.reference_sq for s in sums.values() if isinstance(s.reference_sq, torch.Tensor)).device
    values = [value for s in sums.values() for value in (s.error_sq, s.reference_sq, s.nonfinite)]
    return torch.stack([
        value.to(torch.float64) if isinstance(value, torch.Tensor)
        else torch.full((), float(value), dtype=torch.float64, device=device)  # a fill, not a copy from the host
        for value in values
    ])


def figures_from(sums: dict[str, CandidateSums], numbers: list[float]) -> dict[str, list[float]]:
    """The sums with the figures :func:`device_figures` packed replaced by ``numbers`` read back."""
    out, index = {}, 0
    for name, s in sums.items():
        out[name] = [numbers[index], numbers[index + 1], numbers[index + 2], s.wire_bytes]
        index += 3
    return out


def when_happened(point: Stamp, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once ``point`` has happened, polling its event (never a blocking synchronize)."""
    pause = _FIRST_POLL_S
    while not happened(point):
        sleep(pause)
        pause = min(pause * 2, _SLOWEST_POLL_S)


def _publish(iteration: _Iteration) -> None:
    """Set the candidate gauges and hand the advice span to the finisher."""
    figures = {}
    for name in Candidate.ALL:
        error_sq, reference_sq, nonfinite, wire_bytes = iteration.sums[name]
        wire_ratio = wire_bytes / iteration.bucket_bytes if iteration.bucket_bytes else 1.0
        figures[name] = (pooled_error(error_sq, reference_sq), wire_ratio, nonfinite)
    metrics = iteration.metrics
    if metrics is not None:
        for name, (error, wire_ratio, nonfinite) in figures.items():
            labels = {"rank": iteration.rank_label, "hook": iteration.hook_label, "candidate": name}
            metrics.candidate_error.labels(**labels).set(error)
            metrics.candidate_wire.labels(**labels).set(wire_ratio)
            metrics.candidate_nonfinite.labels(**labels).set(nonfinite)
    if iteration.span is not None:
        finisher().end_span(iteration.span, _span_attributes(iteration, figures))


def _span_attributes(iteration: _Iteration, figures: dict[str, tuple[float, float, int]]) -> dict[str, object]:
    attributes: dict[str, object] = {
        Attr.HOOK: iteration.hook,
        Attr.RANK: iteration.rank,
        Attr.WORLD_SIZE: iteration.world_size,
        Attr.STEP: iteration.step,
        Attr.MODEL: iteration.model,
        Attr.BUCKET_BYTES: iteration.bucket_bytes,
        Attr.ADVICE_BUCKETS: iteration.buckets,
    }
    for name, (error, wire_ratio, nonfinite) in figures.items():
        if error == error and error != float("inf"):  # left out where undefined or infinite, as a span file's JSON has no such number
            attributes[Attr.ADVICE_ERROR_RATIO.format(candidate=name)] = error
        attributes[Attr.ADVICE_WIRE_RATIO.format(candidate=name)] = wire_ratio
        attributes[Attr.ADVICE_NONFINITE.format(candidate=name)] = nonfinite
    return attributes


def wait_for_advice(timeout: float | None = 30.0) -> bool:
    """Wait until the advice of every iteration whose last bucket was taken is published."""
    return _thread.wait(timeout)


_thread = _AdviceThread()
wait_before_flush(wait_for_advice)
os.register_at_fork(after_in_child=_thread.start_afresh)
