"""Which DDP model a bucket belongs to, so that one traced hook on several models counts each one's steps.

A hook sees only ``(state, bucket)``, and the state may be None for every model. What tells the
models apart is the bucket itself: DDP's reducer keeps one flat buffer per bucket, and torch
hands out the same Python tensor for it on every call, so a bucket is known by its buffer at the
cost of a dictionary look-up. A buffer seen for the first time (a model's first iteration, or
the one bucket rebuild DDP does after it) is placed by its parameters, each of which belongs to
one model; parameters never seen before come from a model's first iteration, in which DDP calls
the hook for buckets 0, 1, ... in order: bucket 0 starts a new model, a later bucket continues the
model whose first iteration expects it. Everything is held weakly: a model that is freed lets
its entries go, and the next new model takes over its count.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Generic, TypeVar

from .recorder import CollectiveEnds

__all__ = ["ModelSteps", "ModelsOfHook"]

_logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class ModelSteps:
    """One model's iteration count as seen by a traced hook."""

    __slots__ = ("index", "step", "new_step", "previous_step_end", "expected_bucket", "anchor")

    def __init__(self, index: int) -> None:
        self.index = index
        """0 for the first model the hook served, 1 for the next, ..."""
        self.step = 0
        self.new_step = True
        self.previous_step_end: CollectiveEnds | None = None
        self.expected_bucket: int | None = 0
        """In the model's first iteration, the bucket index its next call will have; None after it."""
        self.anchor: weakref.ref | None = None
        """One of the model's parameters: once it is freed, the model is gone."""


class _WeakIndex(Generic[_T]):
    """Objects (tensors) by identity, held weakly: an entry goes when its object is freed."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[weakref.ref, _T]] = {}
        """id(object) -> (weak reference to it, value)."""

    def get(self, obj: Any) -> _T | None:
        entry = self.entries.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return None

    def put(self, obj: Any, value: _T) -> None:
        key = id(obj)
        entries = self.entries

        def forget(ref: weakref.ref) -> None:
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(obj, forget), value)


class ModelsOfHook:
    """The models one traced hook serves, and which of them each bucket belongs to."""

    def __init__(self) -> None:
        self._models: list[ModelSteps] = []
        self._by_buffer: _WeakIndex[ModelSteps] = _WeakIndex()
        self._by_parameter: _WeakIndex[ModelSteps] = _WeakIndex()

    def of(self, bucket: Any) -> ModelSteps:
        """The model ``bucket`` belongs to (the first model if the bucket cannot tell)."""
        try:
            buffer = bucket.buffer()
            entry = self._by_buffer.entries.get(id(buffer))  # _WeakIndex.get, inlined: it runs per bucket
            if entry is not None and entry[0]() is buffer:
                return entry[1]
            return self._place(bucket, buffer)
        except Exception:  # a bucket without parameters (a test double): one model
            _logger.debug("tensorplay: cannot tell which model a bucket belongs to", exc_info=True)
            return self._models[0] if self._models else self._new_model()

    def count(self) -> int:
        """How many models the hook has served."""
        return len(self._models)

    def _place(self, bucket: Any, buffer: Any) -> ModelSteps:
        parameters = bucket.parameters()
        model = next((m for m in map(self._by_parameter.get, parameters) if m is not None), None)
        index = bucket.index()
        if model is None:
            model = self._first_iteration_model(index)
        if model.expected_bucket is not None:
            model.expected_bucket = None if bucket.is_last() else index + 1
        for parameter in parameters:
            self._by_parameter.put(parameter, model)
        if parameters and (model.anchor is None or model.anchor() is None):
            model.anchor = weakref.ref(parameters[0])
        self._by_buffer.put(buffer, model)
        return model

    def _first_iteration_model(self, bucket_index: int) -> ModelSteps:
        """The model a bucket of unseen parameters belongs to: a new one at bucket 0."""
        if bucket_index > 0:
            expecting = [m for m in self._models if m.expected_bucket == bucket_index]
            if expecting:
                return expecting[0]
        freed = next((m for m in self._models if m.anchor is not None and m.anchor() is None), None)
        if freed is not None:  # a model that replaced a freed one continues its count
            freed.expected_bucket = 0
            freed.new_step = True
            freed.anchor = None
            return freed
        return self._new_model()

    def _new_model(self) -> ModelSteps:
        model = ModelSteps(len(self._models))
        self._models.append(model)
        return model
