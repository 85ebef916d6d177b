"""Which DDP model a bucket belongs to, so that one traced hook on several models counts each one's steps.

A hook sees only ``(state, bucket)``, and the state may be None for every model. What tells the
models apart is the bucket itself: each DDP model has its own flat buffer per bucket, and torch
hands out the same Python tensor for it on every call, so a bucket is known by its buffer's
identity (a dict by ``id`` whose entry holds the buffer weakly and goes when it dies). A buffer
seen for the first time (a model's first iteration, or the one bucket rebuild DDP does after it)
is placed using two
facts: DDP launches a model's buckets in index order 0..last every iteration, and a rebuilt
bucket holds only parameters its model already reduced. So an unseen buffer goes to a model that
owns every one of its parameters and expects its index next; failing that, a bucket 0 starts a new
model and a later bucket continues the model whose first iteration expects it. Where several
models fit (models sharing a parameter, a bucket that holds only shared ones; two models in their
first iteration at once), two more facts decide: a model has one buffer per bucket at a time (its
rebuild frees the old ones), so a model whose buffer for that index is alive is not the one
getting a new one; and a model's backward runs on one thread at a time, so of two models trained
from two threads the one last placed on this thread is this bucket's.

Parameters and buffers are held weakly, and a model's state lives as long as one of its
parameters: a model that is freed takes its state (step count, when its last step ended) with
it. The next new model reuses its number, so labels stay bounded, and starts afresh.
A lock makes placing safe when two threads run backward passes (it reads other models' counters,
which their own threads write without it: a stale read is only ever a tie the facts above break);
each model's counters belong to the one thread that runs its backward.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

from torch.utils.weak import WeakIdKeyDictionary

from .recorder import BucketLayout, CollectiveEnds

if TYPE_CHECKING:
    from .step_timeline import StepTimeline

__all__ = ["ModelSteps", "ModelsOfHook", "KnownBucket", "CallPlace"]

_logger = logging.getLogger(__name__)


class ModelSteps:
    """One model's iteration count as seen by a traced hook."""

    __slots__ = (
        "index", "step", "expected_bucket", "previous_step_end", "rank_and_world", "buffers", "placed_on",
        "timeline", "reduced",
        "__weakref__",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        """0 for the first model the hook served, 1 for the next, ..."""
        self.step = 0
        self.expected_bucket = 0
        """The bucket index of this model's next call (0: a step begins)."""
        self.previous_step_end: CollectiveEnds | None = None
        """When the collectives of this model's previous (traced) step ended."""
        self.rank_and_world: tuple[int, int] | None = None
        """This rank and the size of the group the hook reduces over, read at the step's first bucket
        (every bucket of a step reduces over the same group; asking ``torch.distributed`` costs the
        training thread tens of microseconds per bucket after a backward pass)."""
        self.buffers: dict[int, weakref.ref] = {}
        """Bucket index -> this model's latest buffer for it, weakly (written only while placing, under the lock)."""
        self.placed_on: Optional[int] = None
        """The thread that placed this model's latest new buffer (the thread running its backward then)."""
        self.timeline: StepTimeline | None = None
        """The iteration in progress, if the step counters count it: one per model at a time."""
        self.reduced = False
        """Whether a traced call of the iteration in progress launched a collective (a user's hook is taken to)."""


class KnownBucket:
    """A bucket buffer once seen: its model, its place in the model's steps, its layout.

    None of it changes for the buffer's life (DDP's one rebuild makes new buffers), so a call
    reads it here instead of asking the ``GradBucket`` and the tensor again.
    """

    __slots__ = ("buffer", "model", "index", "last", "layout")

    def __init__(self, model: ModelSteps, index: int, last: bool, layout: BucketLayout | None,
                 buffer: weakref.ref | None = None) -> None:
        self.buffer = buffer
        """The buffer, weakly: what tells this bucket from one that reuses a dead buffer's id."""
        self.model = model
        self.index = index
        self.last = last
        """Whether it is its model's last bucket, the one that ends a step."""
        self.layout = layout
        """None for a bucket without a buffer (a test double): nothing to record."""


class CallPlace:
    """Where one hook call stands: its bucket, its model's step, and whether it begins the step."""

    __slots__ = ("bucket", "step", "first_of_step", "previous_step_end")

    def __init__(self, bucket: KnownBucket, step: int, first: bool, previous: CollectiveEnds | None) -> None:
        self.bucket = bucket
        self.step = step
        self.first_of_step = first
        self.previous_step_end = previous

    @property
    def model(self) -> ModelSteps:
        return self.bucket.model

    @property
    def last_of_step(self) -> bool:
        return self.bucket.last


class ModelsOfHook:
    """The models one traced hook serves, and which of them each bucket belongs to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Held while a buffer is placed (the look-ups of every model's parameters)."""
        self._models: list[weakref.ref[ModelSteps]] = []
        """By model number; a dead reference is a freed model whose number is free again."""
        self._by_buffer: dict[int, KnownBucket] = {}
        """``id(buffer)`` -> its KnownBucket, for as long as the buffer lives. Not a
        WeakIdKeyDictionary: its look-up runs five Python functions, ~40 us of the training
        thread per bucket after a backward pass; this one is a dict get and a weakref call."""
        self._by_parameter: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Parameter -> the models that reduced it (models may share a parameter). These lists hold the
        models: a model lives as long as one of its parameters (its bucket buffers change once)."""
        self._fallback: ModelSteps | None = None
        """The one model of buckets that cannot tell (no parameters: a test double)."""

    def enter(self, bucket: Any) -> CallPlace:
        """Count one hook call of ``bucket`` and return where it stands in its model's steps.

        A known buffer takes one look-up and no lock: a model's own counters are only written by
        the thread running its backward pass (DDP runs one backward at a time per model), so
        two threads training two models never write the same counters.
        """
        try:
            buffer = bucket.buffer()
        except Exception:  # a test double without one: the one model of buckets that cannot tell
            buffer = None
        known = self._by_buffer.get(id(buffer)) if buffer is not None else None
        if known is None or known.buffer() is not buffer:
            with self._lock:
                known = self._known(bucket, buffer)
        model = known.model
        place = CallPlace(known, model.step, model.expected_bucket == 0, model.previous_step_end)
        if known.last:
            model.step += 1
            model.expected_bucket = 0
        else:
            model.expected_bucket = known.index + 1
        return place

    @staticmethod
    def step_ended(place: CallPlace, ends: CollectiveEnds | None) -> None:
        """Note when the step that ``place`` ended finished (None: untraced, nothing to measure from)."""
        if place.last_of_step:
            place.model.previous_step_end = ends

    def count(self) -> int:
        """How many models the hook serves now."""
        with self._lock:
            return sum(ref() is not None for ref in self._models)

    def parameters_of(self, model: ModelSteps) -> list[Any]:
        """``model``'s parameters in the order its buckets first held them: bucket 0's first, as DDP laid them out.

        The same order on every rank (DDP builds a model's first buckets from its parameter order,
        and its one rebuild from rank 0's), whatever the buckets became later.
        """
        with self._lock:
            return [parameter for parameter, models in self._by_parameter.items() if model in models]

    def _known(self, bucket: Any, buffer: Any) -> KnownBucket:
        """Place a buffer not seen before (or a bucket without one) and remember what it is."""
        index, last = bucket.index(), bucket.is_last()
        if buffer is None:
            return KnownBucket(self._single(), index, last, None)
        key = id(buffer)
        known = self._by_buffer.get(key)  # another thread may have placed it while this one waited
        if known is None or known.buffer() is not buffer:
            try:
                model = self._place(bucket, buffer)
            except Exception:  # a bucket without parameters (a test double): one model
                _logger.debug("tensorplay: cannot tell which model a bucket belongs to", exc_info=True)
                model = self._single()
            reference = weakref.ref(buffer, functools.partial(self._forget, key))
            known = self._by_buffer[key] = KnownBucket(model, index, last, BucketLayout(buffer), reference)
            model.buffers[index] = reference
            model.placed_on = threading.get_ident()
        return known

    def _forget(self, key: int, dead: weakref.ref) -> None:
        """A buffer died (its model was freed, or DDP rebuilt its buckets): drop its entry, if still its own.

        Takes no lock: the garbage collector may run this on a thread that holds it. A lost race
        only drops a newer entry, whose buffer is then placed again (by its parameters) at its next call.
        """
        known = self._by_buffer.get(key)
        if known is not None and known.buffer is dead:
            self._by_buffer.pop(key, None)

    def _place(self, bucket: Any, buffer: Any) -> ModelSteps:
        parameters = bucket.parameters()
        if not parameters:
            return self._single()
        index = bucket.index()
        alive = [model for model in (ref() for ref in self._models) if model is not None]
        owners = [model for model in alive if all(model in self._by_parameter.get(p, ()) for p in parameters)]
        model = _likeliest([m for m in owners if m.expected_bucket == index], index, buffer)
        if model is None and index > 0:  # a first iteration: the model that expects this bucket
            model = _likeliest([m for m in alive if m.expected_bucket == index], index, buffer)
        if model is None:
            model = self._new_model()
        for parameter in parameters:
            models = self._by_parameter.get(parameter)
            if models is None:
                self._by_parameter[parameter] = [model]
            elif model not in models:
                models.append(model)
        return model

    def _single(self) -> ModelSteps:
        if self._fallback is None:
            self._fallback = self._new_model()
        return self._fallback

    def _new_model(self) -> ModelSteps:
        """A model with fresh state, numbered with the lowest number no live model holds."""
        for number, ref in enumerate(self._models):
            if ref() is None:
                model = ModelSteps(number)
                self._models[number] = weakref.ref(model)
                return model
        model = ModelSteps(len(self._models))
        self._models.append(weakref.ref(model))
        return model


def _likeliest(candidates: list[ModelSteps], index: int, buffer: Any) -> Optional[ModelSteps]:
    """Of the models a new ``buffer`` for bucket ``index`` fits, the one it belongs to (None: none fits).

    First the models that hold no other live buffer for that index (DDP's rebuild frees a model's
    old buffers before its next backward), then the one last placed on this thread; among equals,
    the first (the order models first reduced a bucket).
    """
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    thread = threading.get_ident()

    def unlikeliness(model: ModelSteps) -> tuple[bool, bool]:
        current = model.buffers.get(index)
        held = current() if current is not None else None
        return held is not None and held is not buffer, model.placed_on != thread

    return min(candidates, key=unlikeliness)
