"""``traced(hook)``: any DDP communication hook, plus spans and metrics for every bucket.

The traced hook runs the very same hook (same gradients, bit for bit). Around each call it
installs a :class:`~tensorplay.telemetry.recorder.BucketRecord` as the probe's recorder, so
tensorplay's hooks report their own collectives and compression; a user's hook gets bucket
sizes and latency. With no SDK tracer provider and metrics off, a call costs a few attribute
reads and the hook runs untouched.
"""

import functools
import logging
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from opentelemetry import trace

from tensorplay import __version__

from . import probe
from .metrics import TensorplayMetrics, active_metrics
from .names import HOOK_SPAN_NAME, TRACER_NAME
from .recorder import BucketRecord, CollectiveEnds
from .resolver import resolver
from .spans import OwnedSpan
from .tracing import tracer as default_tracer

__all__ = ["traced", "DEFAULT_ERROR_EVERY"]

_logger = logging.getLogger(__name__)

DEFAULT_ERROR_EVERY = 25
"""Default sampling of the exact compression error: every bucket of every 25th step."""

_ERROR_EVERY_ENV = "TENSORPLAY_ERROR_EVERY"

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def traced(
    hook: Hook,
    *,
    error_every: Optional[int] = None,
    metrics: Optional[TensorplayMetrics] = None,
    tracer_provider: Optional[trace.TracerProvider] = None,
) -> Hook:
    """
    Return ``hook`` with OpenTelemetry spans and Prometheus metrics for every bucket it reduces.

    Gradients are exactly those of ``hook``. Latency, bytes and non-finite elements made by
    compression are recorded for every bucket of every step; the exact compression error,
    which costs a pass over the bucket, on every bucket of one step in ``error_every``.

    Arguments:
        hook: a communication hook ``hook(state, bucket) -> Future[Tensor]``: any tensorplay
            hook, a wrapped one, or your own (which gets bucket sizes and latency only).
        error_every: sample the compression error every this many steps; 1 takes it on
            every step (full fidelity), 0 never. Default: ``TENSORPLAY_ERROR_EVERY``, else 25.
        metrics: where to record metrics (tests pass ``TensorplayMetrics(CollectorRegistry())``).
            Default: the process's metrics once :func:`~tensorplay.telemetry.enable_metrics` ran.
        tracer_provider: default: OpenTelemetry's global provider.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(process_group, traced(bf16_compress_hook))
    """
    if not callable(hook):
        raise TypeError(f"traced: expected a communication hook hook(state, bucket), got {type(hook).__name__}")
    if error_every is None:
        error_every = int(os.environ.get(_ERROR_EVERY_ENV, DEFAULT_ERROR_EVERY))
    if error_every < 0:
        raise ValueError(f"traced: error_every must be >= 0 (0 turns the error off), got {error_every}")
    name = probe.hook_name(hook)
    tracing = _TracedHook(hook, name, error_every, metrics, tracer_provider)

    @functools.wraps(hook)
    def traced_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return tracing(state, bucket)

    # DDP logs this name and refuses bf16 hook names on CPU builds; see the telemetry contract.
    traced_hook.__name__ = traced_hook.__qualname__ = f"traced({name})"
    return probe.describe_hook(traced_hook, name, probe.reports_collectives(hook))


class _TracedHook:
    """The per-hook state of a traced hook: step counter and when the previous step ended."""

    def __init__(
        self,
        hook: Hook,
        name: str,
        error_every: int,
        metrics: Optional[TensorplayMetrics],
        tracer_provider: Optional[trace.TracerProvider],
    ) -> None:
        self._hook = hook
        self._name = name
        self._reports_collectives = probe.reports_collectives(hook)
        self._error_every = error_every
        self._metrics = metrics
        self._own_tracer = (
            tracer_provider.get_tracer(TRACER_NAME, __version__) if tracer_provider is not None else None
        )
        self._step = 0
        self._new_step = True
        self._previous_step_end: Optional[CollectiveEnds] = None
        self._last_step_gauge: tuple[TensorplayMetrics, str, Any] | None = None
        """(metrics, rank label, that rank's last-step child): the same at every call."""

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        step = self._step
        first_of_step = self._new_step
        self._new_step = bucket.is_last()
        if self._new_step:
            self._step += 1
        record = self._start_record(state, bucket, step, first_of_step)
        if record is None:
            self._previous_step_end = None
            return self._hook(state, bucket)
        if self._new_step:
            self._previous_step_end = record.ends
        finisher = resolver()
        token = probe.install_recorder(record)
        try:
            future = self._hook(state, bucket)
        except BaseException as error:
            finisher.abandoned(record.span, error=error)
            raise
        finally:
            probe.uninstall_recorder(token)
        try:
            return record.follow(future, bucket, finisher.completed)
        except Exception:  # telemetry must never break training: hand DDP the hook's own future
            finisher.abandoned(record.span, incomplete="tensorplay could not follow the hook's future")
            _logger.warning("tensorplay: could not follow a hook's future; training goes on", exc_info=True)
            return future

    def _start_record(
        self, state: Any, bucket: dist.GradBucket, step: int, first_of_step: bool
    ) -> Optional[BucketRecord]:
        """Begin recording this call, or return None when nobody listens (or telemetry fails).

        Once a span is started it is owned: it ends, through the resolver, whatever fails here.
        """
        span: Optional[OwnedSpan] = None
        try:
            metrics = self._metrics if self._metrics is not None else active_metrics()
            tracer = self._own_tracer if self._own_tracer is not None else default_tracer()
            started = tracer.start_span(HOOK_SPAN_NAME)
            if metrics is None and not started.is_recording():
                return None
            span = OwnedSpan(started)
            finisher = resolver()
            record = BucketRecord(
                hook=self._name,
                reports_collectives=self._reports_collectives,
                step=step,
                rank=dist.get_rank(),
                world_size=_world_size(state),
                bucket_index=bucket.index(),
                buffer=bucket.buffer(),
                sample_error=self._error_every > 0 and step % self._error_every == 0,
                span=span,
                metrics=metrics,
                previous_step_end=(
                    self._previous_step_end if first_of_step and not probe.in_shadow_phase() else None
                ),
                on_collective_end=finisher.after_collective,
            )
            finisher.started()
        except Exception:
            _logger.warning("tensorplay: could not start recording a hook call; training goes on", exc_info=True)
            if span is not None:  # end it off the training thread, like every span
                resolver().started()
                resolver().abandoned(span, incomplete="tensorplay could not start recording this hook call")
            return None
        try:
            if metrics is not None:
                self._last_step_child(metrics, record.rank_label).set(record.called.unix_ns / 1e9)
        except Exception:
            record.note_failure("last_step_timestamp")
        return record


    def _last_step_child(self, metrics: TensorplayMetrics, rank_label: str) -> Any:
        """The last-step gauge of this rank, looked up once (``labels()`` costs more than ``set()``)."""
        cached = self._last_step_gauge
        if cached is None or cached[0] is not metrics or cached[1] != rank_label:
            cached = (metrics, rank_label, metrics.last_step_timestamp.labels(rank=rank_label))
            self._last_step_gauge = cached
        return cached[2]


def _world_size(state: Any) -> int:
    """Size of the process group the hook reduces over, read from its state."""
    group = state if isinstance(state, dist.ProcessGroup) else getattr(state, "process_group", None)
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.get_world_size()
