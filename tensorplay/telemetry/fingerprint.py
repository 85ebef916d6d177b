"""A replica fingerprint: a fixed sample of every parameter's elements, hashed to an integer below 2^53.

Ranks whose parameters are bit for bit equal get the same fingerprint; ranks whose parameters
differ in any sampled element get different ones (but for a 2^-53 chance). The sample is fixed
and documented (docs/telemetry.md, "Replicas"): of a parameter of ``n`` elements, every element
if ``n <= SAMPLE_ELEMENTS``, else the elements ``k * n // SAMPLE_ELEMENTS`` for ``k`` in
``0 .. SAMPLE_ELEMENTS - 1`` (in the parameter's logical, row-major order, whatever its
strides), taken as their bit patterns in the parameter's own dtype, parameters in the order the
caller gives. The bytes are hashed with BLAKE2b (8 bytes), of which the top 53 bits are kept, so
that a float64 gauge carries the value exactly.

On CUDA the sample is gathered on the device and copied to pinned host memory without waiting
(``non_blocking``), after which an event is recorded: the training thread never synchronizes the
device. The bytes are hashed once :meth:`Sample.ready` says the copies have happened.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

__all__ = ["SAMPLE_ELEMENTS", "FINGERPRINT_BITS", "sample_indices", "Sample", "take_sample", "digest"]

SAMPLE_ELEMENTS = 64
"""Elements sampled per parameter (all of a smaller one)."""

FINGERPRINT_BITS = 53
"""A float64 holds every integer below 2^53 exactly: a Prometheus gauge carries the fingerprint as it is."""


def sample_indices(numel: int, device: torch.device | None = None) -> torch.Tensor:
    """The flat indices sampled from a parameter of ``numel`` elements: evenly strided, the first always 0."""
    if numel <= SAMPLE_ELEMENTS:
        return torch.arange(numel, dtype=torch.int64, device=device)
    return torch.arange(SAMPLE_ELEMENTS, dtype=torch.int64, device=device) * numel // SAMPLE_ELEMENTS


def digest(data: bytes) -> int:
    """BLAKE2b of ``data``, its top 53 bits as an integer."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> (64 - FINGERPRINT_BITS)


class Sample:
    """The sampled bytes of one fingerprint, on the host, and what says the device has written them.

    ``chunks`` are uint8 tensors in host memory, in fingerprint order; ``events`` have ``query()``
    (``torch.cuda.Event``, or anything that answers it): the chunks are complete once every event
    has happened. CPU samples have no events.
    """

    __slots__ = ("chunks", "events")

    def __init__(self, chunks: list[torch.Tensor], events: Sequence[Any] = ()) -> None:
        self.chunks = chunks
        self.events = list(events)

    def ready(self) -> bool:
        """Whether the device has copied every chunk (never waits)."""
        return all(event.query() for event in self.events)

    def value(self) -> int:
        """The fingerprint; only once :meth:`ready`."""
        return digest(b"".join(chunk.numpy().tobytes() for chunk in self.chunks))


def take_sample(parameters: Sequence[torch.Tensor], indices: Sequence[torch.Tensor]) -> Sample:
    """Gather the elements ``indices[i]`` of ``parameters[i]`` (in that order) as bytes on the host.

    Each index tensor lies on its parameter's device (:func:`sample_indices`; the caller keeps
    them). Consecutive parameters on one device are gathered into one tensor; a CUDA run is
    copied to pinned host memory without waiting, and an event recorded on the device's current
    stream says when it is there.
    """
    chunks: list[torch.Tensor] = []
    events: list[Any] = []
    run: list[torch.Tensor] = []
    device: torch.device | None = None

    def close_run() -> None:
        if not run:
            return
        gathered = torch.cat(run) if len(run) > 1 else run[0]
        if gathered.is_cuda:
            host = torch.empty(gathered.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(gathered.device))
            chunks.append(host)
            events.append(event)
        else:
            chunks.append(gathered)
        run.clear()

    with torch.no_grad():
        for parameter, index in zip(parameters, indices):
            values = parameter.detach()
            if values.device != device:
                close_run()
                device = values.device
            taken = torch.take(values, index)
            run.append(taken.view(torch.uint8) if taken.dtype != torch.uint8 else taken)
        close_run()
    return Sample(chunks, events)
