"""What each candidate compression of the advice would make of one bucket, as the sums the advice pools.

The compression advice (:mod:`.advisor`, telemetry contract section 6) weighs a fixed set of
compressions against this rank's gradients. Per bucket and candidate it needs the sums its pooled
figures are made of: ‖x − x̂‖², ‖x‖², the finite elements x̂ would make non-finite, and the bytes
the candidate would send. Each candidate's arithmetic is its hook's:

* ``fp16``, ``bf16``: x = bucket / world size, x̂ = ``bucket.to(dtype).div_(world_size)``. On CPU
  they are measured by the very pass that measures ``traced(fp16_compress_hook)`` (the same
  slices, so the same bits on the same gradients); a cast to the bucket's own dtype is exact, as
  that hook reports it for a float16 model.
* ``powersgd_rank1``, ``_rank2``, ``_rank4``: every tensor of the bucket that ``PowerSGDState``'s
  default ``min_compression_rate`` compresses at that rank, viewed as a matrix M (first dimension
  by the rest, as ``powerSGD_hook`` views it), is approximated by one power iteration from a
  random Q: P = M·Q, P orthonormalized, x̂ = P·(Mᵀ·P)ᵀ; every other tensor is sent as it is
  (error 0). No error feedback, no warm start: what PowerSGD would make of these gradients alone.

Norms are taken in float32 (float64 for float64 buckets), PowerSGD's products too. On CPU the
sums are numbers; on CUDA they are 0-dim device tensors, computed on whatever stream is current,
and nothing here waits for the device.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .compression_figures import Figure, _cast, _squared_norms_by_slices, nonfinite_counts
from .names import Candidate

__all__ = ["CandidateSums", "Layout", "bucket_sums", "compresses", "POWERSGD_RANKS", "MIN_COMPRESSION_RATE", "Q_SEED"]

POWERSGD_RANKS = {Candidate.POWERSGD_RANK1: 1, Candidate.POWERSGD_RANK2: 2, Candidate.POWERSGD_RANK4: 4}
"""The PowerSGD candidates and their ranks."""

MIN_COMPRESSION_RATE = 2
"""``PowerSGDState``'s default ``min_compression_rate``."""

Q_SEED = 0
"""Each bucket's random Qs come from a generator of its own seeded with this: the same Qs for the
same shapes at every advised iteration and on every rank, and torch's global generator (a user's
seeded stream) is neither read nor advanced."""

_CASTS = {Candidate.FP16: torch.float16, Candidate.BF16: torch.bfloat16}

# Elements per slice where a 16-bit bucket's norm is widened to float32: a 1 MiB scratch slice
# stays in cache (the slice of compression_figures' error pass).
_SLICE = 1 << 18

Layout = Sequence[tuple[int, Sequence[int]]]
"""Where each gradient of a bucket lies in its flat buffer: (offset, shape), in the bucket's order."""


class CandidateSums:
    """One candidate's figures for one bucket: the terms the advice adds up over an iteration's buckets."""

    __slots__ = ("error_sq", "reference_sq", "nonfinite", "wire_bytes")

    def __init__(self, error_sq: Figure, reference_sq: Figure, nonfinite: Figure, wire_bytes: int) -> None:
        self.error_sq = error_sq
        """‖x − x̂‖² (for the casts scaled by the world size squared, as ``reference_sq``: the ratio is the error)."""
        self.reference_sq = reference_sq
        """‖x‖², in the same scale."""
        self.nonfinite = nonfinite
        """Elements that are finite in x and would not be in x̂."""
        self.wire_bytes = wire_bytes
        """Bytes the candidate would send for this bucket."""


def compresses(rows: int, cols: int, rank: int, min_compression_rate: float = MIN_COMPRESSION_RATE) -> bool:
    """Whether ``powerSGD_hook`` compresses a ``rows`` x ``cols`` matrix at ``rank`` (its ``_split_layers`` rule)."""
    return (rows + cols) * min(rows, cols, rank) * min_compression_rate < rows * cols


def bucket_sums(bucket: torch.Tensor, layout: Layout, world_size: int) -> dict[str, CandidateSums]:
    """Every candidate's sums for ``bucket`` (a flat buffer as DDP hands it over, gradients at ``layout``)."""
    flat = bucket.reshape(-1)
    sums = {name: _cast_sums(flat, dtype, world_size) for name, dtype in _CASTS.items()}
    sums.update(_powersgd_sums(flat, layout))
    return sums


def _cast_sums(flat: torch.Tensor, dtype: torch.dtype, world_size: int) -> CandidateSums:
    wire_bytes = flat.numel() * torch.finfo(dtype).bits // 8
    if flat.dtype == dtype:
        # The cast is the bucket itself, and the division by the world size that of an uncompressed
        # allreduce: nothing is lost, nothing made non-finite (what traced(fp16_compress_hook)
        # reports for a float16 model).
        return CandidateSums(0.0, _squared_norm(flat), 0, wire_bytes)
    if flat.is_cuda:
        wide = torch.promote_types(flat.dtype, torch.float32)
        approximation = flat.to(dtype).div_(world_size)
        widened = flat.to(wide)
        residual = widened - approximation.to(wide) * world_size
        made = (_nonfinite(approximation) - _nonfinite(flat)).clamp_(min=0)
        return CandidateSums(torch.dot(residual, residual), torch.dot(widened, widened), made, wire_bytes)
    # ‖bucket − ws·x̂‖² and ‖bucket‖²: their ratio is the relative error of x = bucket / ws, and the
    # pass is the one traced(fp16_compress_hook) measures its error with, so the bits are the same.
    error_sq, reference_sq = _squared_norms_by_slices(flat, None, world_size, dtype)
    nonfinite = 0
    if not (math.isfinite(error_sq) and math.isfinite(reference_sq)):  # finite sums: every element finite
        nonfinite, _ = nonfinite_counts(flat, _cast(flat, dtype, world_size))
    return CandidateSums(error_sq, reference_sq, nonfinite, wire_bytes)


def _powersgd_sums(flat: torch.Tensor, layout: Layout) -> dict[str, CandidateSums]:
    wide = torch.promote_types(flat.dtype, torch.float32)
    errors: dict[str, Figure] = {name: 0.0 for name in POWERSGD_RANKS}
    made: dict[str, Figure] = {name: 0 for name in POWERSGD_RANKS}
    sent = {name: 0 for name in POWERSGD_RANKS}
    generator = torch.Generator(device=flat.device).manual_seed(Q_SEED)
    for offset, shape in layout:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) else 1
        cols = numel // rows if rows else 0
        compressed = []
        for name, rank in POWERSGD_RANKS.items():
            if compresses(rows, cols, rank):
                compressed.append((name, rank))
                sent[name] += (rows + cols) * min(rows, cols, rank)
            else:
                sent[name] += numel
        if not compressed:
            continue
        matrix = flat[offset : offset + numel].view(rows, cols).to(wide)
        figures = _power_iteration(matrix, [rank for _, rank in compressed], generator)
        for (name, _), (error_sq, nonfinite) in zip(compressed, figures):
            errors[name] = errors[name] + error_sq
            made[name] = made[name] + nonfinite
    reference_sq = _squared_norm(flat)
    element = flat.element_size()
    return {name: CandidateSums(errors[name], reference_sq, made[name], sent[name] * element) for name in POWERSGD_RANKS}


def _power_iteration(matrix: torch.Tensor, ranks: list[int], generator: torch.Generator) -> list[tuple[Figure, Figure]]:
    """(‖M − x̂‖², elements made non-finite) of one power iteration at each of ``ranks`` (ascending).

    One draw serves every rank: the first k columns of a Gaussian Q are a Gaussian Q of k columns,
    and Gram-Schmidt makes column i from columns 0..i alone, so P's first k columns are what rank k
    alone would make. The residuals are taken one rank after the other, in place.
    """
    rows, cols = matrix.shape
    q = torch.randn(cols, ranks[-1], generator=generator, dtype=matrix.dtype, device=matrix.device)
    p = matrix @ q
    _orthonormalize(p)
    b = matrix.t() @ p
    residual = matrix.clone()
    figures: list[tuple[Figure, Figure]] = []
    done = 0
    for rank in ranks:
        residual.addmm_(p[:, done:rank], b[:, done:rank].t(), alpha=-1)
        done = rank
        error_sq = _squared(residual)
        if residual.is_cuda:
            figures.append((error_sq, _made_nonfinite(matrix, residual)))
        else:  # a finite sum proves every element finite: no counting pass
            figures.append((error_sq, 0 if math.isfinite(error_sq) else int(_made_nonfinite(matrix, residual))))
    return figures


def _orthonormalize(p: torch.Tensor) -> None:
    """Make the columns of ``p`` orthonormal in place (PowerSGD's "P orthonormalized").

    Gram-Schmidt in float64, each column projected out of the previous ones twice. Where M·Q has
    lower rank than Q has columns (a gradient of rank below k) a column is float32 rounding noise
    once projected, and only a wider projection leaves that noise orthogonal to the columns before
    it (in float32 the rank-4 candidate of a rank-1 2048 x 2048 gradient had a relative error of
    1e-5, ten times its rank-2 one; 3e-8 in float64). P is only n x k: the widening costs nothing
    next to the products with M. ``powerSGD_hook`` orthonormalizes with QR from rank 3 on: the same
    span, so the same x̂ up to rounding. A column of zeros (an all-zero gradient) stays zero, and
    its approximation is exact.
    """
    wide = p.to(torch.float64)
    for i in range(wide.shape[1]):
        column = wide[:, i : i + 1]
        if i:
            previous = wide[:, :i]
            for _ in range(2):
                column -= previous @ (previous.t() @ column)
        column /= torch.linalg.vector_norm(column).clamp_(min=torch.finfo(torch.float64).tiny)
    p.copy_(wide)


def _made_nonfinite(matrix: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Elements finite in M whose M − x̂ is not: those x̂ made non-finite (unless M − x̂ overflowed, beyond 1e38)."""
    return (torch.isfinite(matrix) & ~torch.isfinite(residual)).sum()


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(tensor)).sum()


def _squared(tensor: torch.Tensor) -> Figure:
    flat = tensor.reshape(-1)
    square = torch.dot(flat, flat)
    return square if square.is_cuda else float(square)


def _squared_norm(flat: torch.Tensor) -> Figure:
    """‖flat‖² in float32 or wider (a 16-bit bucket widened slice by slice on CPU)."""
    wide = torch.promote_types(flat.dtype, torch.float32)
    if flat.dtype == wide or flat.is_cuda:
        return _squared(flat.to(wide))
    scratch = torch.empty(min(_SLICE, flat.numel()), dtype=wide)
    total = 0.0
    for start in range(0, flat.numel(), _SLICE):
        x = scratch[: min(_SLICE, flat.numel() - start)].copy_(flat[start : start + _SLICE])
        total += float(torch.dot(x, x))
    return total
