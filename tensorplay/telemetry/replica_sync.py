"""Is every gradient reduced, once, and are the replicas still equal? (the telemetry contract, section 7)

Per process, with no collective of its own (ranks are compared in Prometheus and in the report,
so a joined or dead rank can never make a check hang):

* ``tensorplay_gradient_reductions_total``: DDP iterations whose gradients a traced hook reduced,
  each model's iteration once. A traced hook says so at the last bucket of each of its models'
  iterations (:func:`model_iteration_ended`): one look-up and a counter per iteration. An
  iteration shadowed inside ``Join`` is not counted, nor one none of whose hook calls launched a
  collective (``noop_hook``: nothing was reduced). A model is watched from its first reduced
  iteration: one only ever served by ``noop_hook`` is not, and neither are its optimizer steps;
* ``tensorplay_optimizer_steps_total``: ``step()``\\ s of ``torch.optim`` optimizers that updated
  parameters of a traced model, seen through torch's global optimizer step hooks (installed once
  per process, when the first hook is traced: nothing to patch, nothing for users to add). A
  step *updates* a model when one of the model's parameters is in the optimizer's
  ``param_groups`` and has a gradient: a model whose backward did not run since
  ``zero_grad()`` (``set_to_none``, torch's default) is not updated, as torch's optimizers skip
  parameters without one. Which traced models an optimizer holds is decided once per layout of
  its ``param_groups`` (again when a traced model comes or goes); each step then reads one
  parameter's ``.grad`` per model. A ``GradScaler`` that skips a step never calls ``step()``:
  nothing is counted;
* ``tensorplay_unreduced_optimizer_steps_total``: those steps that updated a model none of whose
  gradients were reduced since that model's previous optimizer step;
* every ``TENSORPLAY_FINGERPRINT_EVERY`` steps (default :data:`DEFAULT_FINGERPRINT_EVERY`, 0 off),
  right after the step, a fingerprint of every traced model's parameters (:mod:`.fingerprint`),
  models in the order they were first reduced, each model's parameters in the order its buckets
  first held them: the same order on every rank. On CUDA the sample is copied without waiting and
  hashed at a later step (or at :func:`~tensorplay.telemetry.flush`) once its copy has happened.

An optimizer stepped from inside another one's ``step()`` counts once, as the outer one: a
``ZeroRedundancyOptimizer`` steps its local optimizer on this rank's shard, then broadcasts the
shards, and only after that are the replicas equal again. The inner optimizers are found among
the outer one's attributes at its first pre-step hook.

The fingerprint's step numbers a process's optimizer steps from 1. A rank that shadows inside
tensorplay's ``Join`` steps nothing, but its peers do: so that the ranks' numbers keep meaning
the same training step after an uneven ``Join`` (whose end makes every replica equal to the last
joiner's), the numbering adds the steps its peers took meanwhile (a documented deviation from
the contract's "per process"): per iteration it shadowed, as many as it took itself per reduced
iteration over its latest 32 steps (since the traced models last changed): one without
accumulation or with it done right. ``tensorplay_optimizer_steps_total`` counts only its own
steps, and each model's count on the spans only the steps that updated it.

What the report reads rides on the hook spans (docs/telemetry.md, "Replicas"): the last hook span
of each reduced iteration carries the model's optimizer steps counted before it
(``tensorplay.optimizer.steps``), and the latest fingerprint with its step if its model's spans
have not carried it yet. Only an optimizer step that updated a model with no reduction since
its previous step (a bug) has a span of its own, ``tensorplay.optimizer_step``: no hook span may
follow it (a ``no_sync()`` that is never left stops every hook call). Telemetry never raises
into training: a failure is logged once and counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import probe
from .finish import OwnedSpan, finisher, wait_before_flush
from .fingerprint import Sample, sample_indices, take_sample
from .names import OPTIMIZER_STEP_SPAN_NAME, Attr
from .settings import steps_from_environment
from .tracing import may_record, tracer

if TYPE_CHECKING:
    from opentelemetry import trace

    from .metrics import TensorplayMetrics
    from .model_identity import ModelSteps, ModelsOfHook
    from .recorder import BucketRecord

__all__ = [
    "DEFAULT_FINGERPRINT_EVERY",
    "FINGERPRINT_EVERY_ENV",
    "watch_optimizer_steps",
    "fingerprint_every",
    "model_iteration_ended",
    "settle_fingerprint",
]

_logger = logging.getLogger(__name__)

DEFAULT_FINGERPRINT_EVERY = 100
"""Fingerprint the replicas every 100 optimizer steps unless ``TENSORPLAY_FINGERPRINT_EVERY`` says otherwise."""

FINGERPRINT_EVERY_ENV = "TENSORPLAY_FINGERPRINT_EVERY"

RECENT_STEPS = 32
"""Steps over which a rank's optimizer steps per reduced iteration are taken, to number its peers' steps while it shadows."""


class SyncedModel:
    """A traced DDP model as this module sees it: its parameters, its optimizer steps, its reductions since the last."""

    __slots__ = ("parameters", "indices", "number", "hook", "index", "steps", "pending", "fingerprint_carried",
                 "metrics", "tracer_provider", "__weakref__")

    def __init__(self, parameters: list[torch.Tensor], number: int, hook: str, index: int,
                 fingerprint_carried: int, tracer_provider: trace.TracerProvider | None) -> None:
        self.parameters = [weakref.ref(parameter) for parameter in parameters]
        """In the order the model's buckets first held them; weakly: the model's life is its own."""
        self.indices: list[torch.Tensor | None] = [None] * len(parameters)
        """Each parameter's sampled indices, on its device, made at the first fingerprint."""
        self.number = number
        """This process's number for it, 0, 1, ... in the order models were first reduced, never reused
        (``tensorplay.optimizer.model``): two traced hooks of one name each have a ``tensorplay.model`` 0."""
        self.hook, self.index = hook, index
        """What its hook spans say it is: ``tensorplay.hook`` and ``tensorplay.model``."""
        self.steps = 0
        """Optimizer steps that updated it."""
        self.pending = 0
        """Iterations reduced since this model's previous optimizer step."""
        self.fingerprint_carried = fingerprint_carried
        """The step of the latest fingerprint its hook spans carried, or was taken before it was watched (0: none)."""
        self.metrics: TensorplayMetrics | None = None
        """The metrics of the hook that traced it, as of its latest reduction (None: off)."""
        self.tracer_provider = tracer_provider


class _OptimizerView:
    """What one optimizer holds of the traced models, decided once per layout of its param_groups."""

    __slots__ = ("layout", "generation", "models", "witnesses", "started_ns")

    def __init__(self) -> None:
        self.layout: tuple[tuple[int, int], ...] | None = None
        self.generation = -1
        self.models: list[SyncedModel] = []
        self.witnesses: list[torch.Tensor] = []
        """Per model, its first parameter in the optimizer: whether it has a gradient says whether the step updates it."""
        self.started_ns = 0
        """When the optimizer's latest ``step()`` began (its pre-step hook)."""


class _PendingFingerprint:
    """A fingerprint whose sample the device is still copying, with what to publish once it is there."""

    __slots__ = ("sample", "step", "models")

    def __init__(self, sample: Sample, step: int, models: list[SyncedModel]) -> None:
        self.sample, self.step, self.models = sample, step, models


class _Watch:
    """This process's traced models, optimizers, counts and fingerprint in progress."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Held while a model is added (by the thread of its first backward) and while views are decided."""
        self.by_steps: weakref.WeakKeyDictionary[ModelSteps, SyncedModel] = weakref.WeakKeyDictionary()
        self.by_parameter = WeakIdKeyDictionary()
        """Parameter -> the traced models holding it (these lists keep the models alive)."""
        self.order: list[weakref.ref[SyncedModel]] = []
        """The models in the order they were first reduced: the fingerprint's order."""
        self.added = 0
        """Models watched so far: the next one's number."""
        self.generation = 0
        """Changes whenever a model comes or goes: every optimizer's view is decided again."""
        self.views: weakref.WeakKeyDictionary[Optimizer, _OptimizerView] = weakref.WeakKeyDictionary()
        self.inner: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        """Optimizers stepped inside another one's step (``ZeroRedundancyOptimizer``'s local optimizer)."""
        self.recent: deque[int] = deque(maxlen=RECENT_STEPS)
        """Reductions of each of the latest steps, since the traced models last changed."""
        self.numbering = 0
        """The step number of fingerprints and spans: own steps, plus the peers' while shadowing inside Join."""
        self.shadowed = 0
        """Iterations reduced while shadowing inside Join, not yet added to the numbering."""
        self.unreduced = 0
        """Optimizer steps of this process that updated a model with no reduction since its previous step."""
        self.rank: int | None = None
        self.world_size: int | None = None
        self.pending: _PendingFingerprint | None = None
        self.latest: tuple[int, int] | None = None
        """The latest fingerprint published: ``(step, fingerprint)``."""
        self.failed = False

    def add(self, hook_models: ModelsOfHook, model: ModelSteps, record: BucketRecord,
            tracer_provider: trace.TracerProvider | None) -> SyncedModel:
        """Start watching ``model``, first reduced now: its parameters are all in its buckets by its last one."""
        with self.lock:
            synced = self.by_steps.get(model)
            if synced is not None:
                return synced
            latest = self.latest
            synced = SyncedModel(hook_models.parameters_of(model), self.added, record.hook, record.model,
                                 latest[0] if latest is not None else 0, tracer_provider)
            self.added += 1
            for ref in synced.parameters:
                parameter = ref()
                holders = self.by_parameter.get(parameter)
                if holders is None:
                    self.by_parameter[parameter] = [synced]
                else:
                    holders.append(synced)
            self.by_steps[model] = synced
            self.order = [ref for ref in self.order if ref() is not None]
            self.order.append(weakref.ref(synced, self._gone))
            self.generation += 1
            self.recent.clear()
        return synced

    def _gone(self, _: weakref.ref) -> None:
        """A watched model was freed: the optimizers' views are decided again (no lock: the collector may run this anywhere)."""
        self.generation += 1
        self.recent.clear()

    def models(self) -> list[SyncedModel]:
        return [model for model in (ref() for ref in self.order) if model is not None]

    def view(self, optimizer: Optimizer) -> _OptimizerView:
        """The optimizer's view, found at its first pre-step hook: its inner optimizers are marked then."""
        view = self.views.get(optimizer)
        if view is None:
            view = self.views[optimizer] = _OptimizerView()
            for value in vars(optimizer).values():
                if isinstance(value, Optimizer) and value is not optimizer:
                    self.inner.add(value)
        return view

    def decide(self, optimizer: Optimizer, view: _OptimizerView) -> None:
        """Which traced models ``optimizer`` holds, if its param_groups or the traced models changed."""
        layout = tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
        if layout == view.layout and view.generation == self.generation:
            return
        with self.lock:
            generation = self.generation
            models: list[SyncedModel] = []
            witnesses: list[torch.Tensor] = []
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    for model in self.by_parameter.get(parameter, ()):
                        if not any(model is seen for seen in models):
                            models.append(model)
                            witnesses.append(parameter)
            view.models, view.witnesses, view.layout, view.generation = models, witnesses, layout, generation


_watch = _Watch()
_every: int | None = None
_installed = False
_install_lock = threading.Lock()


def fingerprint_every() -> int:
    """Optimizer steps between fingerprints (0: none), as read when the first hook was traced."""
    return _every if _every is not None else _every_from_environment()


def _every_from_environment() -> int:
    """``TENSORPLAY_FINGERPRINT_EVERY`` as a number of optimizer steps; unset or empty is the default."""
    return steps_from_environment(
        FINGERPRINT_EVERY_ENV, DEFAULT_FINGERPRINT_EVERY,
        "0: never fingerprint the replicas, N: every N-th optimizer step", unit="optimizer steps",
    )


def watch_optimizer_steps() -> None:
    """Install torch's global optimizer step hooks, once per process (a forked child keeps them).

    Reads ``TENSORPLAY_FINGERPRINT_EVERY`` (a ``ValueError`` names a bad value). Until a traced
    hook has reduced a model, each optimizer step costs the hooks a look-up.
    """
    global _installed, _every
    if _installed:
        return
    with _install_lock:
        if not _installed:
            _every = _every_from_environment()
            register_optimizer_step_pre_hook(_before_step)
            register_optimizer_step_post_hook(_after_step)
            _installed = True


def model_iteration_ended(hook_models: ModelsOfHook, model: ModelSteps, record: BucketRecord,
                          tracer_provider: trace.TracerProvider | None, reduced: bool) -> None:
    """A traced hook handed the last bucket of ``model``'s iteration to its hook (training thread).

    ``reduced``: whether a call of the iteration launched a collective (a user's hook is taken to
    have; ``noop_hook`` launches none). The model is watched from its first reduced iteration on;
    the last call's span (``record``) of each reduced one carries what the report reads.
    """
    watch = _watch
    try:
        if probe.in_shadow_phase():
            watch.shadowed += reduced
            return
        if not reduced:
            return
        synced = watch.by_steps.get(model)
        if synced is None:
            synced = watch.add(hook_models, model, record, tracer_provider)
            watch.rank, watch.world_size = record.rank, record.world_size
            _open_counters(record.metrics, record.rank_label)
        synced.metrics = record.metrics
        synced.pending += 1
        if record.metrics is not None:
            record.metrics.child(record.metrics.gradient_reductions, record.rank_label).inc()
        record.sync_attributes = _iteration_attributes(watch, synced)
    except Exception:
        _failed("counting a gradient reduction", record.metrics)


def _iteration_attributes(watch: _Watch, synced: SyncedModel) -> dict[str, int]:
    """The model's optimizer steps so far, and the latest fingerprint if none of its spans carried it yet."""
    attributes = {Attr.OPTIMIZER_MODEL: synced.number, Attr.OPTIMIZER_STEPS: synced.steps}
    latest = watch.latest
    if latest is not None and latest[0] != synced.fingerprint_carried:
        attributes[Attr.REPLICA_FINGERPRINT_STEP], attributes[Attr.REPLICA_FINGERPRINT] = latest
        synced.fingerprint_carried = latest[0]
    return attributes


def _open_counters(metrics: TensorplayMetrics | None, rank: str) -> None:
    """Serve the three counters from 0 as soon as a model is traced, so a first increment is an increase."""
    if metrics is not None:
        for family in (metrics.optimizer_steps, metrics.gradient_reductions, metrics.unreduced_optimizer_steps):
            metrics.child(family, rank).inc(0)


def _before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global pre-step hook: note when the step began (and, the first time, its inner optimizers)."""
    try:
        _watch.view(optimizer).started_ns = time.time_ns()
    except Exception:
        _failed("watching an optimizer step", None)


def _after_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global post-step hook: count the step if it updated a traced model; fingerprint on schedule."""
    watch = _watch
    if not watch.order or optimizer in watch.inner:
        return
    try:
        if watch.pending is not None and watch.pending.sample.ready():
            _publish(watch.pending)
            watch.pending = None
        view = watch.view(optimizer)
        watch.decide(optimizer, view)
        updated = [model for model, witness in zip(view.models, view.witnesses) if witness.grad is not None]
        if updated:
            _count_step(watch, updated, view.started_ns or time.time_ns(), time.time_ns())
    except Exception:
        _failed("counting an optimizer step", None)


def _count_step(watch: _Watch, updated: list[SyncedModel], started_ns: int, ended_ns: int) -> None:
    reductions = sum(model.pending for model in updated)
    unreduced = [model for model in updated if model.pending == 0]
    if watch.shadowed:
        # The steps the peers took while this rank shadowed their iterations: as many per shadowed
        # iteration as this rank took per reduced iteration of its own, over its latest steps.
        recent = sum(watch.recent)
        per_iteration = len(watch.recent) / recent if recent else 1.0
        watch.numbering += round(watch.shadowed * per_iteration)
        watch.shadowed = 0
    watch.recent.append(reductions)
    watch.numbering += 1
    for model in updated:
        model.steps += 1
        model.pending = 0
    watch.unreduced += bool(unreduced)
    rank = str(watch.rank)
    for metrics in _metrics_of(updated):
        metrics.child(metrics.optimizer_steps, rank).inc()
        if unreduced:
            metrics.child(metrics.unreduced_optimizer_steps, rank).inc()
    every = fingerprint_every()
    if every and watch.numbering % every == 0 and watch.pending is None:
        models = watch.models()
        pending = _PendingFingerprint(_sample(models), watch.numbering, models)
        if pending.sample.ready():
            _publish(pending)
        else:
            watch.pending = pending
    for model in unreduced:
        _unreduced_step_span(watch, model, started_ns, ended_ns)


def _unreduced_step_span(watch: _Watch, model: SyncedModel, started_ns: int, ended_ns: int) -> None:
    """The span of an optimizer step that updated ``model`` with none of its gradients reduced since its previous one.

    The evidence of a bug, so rare; no hook span may follow it to say so (a ``no_sync()`` that is
    never left stops every hook call).
    """
    span_tracer = tracer(model.tracer_provider)
    if not may_record(span_tracer):
        return
    attributes: dict[str, Any] = {
        Attr.RANK: watch.rank,
        Attr.WORLD_SIZE: watch.world_size,
        Attr.HOOK: model.hook,
        Attr.MODEL: model.index,
        Attr.OPTIMIZER_MODEL: model.number,
        Attr.OPTIMIZER_STEPS: model.steps,
        Attr.OPTIMIZER_UNREDUCED: watch.unreduced,
    }
    if watch.latest is not None:
        attributes[Attr.REPLICA_FINGERPRINT_STEP], attributes[Attr.REPLICA_FINGERPRINT] = watch.latest
    finisher().end_span(OwnedSpan.later(span_tracer, OPTIMIZER_STEP_SPAN_NAME, started_ns), attributes, end_time=ended_ns)


def _sample(models: list[SyncedModel]) -> Sample:
    """Start taking the sample of every live parameter of ``models``, in fingerprint order."""
    parameters: list[torch.Tensor] = []
    indices: list[torch.Tensor] = []
    for model in models:
        for position, ref in enumerate(model.parameters):
            parameter = ref()
            if parameter is None:
                continue  # the model is being freed
            index = model.indices[position]
            if index is None or index.device != parameter.device:
                index = model.indices[position] = sample_indices(parameter.numel(), parameter.device)
            parameters.append(parameter)
            indices.append(index)
    return take_sample(parameters, indices)


def _publish(pending: _PendingFingerprint) -> None:
    """The sample is on the host: hash it, serve it with its step, and hand it to the next spans."""
    value = pending.sample.value()
    rank = str(_watch.rank)
    for metrics in _metrics_of(pending.models):
        metrics.replica_fingerprints.set(rank, pending.step, value)
    _watch.latest = (pending.step, value)


def settle_fingerprint(timeout: float | None) -> bool:
    """Publish a fingerprint whose device copy is still under way, polling its events for at most ``timeout`` s.

    :func:`~tensorplay.telemetry.flush` calls it first, so a job's last fingerprint is served. Returns False if the copy had not happened in time (it stays pending).
    """
    watch = _watch
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.0005
    while watch.pending is not None:
        try:
            if watch.pending.sample.ready():
                _publish(watch.pending)
                watch.pending = None
                break
        except Exception:
            watch.pending = None
            _failed("publishing a fingerprint", None)
            break
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return True


def _metrics_of(models: list[SyncedModel]) -> list[TensorplayMetrics]:
    """The distinct metrics the models' hooks record to (usually one; none with metrics off)."""
    found: list[TensorplayMetrics] = []
    for model in models:
        if model.metrics is not None and not any(model.metrics is seen for seen in found):
            found.append(model.metrics)
    return found


def _failed(what: str, metrics: TensorplayMetrics | None) -> None:
    """Log the first failure of this process (with its traceback) and count every one; never raise.

    ``metrics``: where to count it; None: the metrics of the watched models.
    """
    watch = _watch
    if not watch.failed:
        watch.failed = True
        _logger.warning("tensorplay: %s failed; training goes on", what, exc_info=True)
    try:
        for counting in [metrics] if metrics is not None else _metrics_of(watch.models()):
            if watch.rank is not None:
                counting.count_error(watch.rank, "replica_sync")
    except Exception:
        _logger.debug("tensorplay: could not count a replica_sync failure", exc_info=True)


def _start_afresh() -> None:
    """In a forked child: no model watched yet, counts from 0, no fingerprint pending; torch's hooks stay."""
    global _watch, _install_lock
    _watch = _Watch()
    _install_lock = threading.Lock()


os.register_at_fork(after_in_child=_start_afresh)
wait_before_flush(settle_fingerprint)
