"""What one traced hook call (one bucket of one iteration) records while it runs.

A :class:`BucketRecord` is the probe's recorder for that call: the hook reports its collectives
and compression stages to it on the training thread (cheaply: stamps and 0-dim figures), the
futures' callbacks stamp completions, and the resolver turns the finished record into a span
and metrics. Nothing here may raise into training: failures are logged and counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from opentelemetry import trace

from . import figures
from .metrics import TensorplayMetrics
from .timing import Stamp, stamp

__all__ = ["BucketRecord", "CompressionStage"]

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
        span: trace.Span,
        metrics: TensorplayMetrics | None,
        previous_step_end: BucketRecord | None,
    ) -> None:
        self.hook = hook
        self.reports_collectives = reports_collectives
        self.step = step
        self.rank = rank
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
        self.called = stamp(self.device)
        self.launches: list[Stamp] = []
        self.collective_ends: list[Stamp | None] = []
        self.wire_bytes = 0
        self.stages: list[CompressionStage] = []
        self.returned_buffer_bytes: int | None = None
        self.completed: Stamp | None = None
        self.failed = False

    # -- the probe's HookRecorder protocol (training thread and future callbacks) --

    def collective_launching(self, tensor: torch.Tensor) -> int:
        try:
            self.launches.append(stamp(tensor.device))
            self.collective_ends.append(None)
            self.wire_bytes += tensor.numel() * tensor.element_size()
            return len(self.launches) - 1
        except Exception:
            self._failed("collective_launching")
            return -1

    def collective_launched(self, token: int, future: torch.futures.Future) -> None:
        if token < 0:
            return
        try:
            future.add_done_callback(lambda _: self._collective_done(token))
        except Exception:
            self._failed("collective_launched")

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
            self.stages.append(CompressionStage(kind, error, nonfinite, input_nonfinite))
        except Exception:
            self._failed("compression")

    # -- bookkeeping of the traced wrapper --

    def hook_returned(self, future: torch.futures.Future, bucket: Any, on_complete: Any) -> torch.futures.Future:
        """Return the future DDP gets: the hook's value, once ``on_complete(record)`` has run.

        Chaining (rather than a done-callback, which may run after waiters wake) means that when
        DDP's wait returns, the call's span and metrics are already handed over.
        """
        if not self.reports_collectives:
            buffer = bucket.buffer()
            self.returned_buffer_bytes = buffer.numel() * buffer.element_size()

        def completed(done: torch.futures.Future) -> Any:
            try:
                self.completed = stamp(self.device)
                on_complete(self)
            except Exception:
                self._failed("completion")
            return done.value()

        return future.then(completed)

    def end_stamp(self) -> Stamp | None:
        """Completion of the last collective (or of the hook's future if none was reported)."""
        ends = [end for end in self.collective_ends if end is not None]
        if ends:
            return max(ends, key=lambda s: s.monotonic_ns)
        return self.completed

    def _collective_done(self, index: int) -> None:
        self.collective_ends[index] = stamp(self.device)

    def _failed(self, where: str) -> None:
        self.failed = True
        _logger.warning("tensorplay: telemetry failed in %s; training goes on", where, exc_info=True)
        try:
            if self.metrics is not None:
                self.metrics.count_error(self.rank, f"recorder_{where}")
        except Exception:
            _logger.debug("tensorplay: could not count a recorder failure", exc_info=True)
