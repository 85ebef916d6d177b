"""The record of one traced hook call (one bucket of one iteration), built while the call runs.

A :class:`BucketRecord` is the probe's recorder for that call: the hook reports its collectives
and compression stages to it on the training thread, where it only takes clock stamps, sets the
live in-flight gauge and, for a cast, notes what to measure. The figures are taken from a
buffer no one has rewritten:

* a cast to the bucket's own dtype (a float16 model under ``fp16_compress_hook``) is exact and
  shares DDP's buffer, which the collective then overwrites with the sum over ranks: its
  non-finite elements are counted at once, before the collective (error 0, none created);
* any other cast on CPU is measured in a plain ``then`` callback of the collective that reduces
  it, on the thread that completes that collective, before the hook's decompression (chained
  after it) rewrites the input; a finite all-reduced sum proves every rank's cast finite, so a
  healthy bucket costs one pass over the compressed tensor there;
* everything else (PowerSGD, CUDA) is measured when the hook reports it. PowerSGD's result is
  the group's: the recorder watches its collectives (is this rank's contribution finite, is the
  reduced result?) so that a non-finite element another rank brought in is not counted as made
  by this rank's compression.

:meth:`BucketRecord.follow` chains one plain ``then`` on the hook's future: it stamps the
completion and hands the record to the finisher, once. Nothing here may raise into training:
failures are logged, counted and mark the span incomplete.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import compression_figures as figures
from .metrics import TensorplayMetrics
from .timing import Stamp, stamp

if TYPE_CHECKING:
    from .finish import OwnedSpan
    from .step_timeline import StepTimeline

__all__ = ["BucketLayout", "BucketRecord", "CollectiveEnds", "CompressionStage"]

_logger = logging.getLogger(__name__)


@dataclass
class CompressionStage:
    """One compression a hook applied: its kind, relative error (if sampled), non-finite counts."""

    kind: str
    relative_error: figures.Figure | None
    nonfinite: figures.Figure | None
    """Elements compression made non-finite (None: not measured)."""
    input_nonfinite: figures.Figure | None
    """Elements already non-finite in what this stage compressed (None: not measured)."""
    ready: Stamp | None = None
    """On CUDA, reached once the figures' host copies are written: recorded after the copies, on the
    stream that computed the figures and copied them."""


@dataclass
class _PendingCast:
    """A cast compression whose figures are taken later, from its unchanged input (CPU).

    ``approximation`` (the compressed tensor) is kept to recognise the collective that reduces
    it in place, and read once that collective has overwritten it with the sum over ranks.
    """

    stage: CompressionStage
    original: torch.Tensor
    approximation: torch.Tensor
    scale: float


def _stage(
    kind: str,
    error: figures.Figure | None,
    nonfinite: figures.Figure | None,
    input_nonfinite: figures.Figure | None,
    like: torch.Tensor,
) -> CompressionStage:
    """A compression stage with its figures; on CUDA their host copies, ready once a stamp after the copies happened."""
    if not like.is_cuda:
        return CompressionStage(kind, error, nonfinite, input_nonfinite)
    copies = [figures.to_host(figure) for figure in (error, nonfinite, input_nonfinite)]
    return CompressionStage(kind, *copies, ready=stamp(like.device))  # type: ignore[arg-type]


class CollectiveEnds:
    """When one hook call's collectives completed: all that the next step's compute time needs.

    Kept apart from the record so that a step keeps only this of the previous step alive.
    """

    __slots__ = ("stamps", "completed")

    def __init__(self) -> None:
        self.stamps: list[Stamp | None] = []
        self.completed: Stamp | None = None

    def last(self) -> Stamp | None:
        """Completion of the last collective (or of the hook's future if none was reported)."""
        ends = [end for end in self.stamps if end is not None]
        if ends:
            return max(ends, key=lambda s: s.monotonic_ns)
        return self.completed


class BucketLayout:
    """What a bucket's buffer is: size, dtype, CUDA device (None on CPU).

    Fixed for the buffer's life (a rebuilt bucket has a new buffer), so it is read from the
    tensor once, when the buffer is first seen: every tensor property read costs the training
    thread microseconds after a backward pass (``buffer.device.type`` tens of them).
    """

    __slots__ = ("numel", "bytes", "dtype", "device")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.numel = buffer.numel()
        self.bytes = self.numel * buffer.element_size()
        self.dtype = buffer.dtype
        self.device = buffer.device if buffer.is_cuda else None


class BucketRecord:
    """The recorder of one traced hook call, then the record the finisher finishes."""

    __slots__ = (
        "hook", "model", "hook_label", "reports_collectives", "step", "rank", "rank_label", "world_size",
        "bucket_index", "numel", "bytes", "dtype", "device", "sample_error", "span", "metrics",
        "previous_step_end", "step_start", "called", "launches", "ends", "_in_flight", "wire_bytes",
        "stages", "_pending_casts", "_proven_by", "_sent_finite", "_elsewhere", "_arrived", "returned_buffer_bytes",
        "error", "failures", "timeline", "sync_attributes",
    )

    def __init__(
        self,
        *,
        hook: str,
        reports_collectives: bool,
        step: int,
        rank: int,
        world_size: int,
        bucket_index: int,
        layout: BucketLayout,
        sample_error: bool,
        span: OwnedSpan,
        metrics: TensorplayMetrics | None,
        previous_step_end: CollectiveEnds | None,
        step_start: CollectiveEnds | None,
        model: int = 0,
        called: Stamp | None = None,
        timeline: StepTimeline | None = None,
    ) -> None:
        self.hook = hook
        self.model = model
        """Which of the DDP models the traced hook serves this bucket is from (0: the first)."""
        self.hook_label = hook if model == 0 else f"{hook}#{model}"
        """The ``hook`` label of the metrics: the hook name, with ``#<model>`` from the second model on."""
        self.reports_collectives = reports_collectives
        self.step = step
        self.rank = rank
        self.rank_label = str(rank)
        self.world_size = world_size
        self.bucket_index = bucket_index
        self.numel = layout.numel
        self.bytes = layout.bytes
        self.dtype = layout.dtype
        self.device = layout.device
        """The bucket's CUDA device, whose stream stamps record events on; None on CPU (clock readings)."""
        self.sample_error = sample_error
        self.span = span
        self.metrics = metrics
        self.previous_step_end = previous_step_end
        self.step_start = step_start
        """For the last bucket of a step counted in the end-of-step wait: when the previous step
        ended. None otherwise: other buckets, the first step (no previous one), shadowed steps."""
        self.called = called if called is not None else stamp(self.device)
        """When the traced call began (the span's start)."""
        self.launches: list[Stamp] = []
        self.ends = CollectiveEnds()
        self._in_flight: list[int | None] = []
        """Per launch, the in-flight gauge's token until the collective is seen done."""
        self.wire_bytes = 0
        self.stages: list[CompressionStage] = []
        self._pending_casts: list[_PendingCast] = []
        """Cast stages whose figures wait for the collective that reduces them, or for completion."""
        self._proven_by: dict[int, _PendingCast] = {}
        """Launch index -> the pending cast whose approximation that collective reduces."""
        self._sent_finite: dict[int, bool | torch.Tensor] = {}
        """Launch index of a watched collective -> whether this rank's contribution to it was finite."""
        self._elsewhere: list[bool | torch.Tensor] = []
        """Per watched collective completed: whether its result brought in non-finite elements (figures.made_elsewhere)."""
        self._arrived: tuple[str, figures.Figure, int] | None = None
        """(kind, count, stage index) of an input reported by compression_input, for its compression to complete."""
        self.returned_buffer_bytes: int | None = None
        self.error: BaseException | None = None
        """The failure of the hook's future or of one of its collectives."""
        self.failures: list[str] = []
        """Where telemetry failed for this call (the span is then marked incomplete)."""
        self.timeline = timeline
        """The iteration this call belongs to, if the step counters count it; its figures are
        folded in once, when the record is finished (then None)."""
        self.sync_attributes: dict[str, int] | None = None
        """On the last call of a reduced iteration, what :mod:`.replica_sync` adds to its span."""

    # -- the probe's HookRecorder protocol (training thread and future callbacks) --

    def collective_launching(self, tensor: torch.Tensor, watch_nonfinite: bool = False) -> int:
        try:
            launch = stamp(self.device)
            token = None
            if self.metrics is not None:
                token = self.metrics.collectives_in_flight.launched(
                    self.rank_label, launch.unix_ns / 1e9, self.step, self.bucket_index
                )
            self.launches.append(launch)
            self.ends.stamps.append(None)
            self._in_flight.append(token)
            index = len(self.launches) - 1
            self.wire_bytes += tensor.numel() * tensor.element_size()
            if self._pending_casts:
                self._match_pending_cast(index, tensor)
        except Exception:
            self.note_failure("collective_launching")
            return -1
        if watch_nonfinite:
            try:
                with torch.no_grad():
                    self._sent_finite[index] = figures.finite_flag(tensor)
            except Exception:
                self.note_failure("nonfinite_watch")
        return index

    def collective_launched(self, token: int, future: torch.futures.Future) -> torch.futures.Future:
        if token < 0:
            return future
        try:
            future.add_done_callback(functools.partial(self._collective_done, token))
        except Exception:
            self.note_failure("collective_launched")
            self.ends.stamps[token] = stamp(self.device)  # never seen done otherwise: a record must not wait for it
        if token in self._sent_finite:
            try:  # chained first, as for a cast below: the hook's next step comes after the look
                return future.then(functools.partial(self._watched_done, token))
            except Exception:
                self.note_failure("nonfinite_watch")
                return future
        if token not in self._proven_by:
            return future
        try:
            # The hook chains its decompression on this future: the figures come strictly first,
            # on the thread that completes the collective, as the decompression would run there.
            return future.then(functools.partial(self._checked, token))
        except Exception:
            self.note_failure("collective_launched")
            self._resolve_cast(self._proven_by.pop(token), proof=None)  # the input is still unchanged
            return future

    def collective_not_launched(self, token: int, error: BaseException) -> None:
        if token < 0:
            return
        try:
            self.error = self.error or error
            self.ends.stamps[token] = stamp(self.device)
            in_flight = self._in_flight[token]
            self._in_flight[token] = None
            if in_flight is not None and self.metrics is not None:
                self.metrics.collectives_in_flight.completed(self.rank_label, in_flight)
        except Exception:
            self.note_failure("collective_not_launched")

    def wants_compression_error(self) -> bool:
        return self.sample_error

    def compression_input(self, kind: str, tensor: torch.Tensor) -> None:
        try:
            with torch.no_grad():
                arrived = figures.nonfinite_in(tensor)
            self._arrived = (kind, arrived, len(self.stages))
            # Reported now, in case the compression never completes (a collective fails).
            self.stages.append(_stage(kind, None, None, arrived, tensor))
        except Exception:
            self.note_failure("compression")

    def compression(
        self,
        kind: str,
        original: torch.Tensor | None,
        approximation: torch.Tensor | None = None,
        *,
        scale: float = 1.0,
        residual: torch.Tensor | None = None,
        recomputable: bool = False,
        carried: torch.Tensor | None = None,
        reduced: bool = False,
    ) -> None:
        if reduced and approximation is not None:
            self._reduced_compression(kind, original, approximation, residual, carried)
            return
        try:
            if original is None:
                raise ValueError(f"compression {kind!r} reported without its input")
            if approximation is not None and residual is None and (
                approximation.data_ptr() == original.data_ptr() or (recomputable and approximation.dtype == original.dtype)
            ):
                # A cast to the own dtype: exact, and usually DDP's very buffer, which the collective
                # overwrites with the sum over ranks. Count what it holds now, before that.
                with torch.no_grad():
                    error, nonfinite, input_nonfinite = figures.same_dtype_figures(original, self.sample_error)
                self.stages.append(_stage(kind, error, nonfinite, input_nonfinite, original))
                return
            if recomputable and approximation is not None and residual is None and not original.is_cuda:
                # Nothing on the launch path: the figures come once the collective has reduced it.
                stage = CompressionStage(kind, None, 0, 0)
                self.stages.append(stage)
                self._pending_casts.append(_PendingCast(stage, original, approximation, scale))
                return
            with torch.no_grad():
                error, nonfinite, input_nonfinite = figures.compression_figures(
                    original, approximation, scale, residual, with_error=self.sample_error
                )
            self.stages.append(_stage(kind, error, nonfinite, input_nonfinite, original))
        except Exception:
            self.note_failure("compression")

    def _reduced_compression(
        self,
        kind: str,
        original: torch.Tensor | None,
        approximation: torch.Tensor,
        residual: torch.Tensor | None,
        carried: torch.Tensor | None,
    ) -> None:
        """Take the figures of a compression whose result is the group's (see figures.reduced_figures)."""
        try:
            arrived, place = None, len(self.stages)
            if self._arrived is not None and self._arrived[0] == kind:
                _, arrived, place = self._arrived
                self._arrived = None
            with torch.no_grad():
                error, made, arrived = figures.reduced_figures(
                    original, approximation, residual=residual, carried=carried, arrived=arrived,
                    elsewhere=figures.any_of(self._elsewhere), with_error=self.sample_error,
                )
            stage = _stage(kind, error, made, arrived, approximation)
            if place < len(self.stages):
                self.stages[place] = stage
            else:
                self.stages.append(stage)
        except Exception:
            self.note_failure("compression")

    def _watched_done(self, index: int, done: torch.futures.Future) -> Any:
        """Watched collective ``index`` completed: note whether its result brought in non-finite elements.

        The flag of what was sent stays with the record: on CUDA it was made on another stream, and
        its memory must not be reused before the kernel enqueued here has read it.
        """
        sent = self._sent_finite.get(index)
        try:
            reduced = done.value()[0]
        except Exception:  # it failed: nothing was brought in, and the hook's next step raises
            reduced = None
        if reduced is not None and sent is not None:
            try:
                with torch.no_grad():
                    self._elsewhere.append(figures.made_elsewhere(sent, figures.finite_flag(reduced)))
            except Exception:
                self.note_failure("nonfinite_watch")
        return done.value()

    # -- bookkeeping of the traced wrapper --

    def follow(
        self, future: torch.futures.Future, bucket: Any, on_complete: Callable[["BucketRecord"], None]
    ) -> torch.futures.Future:
        """Return the future DDP gets: the hook's value (or failure), once ``on_complete(record)`` ran.

        A plain ``then``: it runs where torch runs any callback of ``future`` (the thread that
        completes it, or this one if it already has), and so do the callbacks DDP and the user
        chain on the returned future, in their order. The callback only stamps and hands over,
        so when DDP's wait returns the record has reached the finisher.
        """
        if not self.reports_collectives:
            buffer = bucket.buffer()
            self.returned_buffer_bytes = buffer.numel() * buffer.element_size()

        def completed(done: torch.futures.Future) -> Any:
            self._resolve_pending_casts()  # a cast no reported collective reduced: input unchanged until now
            try:
                self.ends.completed = stamp(self.device)
            except Exception:
                self.note_failure("completion")
            try:
                return done.value()
            except Exception as error:
                self.error = self.error or error
                raise
            finally:
                try:
                    on_complete(self)
                except Exception:  # telemetry must never break training
                    _logger.warning("tensorplay: could not hand a record over; training goes on", exc_info=True)

        return future.then(completed)

    def collectives_seen_done(self) -> None:
        """Take the collectives that completed off the in-flight gauge (CUDA: once their events happened)."""
        if self.metrics is None:
            return
        for index, token in enumerate(self._in_flight):
            if token is not None and self.ends.stamps[index] is not None:
                self._in_flight[index] = None
                self.metrics.collectives_in_flight.completed(self.rank_label, token)

    def _collective_done(self, index: int, future: torch.futures.Future) -> None:
        try:
            end = stamp(self.device)
            self.ends.stamps[index] = end
            try:
                future.value()
            except Exception as error:
                self.error = self.error or error
            token = self._in_flight[index]
            if token is not None and self.metrics is not None and end.event is None:
                # On CUDA the future completes at enqueue: the finisher does this once the event happened.
                self._in_flight[index] = None
                self.metrics.collectives_in_flight.completed(self.rank_label, token)
        except Exception:
            self.note_failure("collective_done")

    def _checked(self, index: int, done: torch.futures.Future) -> Any:
        """The collective ``index`` completed: take the figures of the cast it reduced, then hand its value on."""
        pending = self._proven_by.pop(index, None)
        if pending is not None:
            try:
                done.value()
                proof: torch.Tensor | None = pending.approximation  # reduced in place: the sum over ranks
            except Exception:
                proof = None
            self._resolve_cast(pending, proof)
        return done.value()

    def _match_pending_cast(self, index: int, tensor: torch.Tensor) -> None:
        """Note that collective ``index`` reduces a pending cast's approximation (the very tensor, divided or not)."""
        for pending in self._pending_casts:
            approximation = pending.approximation
            if (
                tensor.data_ptr() == approximation.data_ptr()
                and tensor.numel() == approximation.numel()
                and tensor.dtype == approximation.dtype
            ):
                self._pending_casts.remove(pending)
                self._proven_by[index] = pending
                return

    def _resolve_cast(self, pending: _PendingCast, proof: torch.Tensor | None) -> None:
        """Take a pending cast's figures; ``proof`` is the all-reduced sum of every rank's approximation.

        A sum with a non-finite term is not finite: a finite result proves that no rank's
        approximation held a non-finite element, so only a result that is not finite (an input
        that was, or a sum that overflowed) costs each rank an exact count from its own input.
        Runs in a callback of the collective's future that the hook's decompression is chained
        after, so the input is still unchanged.
        """
        try:
            with torch.no_grad():
                # A sampled step's error pass proves finiteness on its own: no pass over the proof.
                proven = proof is not None and not self.sample_error and figures.all_finite(proof)
                stage = pending.stage
                stage.relative_error, stage.nonfinite, stage.input_nonfinite = figures.cast_figures(
                    pending.original, pending.approximation.dtype, pending.scale, self.sample_error, proven
                )
        except Exception:
            self.note_failure("compression")

    def _resolve_pending_casts(self) -> None:
        """Take the figures of the casts no reported collective proved (a wrapper around PowerSGD, say).

        Their input is unchanged until the hook's future completes, which is now.
        """
        while self._pending_casts:
            self._resolve_cast(self._pending_casts.pop(), proof=None)
        for index in list(self._proven_by):
            pending = self._proven_by.pop(index, None)
            if pending is not None:
                self._resolve_cast(pending, proof=None)

    def note_failure(self, where: str) -> None:
        """Log and count a telemetry failure at ``where``; the span will say it is incomplete."""
        self.failures.append(where)
        _logger.warning("tensorplay: telemetry failed in %s; training goes on", where, exc_info=True)
        try:
            if self.metrics is not None:
                self.metrics.count_error(self.rank, f"recorder_{where}")
        except Exception:
            _logger.debug("tensorplay: could not count a recorder failure", exc_info=True)
