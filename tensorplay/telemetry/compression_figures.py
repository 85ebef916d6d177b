"""The compression figures: relative L2 error and non-finite elements created by compression.

Each figure is computed in exactly one place, here. On CPU the figures are plain numbers; on
CUDA they are 0-dim device tensors (no synchronization on the hot path), copied by
:func:`to_host` into pinned host memory on the stream that computed them, which the finisher
reads with :func:`to_number` once an event recorded after the copy has happened: it never waits
for a stream (a hung collective would hold it for good).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "compression_figures", "cast_figures", "same_dtype_figures", "reduced_figures", "all_finite", "finite_flag",
    "made_elsewhere", "any_of", "nonfinite_in", "to_host", "to_number", "error_value",
]

# Elements per slice of the CPU error pass: a 1 MiB float32 scratch slice stays in cache, and a
# 25 MB bucket takes 25 slices of three calls each (2^16 took 100: 24 % slower per bucket,
# measured with 6.5 M elements on the 2-core bench machine, 7.7 vs 10.1 ms median of 40).
_SLICE = 1 << 18

Figure = float | int | torch.Tensor


def compression_figures(
    original: torch.Tensor,
    approximation: torch.Tensor | None,
    scale: float = 1.0,
    residual: torch.Tensor | None = None,
    with_error: bool = True,
) -> tuple[Figure | None, Figure, Figure]:
    """Return (relative error, non-finite elements created, non-finite elements already there).

    The relative error is ‖x − x̂‖₂ / ‖x‖₂ with x = ``original / scale`` and x̂ = ``approximation``,
    or, with ``residual`` given, ‖residual‖₂ / ‖original‖₂; it is None unless ``with_error``, and
    None where the figures are not finite. A zero contribution has zero error. The counts are
    those of :func:`nonfinite_counts` (zeros without an approximation).
    """
    if original.is_cuda:
        return _cuda_figures(original, approximation, scale, residual, with_error)
    if with_error and residual is not None:
        residual_norm = float(torch.linalg.vector_norm(residual))
        error = _ratio(residual_norm, float(torch.linalg.vector_norm(original)))
        if approximation is None or math.isfinite(residual_norm):
            # A finite norm of original - approximation proves both finite: no counting pass.
            return error, 0, 0
        return (error, *nonfinite_counts(original, approximation))
    if approximation is None:
        return None, 0, 0
    if not with_error:
        return (None, *nonfinite_counts(original, approximation))
    error_sq, reference_sq = _squared_norms_by_slices(original.reshape(-1), approximation.reshape(-1), scale)
    if math.isfinite(error_sq) and math.isfinite(reference_sq):
        return _ratio(error_sq**0.5, reference_sq**0.5), 0, 0  # finite sums: every element finite
    return (None, *nonfinite_counts(original, approximation))


def cast_figures(
    original: torch.Tensor, dtype: torch.dtype, scale: float, with_error: bool, proven_finite: bool
) -> tuple[float | None, int, int]:
    """The figures of :func:`compression_figures` for a compression that is ``original.to(dtype) / scale``.

    The approximation is recomputed from ``original`` (bit for bit what the hook made, since a
    cast and a division are exact functions of their input), so the figures can be taken after
    the collective has overwritten the hook's compressed tensor, as long as ``original`` is
    unchanged. The error pass casts slice by slice, in cache, and its finite sums prove every
    element finite. ``proven_finite`` says that the approximation is known to hold no non-finite
    element (every rank's contribution to a finite all-reduce result is finite): the counts are
    then zero without a pass. Otherwise, where nothing proved it finite, the approximation is
    rebuilt whole and the figures are exactly those of :func:`compression_figures`. CPU only.
    """
    if with_error:
        # The error pass proves finiteness itself: finite sums mean every element of the input
        # and of its cast is finite, so a sampled step needs no separate proof (or counting pass).
        error_sq, reference_sq = _squared_norms_by_slices(original.reshape(-1), None, scale, dtype)
        if math.isfinite(error_sq) and math.isfinite(reference_sq):
            return _ratio(error_sq**0.5, reference_sq**0.5), 0, 0
        if proven_finite:
            return None, 0, 0  # finite approximation: its input is finite too, whatever the norms did
    elif proven_finite:
        return None, 0, 0
    return compression_figures(original, _cast(original.reshape(-1), dtype, scale), scale, None, with_error)


def same_dtype_figures(original: torch.Tensor, with_error: bool) -> tuple[Figure | None, Figure, Figure]:
    """The figures of a cast to ``original``'s own dtype, which changes no element.

    Its relative error is 0 and it makes nothing non-finite; what is counted is the non-finite
    elements ``original`` already holds (on CUDA as a device tensor; on CPU a finite sum spares
    the counting pass). The error is None, as everywhere, where the bucket is not finite.
    """
    if original.is_cuda:
        already = _nonfinite_count(original)
        error = torch.where(already == 0, 0.0, float("nan")) if with_error else None
        return error, 0, already
    if all_finite(original):
        return (0.0 if with_error else None), 0, 0
    return None, 0, int(_nonfinite_count(original))


def reduced_figures(
    original: torch.Tensor | None,
    approximation: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    carried: torch.Tensor | None = None,
    arrived: Figure | None = None,
    elsewhere: bool | torch.Tensor = False,
    with_error: bool = True,
) -> tuple[Figure | None, Figure | None, Figure | None]:
    """(relative error, non-finite elements made by this rank's compression, non-finite elements arrived)
    of a compression whose result is the group's (PowerSGD's decompressed bucket).

    ``original`` is what this rank compressed, the bucket plus ``carried`` (the error-feedback
    residual it added; None: nothing), or None when the hook kept no copy: then ``arrived`` is its
    count, taken before the hook overwrote it (None: not taken, and nothing is measured). What
    arrived is the bucket's own non-finite elements: those of ``original`` where ``carried`` is
    finite (where it is not, the element is the hook's memory's, whatever the bucket held).

    The result is every rank's work, so its non-finite elements are counted as made by this rank
    only where its own bucket held none and ``elsewhere`` is false (no reduced result brought in
    another rank's non-finite elements; see :func:`made_elsewhere`); then they are all of them,
    those its carried memory brought in included. A bucket that held some made no more: PowerSGD
    spreads one non-finite element over its whole matrix, which is the input's doing.

    A finite ``residual`` (original minus approximation) proves both terms finite, so a healthy
    bucket costs one pass over it, or none on a sampled step, whose norms prove it.
    """
    if approximation.is_cuda:
        return _cuda_reduced_figures(original, approximation, residual, carried, arrived, elsewhere, with_error)
    error: float | None = None
    proven = False
    if original is not None and with_error:
        if residual is not None:
            residual_norm = float(torch.linalg.vector_norm(residual))
            error = _ratio(residual_norm, float(torch.linalg.vector_norm(original)))
            proven = math.isfinite(residual_norm)
        else:
            error_sq, reference_sq = _squared_norms_by_slices(original.reshape(-1), approximation.reshape(-1), 1.0)
            proven = math.isfinite(error_sq) and math.isfinite(reference_sq)
            error = _ratio(error_sq**0.5, reference_sq**0.5) if proven else None
    elif residual is not None:
        proven = all_finite(residual)
    if proven:
        return error, 0, 0
    if original is not None:
        arrived = _arrived_count(original, carried)
    elif arrived is None:
        return None, None, None
    if arrived or elsewhere:
        return error, 0, arrived
    return error, nonfinite_in(approximation), arrived


def _arrived_count(original: torch.Tensor, carried: torch.Tensor | None) -> int:
    """Non-finite elements of ``original`` where ``carried`` is finite (CPU; a finite sum spares the count)."""
    if all_finite(original):
        return 0  # a finite sum of bucket and carried: both finite
    if carried is None:
        return int(_nonfinite_count(original))
    return int((~torch.isfinite(original) & torch.isfinite(carried)).sum())


def _cuda_reduced_figures(
    original: torch.Tensor | None,
    approximation: torch.Tensor,
    residual: torch.Tensor | None,
    carried: torch.Tensor | None,
    arrived: Figure | None,
    elsewhere: bool | torch.Tensor,
    with_error: bool,
) -> tuple[Figure | None, Figure | None, Figure | None]:
    """The figures of :func:`reduced_figures` as 0-dim device tensors: nothing here waits for the device."""
    if original is not None:
        nonfinite = ~torch.isfinite(original)
        arrived = (nonfinite & torch.isfinite(carried) if carried is not None else nonfinite).sum()
    elif arrived is None:
        return None, None, None
    clean = torch.as_tensor(arrived, device=approximation.device) == 0
    if isinstance(elsewhere, torch.Tensor):
        clean = clean & ~elsewhere
    elif elsewhere:
        clean = torch.zeros_like(clean)
    made = _nonfinite_count(approximation)
    made = torch.where(clean, made, torch.zeros_like(made))
    error = None
    if with_error and original is not None:
        numerator = torch.linalg.vector_norm(residual if residual is not None else original - approximation)
        denominator = torch.linalg.vector_norm(original)
        error = torch.where(denominator > 0, numerator / denominator, torch.zeros_like(numerator))
    return error, made, arrived


def _cast(original: torch.Tensor, dtype: torch.dtype, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``original`` cast to ``dtype`` then divided by ``scale``: the hooks' own arithmetic, in ``out`` if given."""
    cast = original.to(dtype) if out is None else out.copy_(original)
    return cast.div_(scale) if scale != 1 else cast


def _squared_norms_by_slices(
    original: torch.Tensor, approximation: torch.Tensor | None, scale: float, cast_to: torch.dtype | None = None
) -> tuple[float, float]:
    """‖original − scale·approximation‖² and ‖original‖² in one cache-friendly CPU pass.

    The ratio of their roots is the relative error of x = original / scale, without dividing.
    Without ``approximation``, each slice of it is recomputed as ``original.to(cast_to) / scale``.
    """
    dtype = torch.promote_types(original.dtype, torch.float32)
    difference_scratch = torch.empty(min(_SLICE, original.numel()), dtype=dtype)
    widened_scratch = torch.empty(difference_scratch.numel(), dtype=dtype) if original.dtype != dtype else None
    cast_scratch = torch.empty(difference_scratch.numel(), dtype=cast_to) if approximation is None else None
    error_sq = 0.0
    reference_sq = 0.0
    for start in range(0, original.numel(), _SLICE):
        x = original[start : start + _SLICE]
        if cast_scratch is not None:
            approximated = _cast(x, cast_to, scale, out=cast_scratch[: x.numel()])  # type: ignore[arg-type]
        else:
            approximated = approximation[start : start + _SLICE]  # type: ignore[index]
        if widened_scratch is not None:
            x = widened_scratch[: x.numel()].copy_(x)
        reference_sq += float(torch.dot(x, x))
        # Widened first: a subtraction within one dtype is faster than a mixed one (4.9 against
        # 5.7 ms for a 6.5 M-element bucket on the 2-core bench machine, same bits).
        difference = difference_scratch[: x.numel()].copy_(approximated)
        torch.sub(x, difference, alpha=scale, out=difference)
        error_sq += float(torch.dot(difference, difference))
    return error_sq, reference_sq


def _ratio(numerator: float, denominator: float) -> float | None:
    if not (math.isfinite(numerator) and math.isfinite(denominator)):
        return None
    return numerator / denominator if denominator > 0.0 else 0.0


def _cuda_figures(
    original: torch.Tensor,
    approximation: torch.Tensor | None,
    scale: float,
    residual: torch.Tensor | None,
    with_error: bool,
) -> tuple[torch.Tensor | None, Figure, Figure]:
    """The same figures as 0-dim device tensors: nothing here waits for the device."""
    created: Figure = 0
    already: Figure = 0
    if approximation is not None:
        already = _nonfinite_count(original)
        created = (_nonfinite_count(approximation) - already).clamp_(min=0)
    if not with_error or (residual is None and approximation is None):
        return None, created, already
    if residual is None:
        residual = original - approximation * scale
    numerator = torch.linalg.vector_norm(residual)
    denominator = torch.linalg.vector_norm(original)
    error = torch.where(denominator > 0, numerator / denominator, torch.zeros_like(numerator))
    return error, created, already


def nonfinite_counts(original: torch.Tensor, approximation: torch.Tensor) -> tuple[int, int]:
    """Count (on CPU) elements made non-finite by compression, and those non-finite before it.

    Compression keeps inf and NaN as they are, so the first count is the difference of the two
    non-finite counts. A finite sum proves every element finite, which spares the counting pass
    (about 14 times the cost of the sum) on healthy buckets; the sum is taken in the compressed
    dtype (4 to 25 times faster than widening it), and when that sum itself overflows, a finite
    minimum and maximum still prove the bucket finite.
    """
    if all_finite(approximation):
        return 0, 0
    already = int(_nonfinite_count(original))
    return max(int(_nonfinite_count(approximation)) - already, 0), already


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite (CPU), in one pass when it is.

    A sum with a non-finite term is not finite, so a finite sum proves every element finite;
    the sum is taken in the tensor's own dtype, and when that sum itself overflows, a finite
    minimum and maximum still prove it. Only a tensor that holds inf or NaN fails both.
    """
    if bool(torch.isfinite(tensor.sum())):
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def finite_flag(tensor: torch.Tensor) -> bool | torch.Tensor:
    """Whether every element of ``tensor`` is finite: a bool on CPU (:func:`all_finite`), a 0-dim bool on CUDA (not waited for)."""
    if tensor.is_cuda:
        return torch.isfinite(tensor).all()
    return all_finite(tensor)


def made_elsewhere(sent: bool | torch.Tensor, received: bool | torch.Tensor) -> bool | torch.Tensor:
    """Whether a reduced result brought in non-finite elements: this rank's contribution was finite, the result is not.

    The other ranks' contributions held them, or the sum of finite ones overflowed: either way
    not this rank's doing.
    """
    if isinstance(received, torch.Tensor):
        return sent & ~received  # type: ignore[operator]
    return bool(sent) and not received


def any_of(flags: list[bool | torch.Tensor]) -> bool | torch.Tensor:
    """Whether any of the flags is set (on CUDA, a 0-dim device bool)."""
    if flags and isinstance(flags[0], torch.Tensor):
        return torch.stack(flags).any()  # type: ignore[arg-type]
    return any(flags)


def nonfinite_in(tensor: torch.Tensor) -> Figure:
    """Non-finite elements of ``tensor``: on CPU a finite sum spares the counting pass; on CUDA a device count."""
    if tensor.is_cuda:
        return _nonfinite_count(tensor)
    return 0 if all_finite(tensor) else int(_nonfinite_count(tensor))


def _nonfinite_count(tensor: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(tensor)).sum()


def to_host(figure: Figure | None) -> Figure | None:
    """A CUDA figure's copy in pinned host memory, enqueued on the current stream; any other figure as it is.

    Nothing waits: a non-blocking copy to the host lands in pinned memory that torch allocates
    for it, and is read only once an event recorded after it on that same stream (the one that
    computed the figure) has happened.
    """
    if not isinstance(figure, torch.Tensor) or not figure.is_cuda:
        return figure
    return figure.to("cpu", non_blocking=True)


def to_number(figure: Figure) -> float | int:
    """A figure as a Python number, read from host memory (a CUDA figure: its :func:`to_host` copy, once copied).

    A figure still on the device is refused: reading it would wait for its stream.
    """
    if not isinstance(figure, torch.Tensor):
        return figure
    if figure.is_cuda:
        raise ValueError("tensorplay: a CUDA figure must be read from its host copy (to_host), not the device")
    return figure.item()


def error_value(figure: Figure | None) -> float | None:
    """The relative error as a number, or None where it is not finite (a bucket that overflowed).

    The one rule for both paths: the CPU pass already gives None there, the CUDA figure is a
    device tensor that may hold inf or NaN, and one such value in the error histogram would
    turn its ``_sum`` into +Inf for the rest of the run.
    """
    if figure is None:
        return None
    value = float(to_number(figure))
    return value if math.isfinite(value) else None
