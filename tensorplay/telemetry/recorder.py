"""What one traced hook call (one bucket of one iteration) records while it runs.

A :class:`BucketRecord` is the probe's recorder for that call: the hook reports its collectives
and compression stages to it on the training thread (cheaply: stamps and 0-dim figures), the
futures' callbacks stamp completions and keep the live in-flight gauge, and the resolver turns
the finished record into metrics and a span. Nothing here may raise into training: failures
are logged, counted and mark the span incomplete.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import figures
from .metrics import TensorplayMetrics
from .spans import OwnedSpan
from .timing import Stamp, stamp

__all__ = ["BucketRecord", "CollectiveEnds", "CompressionStage"]

_logger = logging.getLogger(__name__)


@dataclass
class CompressionStage:
    """One compression a hook applied: its kind, relative error (if sampled), non-finite counts."""

    kind: str
    relative_error: figures.Figure | None
    nonfinite: figures.Figure
    """Elements compression made non-finite."""
    input_nonfinite: figures.Figure
    """Elements already non-finite in what this stage compressed."""
    ready: Stamp | None = None
    """On CUDA, reached once the figures (computed on whatever stream was current) are written."""


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


class BucketRecord:
    """The recorder of one traced hook call, then the record the resolver finishes."""

    def __init__(
        self,
        *,
        hook: str,
        reports_collectives: bool,
        step: int,
        rank: int,
        world_size: int,
        bucket_index: int,
        buffer: torch.Tensor,
        sample_error: bool,
        span: OwnedSpan,
        metrics: TensorplayMetrics | None,
        previous_step_end: CollectiveEnds | None,
        step_start: CollectiveEnds | None,
        on_collective_end: Callable[[Stamp, Callable[[], None]], None],
        model: int = 0,
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
        self.numel = buffer.numel()
        self.bytes = self.numel * buffer.element_size()
        self.dtype = str(buffer.dtype).removeprefix("torch.")
        self.device = buffer.device
        self.sample_error = sample_error
        self.span = span
        self.metrics = metrics
        self.previous_step_end = previous_step_end
        self.step_start = step_start
        """For the last bucket of a step counted in the end-of-step wait: when the previous step
        ended. None otherwise: other buckets, the first step (no previous one), shadowed steps."""
        self._on_collective_end = on_collective_end
        self.called = stamp(self.device)
        self.launches: list[Stamp] = []
        self.ends = CollectiveEnds()
        self._in_flight: list[int | None] = []
        self.wire_bytes = 0
        self.stages: list[CompressionStage] = []
        self.returned_buffer_bytes: int | None = None
        self.error: BaseException | None = None
        """The failure of the hook's future or of one of its collectives."""
        self.failures: list[str] = []
        """Where telemetry failed for this call (the span is then marked incomplete)."""

    # -- the probe's HookRecorder protocol (training thread and future callbacks) --

    def collective_launching(self, tensor: torch.Tensor) -> int:
        try:
            launch = stamp(tensor.device)
            token = None
            if self.metrics is not None:
                token = self.metrics.collectives_in_flight.launched(
                    self.rank_label, launch.unix_ns / 1e9, self.step, self.bucket_index
                )
            self.launches.append(launch)
            self.ends.stamps.append(None)
            self._in_flight.append(token)
            self.wire_bytes += tensor.numel() * tensor.element_size()
            return len(self.launches) - 1
        except Exception:
            self.note_failure("collective_launching")
            return -1

    def collective_launched(self, token: int, future: torch.futures.Future) -> None:
        if token < 0:
            return
        try:
            future.add_done_callback(functools.partial(self._collective_done, token))
        except Exception:
            self.note_failure("collective_launched")

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

    def compression(
        self,
        kind: str,
        original: torch.Tensor,
        approximation: torch.Tensor | None = None,
        *,
        scale: float = 1.0,
        residual: torch.Tensor | None = None,
    ) -> None:
        try:
            with torch.no_grad():
                error, nonfinite, input_nonfinite = figures.compression_figures(
                    original, approximation, scale, residual, with_error=self.sample_error
                )
            ready = stamp(original.device) if original.is_cuda else None
            self.stages.append(CompressionStage(kind, error, nonfinite, input_nonfinite, ready))
        except Exception:
            self.note_failure("compression")

    # -- bookkeeping of the traced wrapper --

    def follow(
        self, future: torch.futures.Future, bucket: Any, on_complete: Callable[["BucketRecord"], None]
    ) -> torch.futures.Future:
        """Return the future DDP gets: the hook's value (or failure), once ``on_complete(record)`` ran.

        Chaining (rather than a done-callback, which may run after waiters wake) means that when
        DDP's wait returns, the call's metrics are recorded and its span handed over.
        """
        if not self.reports_collectives:
            buffer = bucket.buffer()
            self.returned_buffer_bytes = buffer.numel() * buffer.element_size()

        def completed(done: torch.futures.Future) -> Any:
            try:
                value = done.value()
            except Exception as error:
                self.error = self.error or error
                self._complete(on_complete)
                raise
            self._complete(on_complete)
            return value

        return future.then(completed)

    def _complete(self, on_complete: Callable[["BucketRecord"], None]) -> None:
        try:
            self.ends.completed = stamp(self.device)
        except Exception:
            self.note_failure("completion")
        on_complete(self)

    def _collective_done(self, index: int, future: torch.futures.Future) -> None:
        try:
            end = stamp(self.device)
            self.ends.stamps[index] = end
            try:
                future.value()
            except Exception as error:
                self.error = self.error or error
            token = self._in_flight[index]
            if token is not None and self.metrics is not None:
                in_flight = self.metrics.collectives_in_flight
                self._on_collective_end(end, functools.partial(in_flight.completed, self.rank_label, token))
        except Exception:
            self.note_failure("collective_done")

    def note_failure(self, where: str) -> None:
        """Log and count a telemetry failure at ``where``; the span will say it is incomplete."""
        self.failures.append(where)
        _logger.warning("tensorplay: telemetry failed in %s; training goes on", where, exc_info=True)
        try:
            if self.metrics is not None:
                self.metrics.count_error(self.rank, f"recorder_{where}")
        except Exception:
            _logger.debug("tensorplay: could not count a recorder failure", exc_info=True)
