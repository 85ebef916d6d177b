"""Which DDP model a bucket belongs to, so that one traced hook on several models counts each one's steps.

A hook sees only ``(state, bucket)``, and the state may be None for every model. What tells the
models apart is the bucket itself: each DDP model has its own flat buffer per bucket, and torch
hands out the same Python tensor for it on every call, so a bucket is known by its buffer's
identity (a :class:`~torch.utils.weak.WeakIdKeyDictionary` look-up). A buffer seen for the first
time (a model's first iteration, or the one bucket rebuild DDP does after it) is placed using two
facts: DDP launches a model's buckets in index order 0..last every iteration, and a rebuilt
bucket holds only parameters its model already reduced. So an unseen buffer goes to a model that
owns every one of its parameters and expects its index next; failing that, a bucket 0 starts a new
model and a later bucket continues the model whose first iteration expects it. Two models that
share a parameter stay two: each also holds parameters the other does not.

Parameters and buffers are held weakly, and a model's state lives as long as one of its
parameters: a model that is freed takes its state (step count, when its last step ended) with it. The next new model reuses its number, so labels stay bounded, and starts afresh.
A lock makes placing and counting safe when two threads run backward passes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary

from .recorder import CollectiveEnds

__all__ = ["ModelSteps", "ModelsOfHook", "CallPlace"]

_logger = logging.getLogger(__name__)


class ModelSteps:
    """One model's iteration count as seen by a traced hook."""

    __slots__ = ("index", "step", "expected_bucket", "previous_step_end", "rank_and_world", "__weakref__")

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


class CallPlace:
    """Where one hook call stands: its model, step, and whether it begins or ends the step."""

    __slots__ = ("model", "step", "first_of_step", "last_of_step", "previous_step_end", "bucket_index", "buffer")

    def __init__(
        self, model: ModelSteps, step: int, first: bool, last: bool, previous: CollectiveEnds | None, index: int, buffer: Any
    ) -> None:
        self.model = model
        self.step = step
        self.first_of_step = first
        self.last_of_step = last
        self.previous_step_end = previous
        self.bucket_index = index
        self.buffer = buffer
        """The bucket's buffer and index, read once per call (each read costs the training thread)."""


class ModelsOfHook:
    """The models one traced hook serves, and which of them each bucket belongs to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: list[weakref.ref[ModelSteps]] = []
        """By model number; a dead reference is a freed model whose number is free again."""
        self._by_buffer: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Bucket buffer -> its model."""
        self._by_parameter: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Parameter -> the models that reduced it (models may share a parameter). These lists hold the
        models: a model lives as long as one of its parameters (its bucket buffers change once)."""
        self._fallback: ModelSteps | None = None
        """The one model of buckets that cannot tell (no parameters: a test double)."""

    def enter(self, bucket: Any) -> CallPlace:
        """Count one hook call of ``bucket`` and return where it stands in its model's steps."""
        last = bucket.is_last()
        index = bucket.index()
        try:
            buffer = bucket.buffer()
        except Exception:  # a test double without one: the one model of buckets that cannot tell
            buffer = None
        with self._lock:
            model = self._of(bucket, buffer)
            first = model.expected_bucket == 0
            place = CallPlace(model, model.step, first, last, model.previous_step_end, index, buffer)
            if last:
                model.step += 1
                model.expected_bucket = 0
            else:
                model.expected_bucket = index + 1
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

    def _of(self, bucket: Any, buffer: Any) -> ModelSteps:
        if buffer is None:
            return self._single()
        try:
            model = self._by_buffer.get(buffer)
            if model is None:
                model = self._place(bucket, buffer)
            return model
        except Exception:  # a bucket without parameters (a test double): one model
            _logger.debug("tensorplay: cannot tell which model a bucket belongs to", exc_info=True)
            return self._single()

    def _place(self, bucket: Any, buffer: Any) -> ModelSteps:
        parameters = bucket.parameters()
        if not parameters:
            return self._single()
        index = bucket.index()
        alive = [model for model in (ref() for ref in self._models) if model is not None]
        owners = [model for model in alive if all(model in self._by_parameter.get(p, ()) for p in parameters)]
        model = next((m for m in owners if m.expected_bucket == index), None)
        if model is None and index > 0:  # a first iteration: the model that expects this bucket
            model = next((m for m in alive if m.expected_bucket == index), None)
        if model is None:
            model = self._new_model()
        for parameter in parameters:
            models = self._by_parameter.get(parameter)
            if models is None:
                self._by_parameter[parameter] = [model]
            elif model not in models:
                models.append(model)
        self._by_buffer[buffer] = model
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
