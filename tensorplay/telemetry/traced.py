"""``traced(hook)``: any DDP communication hook, plus spans and metrics for every bucket.

The first stage of a traced bucket, on the training thread (docs/hook-path.md maps the rest):
it places the bucket in its model's steps (:mod:`.models`), notes the span's parent context and
start time (the span itself is started where :mod:`.finish` finishes the record), builds a
:class:`~tensorplay.telemetry.recorder.BucketRecord` and installs it as the probe's recorder, so
tensorplay's hooks report their own collectives and compression (a user's hook gets bucket
sizes and latency), runs the very same hook (same gradients, bit for bit), and chains one plain
``then`` on its future that hands the record to :mod:`.finish`. At the last bucket of a model's
iteration it tells :mod:`.replica_sync` whether a call of the iteration launched a collective; that
module counts gradient reductions against optimizer steps.
With no SDK tracer provider and metrics off, a call costs a few attribute reads and the hook runs
untouched.
"""

import copy
import logging
import operator
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from opentelemetry import trace

from . import probe, replica_sync
from .advisor import DEFAULT_ADVISE_EVERY, Advisor
from .finish import OwnedSpan, finisher
from .metrics import TensorplayMetrics, active_metrics
from .model_identity import CallPlace, ModelsOfHook
from .names import HOOK_SPAN_NAME
from .recorder import BucketRecord
from .settings import steps_from_environment
from .step_timeline import StepTimeline
from .timing import stamp
from .tracing import may_record
from .tracing import tracer as default_tracer

__all__ = ["traced", "DEFAULT_ERROR_EVERY", "DEFAULT_ADVISE_EVERY"]

_logger = logging.getLogger(__name__)

DEFAULT_ERROR_EVERY = 25
"""Default sampling of the exact compression error: every bucket of every 25th step."""

_ERROR_EVERY_ENV = "TENSORPLAY_ERROR_EVERY"
_ADVISE_EVERY_ENV = "TENSORPLAY_ADVISE_EVERY"

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def traced(
    hook: Hook,
    *,
    error_every: Optional[int] = None,
    advise_every: Optional[int] = None,
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
            every step (full fidelity), 0 never. Default: ``TENSORPLAY_ERROR_EVERY`` (a whole
            number; unset or empty means the default), else 25.
        advise_every: take the compression advice (what fp16, bf16 and PowerSGD at ranks 1, 2
            and 4 would make of this rank's gradients) on one step in this many (steps N-1, 2N-1,
            ...); 1 on every step, 0 never. Default: ``TENSORPLAY_ADVISE_EVERY``, else 250
            (docs/telemetry.md, "What another hook would give").
        metrics: where to record metrics, a :class:`~tensorplay.telemetry.TensorplayMetrics` (tests
            pass ``TensorplayMetrics(CollectorRegistry())``); anything else is refused with a
            ``TypeError``. Default: the process's metrics once :func:`~tensorplay.telemetry.enable_metrics` ran.
        tracer_provider: default: OpenTelemetry's global provider.

    The traced hook pickles (``torch.multiprocessing.spawn``, Lightning's ``start_method="spawn"``)
    whenever ``hook`` does, to a traced hook with the same ``error_every``, ``advise_every`` and fresh counts.
    ``metrics`` and ``tracer_provider`` belong to the process that made them and are not
    pickled: in the receiving process the hook records to that process's defaults (its
    :func:`~tensorplay.telemetry.enable_metrics`, its global tracer provider). ``copy.deepcopy``
    stays in the process, so it keeps both, with fresh counts.

    Registered on several DDP models (a GAN's generator and discriminator), the hook keeps one
    step count per model, in the order the models first reduce a bucket: the first model's
    figures are labelled ``hook="<name>"`` as usual, the next ones ``hook="<name>#1"``,
    ``"<name>#2"``, and each span carries ``tensorplay.model`` (0, 1, ...).
    ``tensorplay_step_compute_seconds`` is the first model's.

    The first hook traced in a process installs torch's global optimizer step hooks, which count
    the optimizer steps over the models its calls reduced (a model only ever served by
    ``noop_hook`` is not counted) and fingerprint the replicas every
    ``TENSORPLAY_FINGERPRINT_EVERY`` steps (:mod:`.replica_sync`; a value that is no whole number
    >= 0 is a ``ValueError`` here).

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(process_group, traced(bf16_compress_hook))
    """
    if not callable(hook):
        raise TypeError(f"traced: expected a communication hook hook(state, bucket), got {type(hook).__name__}")
    error_every = _steps("error_every", error_every, _ERROR_EVERY_ENV, DEFAULT_ERROR_EVERY, "sample the compression error")
    advise_every = _steps("advise_every", advise_every, _ADVISE_EVERY_ENV, DEFAULT_ADVISE_EVERY, "take the compression advice")
    if metrics is not None and not isinstance(metrics, TensorplayMetrics):
        # Refused here, once: accepted, it would fail at every bucket, warn and record nothing.
        raise TypeError(f"traced: metrics must be a TensorplayMetrics (TensorplayMetrics(registry) for a registry of "
                        f"your own), or None for the process's metrics; got {type(metrics).__name__}")
    return _TracedHook(hook, probe.hook_name(hook), error_every, metrics, tracer_provider, advise_every)


def _steps(argument: str, value: Any, variable: str, default: int, what: str) -> int:
    """A sampling argument as a number of steps: given, else from ``variable``, else ``default``."""
    if value is None:
        value = steps_from_environment(variable, default, f"0: never {what}, 1: every step, N: every N-th step")
    try:
        value = operator.index(value)  # an int, or what stands for one (numpy's)
    except TypeError:
        raise TypeError(f"traced: {argument} must be a whole number of steps, got {value!r}") from None
    if value < 0:
        raise ValueError(f"traced: {argument} must be >= 0 (0 turns it off), got {value}")
    return value


def _rebuilt(hook: Hook, error_every: int, advise_every: int = DEFAULT_ADVISE_EVERY) -> Hook:
    """Unpickle a traced hook: the same hook and sampling, this process's metrics and tracer, fresh counts."""
    return traced(hook, error_every=error_every, advise_every=advise_every)


class _TracedHook:
    """A traced hook: per-model step counters and when each model's previous step ended.

    It passes for the function it wraps where DDP and ``inspect`` look: ``__wrapped__`` (so the
    signature is the hook's), ``__doc__``, and ``__name__ == "traced(<hook name>)"``, the name
    DDP logs (DDP refuses bf16 hook names on CPU builds; see the telemetry contract).
    """

    def __init__(
        self,
        hook: Hook,
        name: str,
        error_every: int,
        metrics: Optional[TensorplayMetrics],
        tracer_provider: Optional[trace.TracerProvider],
        advise_every: int = 0,
    ) -> None:
        self._hook = hook
        self._name = name
        self._reports_collectives = probe.reports_collectives(hook)
        self._error_every = error_every
        self._metrics = metrics
        self._tracer_provider = tracer_provider
        self._own_tracer = default_tracer(tracer_provider) if tracer_provider is not None else None
        self._models = ModelsOfHook()
        replica_sync.watch_optimizer_steps()
        self._advisor = Advisor(advise_every)
        self.__wrapped__ = hook
        self.__doc__ = getattr(hook, "__doc__", None)
        self.__module__ = getattr(hook, "__module__", __name__)
        self.__name__ = self.__qualname__ = f"traced({name})"
        probe.describe_hook(self, name, self._reports_collectives)

    def __repr__(self) -> str:
        return f"<{self.__name__}>"

    def __reduce__(self) -> tuple:
        return _rebuilt, (self._hook, self._error_every, self._advisor.every)

    def __copy__(self) -> "_TracedHook":
        return _TracedHook(self._hook, self._name, self._error_every, self._metrics, self._tracer_provider, self._advisor.every)

    def __deepcopy__(self, memo: dict) -> "_TracedHook":
        hook = copy.deepcopy(self._hook, memo)
        return _TracedHook(hook, self._name, self._error_every, self._metrics, self._tracer_provider, self._advisor.every)

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        place = self._models.enter(bucket)
        record = self._start_record(state, bucket, place)
        self._models.step_ended(place, record.ends if record is not None else None)
        if record is None:
            return self._hook(state, bucket)
        token = probe.install_recorder(record)
        try:
            future = self._hook(state, bucket)
        except BaseException as error:
            finisher().raised(record, error)  # collectives it launched stay in flight until done
            raise
        finally:
            probe.uninstall_recorder(token)
        model = place.model
        if place.first_of_step or not model.reduced:  # a model is traced from a call that reduced (not noop_hook's)
            model.reduced = bool(record.launches) or not self._reports_collectives
        if place.last_of_step:
            replica_sync.model_iteration_ended(self._models, model, record, self._tracer_provider, model.reduced)
        try:
            return record.follow(future, bucket, finisher().completed)
        except Exception:  # telemetry must never break training: hand DDP the hook's own future
            finisher().abandoned(record.span, incomplete="tensorplay could not follow the hook's future")
            _logger.warning("tensorplay: could not follow a hook's future; training goes on", exc_info=True)
            return future

    def _start_record(self, state: Any, bucket: dist.GradBucket, place: CallPlace) -> Optional[BucketRecord]:
        """Begin recording this call, or return None when nobody listens (or telemetry fails).

        The span is not started here: the record takes its parent context and start time, and
        ``tensorplay-finisher`` starts and ends it (docs/hook-path.md, "Cost on the training thread").
        """
        tracer: Optional[trace.Tracer] = None
        try:
            metrics = self._metrics if self._metrics is not None else active_metrics()
            tracer = self._own_tracer if self._own_tracer is not None else default_tracer()
            if metrics is None and not may_record(tracer):
                return None
            layout = place.bucket.layout
            if layout is None:
                raise TypeError(f"the bucket {bucket!r} has no buffer to record")
            called = stamp(layout.device)
            # A shadowing rank's calls are not its own steps: it arrives first and waits for the
            # trainers, which would make them look late (and its wait is no compute either).
            shadowing = probe.in_shadow_phase()
            model, previous = place.model, place.previous_step_end
            if place.first_of_step or model.rank_and_world is None:
                model.rank_and_world = (dist.get_rank(), _world_size(state))
            rank, world_size = model.rank_and_world
            if place.first_of_step:  # the iterations the step counters count: one after another, not shadowed
                model.timeline = StepTimeline(place.step, previous) if previous is not None and not shadowing else None
            timeline = model.timeline
            if timeline is not None and timeline.step != place.step:
                timeline = None  # left from an earlier step whose first bucket was not recorded
            record = BucketRecord(
                hook=self._name,
                reports_collectives=self._reports_collectives,
                step=place.step,
                rank=rank,
                world_size=world_size,
                bucket_index=place.bucket.index,
                layout=layout,
                sample_error=self._error_every > 0 and place.step % self._error_every == 0,
                span=OwnedSpan.later(tracer, HOOK_SPAN_NAME, called.unix_ns),
                metrics=metrics,
                previous_step_end=previous if place.first_of_step and model.index == 0 and not shadowing else None,
                step_start=previous if place.last_of_step and not shadowing else None,
                model=model.index,
                called=called,
                timeline=timeline,
            )
            if timeline is not None:
                timeline.note_call(called, place.last_of_step)
        except Exception:
            _logger.warning("tensorplay: could not start recording a hook call; training goes on", exc_info=True)
            if tracer is not None and may_record(tracer):  # the call still gets its span, marked incomplete
                span = OwnedSpan.later(tracer, HOOK_SPAN_NAME, time.time_ns())
                finisher().abandoned(span, incomplete="tensorplay could not start recording this hook call")
            return None
        try:
            if metrics is not None:
                metrics.last_hook_call(record.rank_label).unix_s = called.unix_ns / 1e9
        except Exception:
            record.note_failure("last_step_timestamp")
        every = self._advisor.every
        # Steps N-1, 2N-1, ...: never one the error pass samples at the defaults (0, 25, 50, ...), so
        # the two passes off the training thread never fall on one step. Before the hook runs: the
        # bucket as DDP handed it over.
        if every and place.step % every == every - 1 and not shadowing:
            self._advisor.take(bucket, place, record, tracer if may_record(tracer) else None)
        return record


def _world_size(state: Any) -> int:
    """Size of the process group the hook reduces over, read from its state."""
    group = state if isinstance(state, dist.ProcessGroup) else getattr(state, "process_group", None)
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.get_world_size()
