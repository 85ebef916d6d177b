"""PowerSGD gradient compression for DDP (Vogels et al., 2019, https://arxiv.org/abs/1905.13727).

Same state, arguments and arithmetic as ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``,
so swapping the import changes no gradient bit. Two things differ on purpose:

* Every rank issues its collectives in one fixed order. torch's hooks launch the second round of a
  bucket's collectives from future callbacks, whose timing differs between ranks, so with several
  buckets gloo pairs up collectives of different buckets and aborts or hangs. Here too the second
  round is launched as soon as the bucket's first round completed (from the completing callback,
  so every future completes on its own, even one a wrapper waits for inside the hook), but the
  hook call for the next bucket launches nothing before that second round is out. DDP calls the
  hook bucket by bucket, in index order, on every rank, so the order is the same everywhere:
  first round, second round, then the next bucket's first round.
* ``batched_powerSGD_hook`` hands its orthogonalization the batch it expects (torch's asserts on
  its first compressing step) and honours ``orthogonalization_epsilon``.

Each compressed bucket is reported once to the telemetry probe, as kind ``powersgd``: this rank's
contribution, what compression made of it and, with error feedback, the residual the hook keeps
anyway and the one it added to the bucket. The result is the group's, so the collectives of this
rank's own factors and uncompressed tensors are watched (was what this rank sent finite, is the
reduced result?): a non-finite element another rank brought in is not this rank's compression's.
Without error feedback, on a step that does not sample the error, the hook keeps no copy of its
input: it reports the input right before decompression overwrites it. Nothing is computed for
telemetry when nobody traces the call.
"""

import functools
import logging
import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from tensorplay.telemetry.probe import HookRecorder, current_recorder, describe_hook

from ._common import allreduce_future, check_floating_bucket
from .default_hooks import _allreduce_fut

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"]

logger = logging.getLogger(__name__)

_KIND = "powersgd"
_SEED_BOUND = 1_000_000_000


def _forward(result: torch.futures.Future[torch.Tensor], done: torch.futures.Future[torch.Tensor]) -> None:
    """Complete ``result`` as ``done`` completed."""
    try:
        value = done.value()
    except Exception as error:
        result.set_exception(error)
        return
    result.set_result(value)


class PowerSGDState:
    r"""
    Hold PowerSGD's hyperparameters and the per-bucket state it carries between iterations.

    One state serves every bucket of a DDP model. The hyperparameters mean what they mean in
    torch's ``PowerSGDState``:

    * ``matrix_approximation_rank``: rank of the low-rank factors P and Q; lower compresses more.
      Start at 1 and double until accuracy is good enough; 1 to 4 is typical.
    * ``start_powerSGD_iter``: iterations of plain allreduce before compression starts. Early
      training is sensitive to gradient error; about 10% of the training steps (at least the
      warm-up) is a good start.
    * ``min_compression_rate``: a gradient matrix is compressed only when
      ``(rows + cols) * rank * min_compression_rate < rows * cols``; the others are allreduced
      as they are, together (biases always are).
    * ``use_error_feedback``: add the error compression left on this rank last time to the
      next gradient. Costs one copy of each bucket; keep it on for convergence.
    * ``warm_start``: start each iteration's power iteration from the previous Q instead of a
      random one. Costs the memory of P and Q; keep it on for accuracy and speed.
    * ``orthogonalization_epsilon``: added to every column norm when orthogonalizing, to avoid
      dividing by zero when a gradient is all zeros; 0 is the most accurate.
    * ``random_seed``: seeds the random Qs, identically on every rank.
    * ``compression_stats_logging_frequency``: iterations between two logs of
      :meth:`compression_stats` once compression runs.
    * ``batch_tensors_with_same_shape``: compress same-shaped gradients of a bucket as one batch;
      faster compression for more memory (and larger buckets are needed to benefit).

    Error feedback and warm start keep tensors per bucket index, which DDP's bucket rebuild after
    its first iteration would invalidate: with either on, ``start_powerSGD_iter`` must be at least
    2, as in torch.

    The state pickles for checkpointing without its process group: an unpickled state uses the
    default group until ``process_group`` is set.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, powerSGD_hook)
    """

    __slots__ = [
        "process_group",
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "min_compression_rate",
        "orthogonalization_epsilon",
        "use_error_feedback",
        "warm_start",
        "batch_tensors_with_same_shape",
        "rng",
        "error_dict",
        "p_memory_dict",
        "q_memory_dict",
        "iter",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "compression_stats_logging_frequency",
        "next_stats_report",
        "_second_round_out",
    ]
    _TRANSIENT = ("process_group", "_second_round_out")

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup],
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        import numpy as np  # only PowerSGD needs it; a plain import of the hooks must not

        _check_group(process_group)
        _check_int("matrix_approximation_rank", matrix_approximation_rank, minimum=1)
        _check_int("start_powerSGD_iter", start_powerSGD_iter, minimum=0)
        _check_real("min_compression_rate", min_compression_rate)
        _check_real("orthogonalization_epsilon", orthogonalization_epsilon)
        _check_int("compression_stats_logging_frequency", compression_stats_logging_frequency)
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "PowerSGDState: start_powerSGD_iter must be at least 2 when use_error_feedback or "
                "warm_start is on, because DDP rebuilds its buckets after the first iteration and "
                f"that invalidates per-bucket memory; got {start_powerSGD_iter}"
            )
        logger.info(
            "PowerSGD config: matrix_approximation_rank=%s start_powerSGD_iter=%s "
            "min_compression_rate=%s orthogonalization_epsilon=%s use_error_feedback=%s "
            "warm_start=%s random_seed=%s compression_stats_logging_frequency=%s "
            "batch_tensors_with_same_shape=%s",
            matrix_approximation_rank,
            start_powerSGD_iter,
            min_compression_rate,
            orthogonalization_epsilon,
            use_error_feedback,
            warm_start,
            random_seed,
            compression_stats_logging_frequency,
            batch_tensors_with_same_shape,
        )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        # Draws one seed per compressed bucket whose Qs start random: the same draws on every
        # rank, different ones at every step.
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        # Set once the second round of the latest compressed bucket has been launched.
        self._second_round_out: Optional[threading.Event] = None

    def __getstate__(self) -> dict[str, Any]:
        """Return what a checkpoint keeps: everything but the process group and in-flight work."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in self._TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled state on the default process group."""
        self.process_group = distributed_c10d._get_default_group()
        self._second_round_out = None
        logger.warning(
            "PowerSGDState restored on the default process group; "
            "assign state.process_group to use another one"
        )
        for slot, value in state.items():
            setattr(self, slot, value)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count one iteration when ``bucket`` is the iteration's last one."""
        if not bucket.is_last():
            return
        self.iter += 1
        if self.iter == self.start_powerSGD_iter:
            logger.info("PowerSGD compression starts after %s iterations", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """
        Return ``(rate, numel_before, numel_after)`` over every bucket compressed so far.

        ``numel_before`` counts the gradient elements the hook compressed or allreduced as they
        were, ``numel_after`` the elements it sent instead, and ``rate`` is their ratio
        (0 before any compression).
        """
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after


def _check_group(process_group: Any) -> None:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "PowerSGDState: process_group must be a torch.distributed.ProcessGroup or None "
            f"(the default group), got {type(process_group).__name__}"
        )


def _check_int(name: str, value: Any, minimum: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"PowerSGDState: {name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"PowerSGDState: {name} must be at least {minimum}, got {value}")


def _check_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"PowerSGDState: {name} must be a number, got {type(value).__name__}")
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"PowerSGDState: {name} must be a non-negative number, got {value}")


def _check_state(state: Any, hook_name: str) -> dist.ProcessGroup:
    """Return the process group of a valid ``state``; raise TypeError for anything else."""
    if not isinstance(state, PowerSGDState):
        kind = type(state)
        raise TypeError(
            f"{hook_name}: state must be a tensorplay PowerSGDState, e.g. "
            f"PowerSGDState(process_group=None); got {kind.__module__}.{kind.__qualname__}"
        )
    if state.process_group is None:
        return dist.group.WORLD
    _check_group(state.process_group)
    return state.process_group


# -- the arithmetic, op for op the same as torch's --


def _orthogonalize(matrices: torch.Tensor, epsilon: float) -> None:
    """Make the columns of every matrix of the batch ``matrices`` orthonormal, in place.

    QR has no half-precision kernel and is slower for one or two columns: Gram-Schmidt there.
    """
    count, _, rank = matrices.shape
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        _gram_schmidt(matrices, epsilon)
        return
    r_scratch = torch.empty(count, rank, rank, device=matrices.device, dtype=matrices.dtype)
    torch.linalg.qr(matrices, out=(matrices, r_scratch))


def _gram_schmidt(matrices: torch.Tensor, epsilon: float) -> None:
    columns = matrices.shape[2]
    for i in range(columns):
        column = matrices[:, :, i : i + 1]
        norm = torch.norm(column, dim=1, keepdim=True)
        # Without epsilon an all-zero column turns into NaNs.
        column /= norm if epsilon == 0 else norm + epsilon
        if i + 1 < columns:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(column * rest, dim=1, keepdim=True) * column


def _random_normal(state: PowerSGDState, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Draw standard normal tensors on the CPU from the state's next seed, leaving torch's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(state.rng.randint(_SEED_BOUND))
        return [torch.randn(*shape, device="cpu", dtype=dtype) for shape in shapes]


def _incorporate_error(
    state: PowerSGDState, bucket_index: int, tensor: torch.Tensor, recorder: Optional[HookRecorder]
) -> Optional[torch.Tensor]:
    """Add the error this rank kept for the bucket; return a copy of its contribution if needed.

    Error feedback needs the copy to compute the next error; telemetry needs it only when the
    call samples the compression error.
    """
    if state.use_error_feedback:
        error = state.error_dict.get(bucket_index)
        if error is None:
            logger.info("PowerSGD: zero error of %s elements created for bucket %s", tensor.numel(), bucket_index)
            state.error_dict[bucket_index] = torch.zeros_like(tensor)
        else:
            tensor.add_(error)
        return tensor.detach().clone()
    if recorder is not None and recorder.wants_compression_error():
        return tensor.detach().clone()
    return None


def _finish(
    errors: Optional[dict[int, torch.Tensor]],
    bucket_index: int,
    approximation: torch.Tensor,
    original: Optional[torch.Tensor],
    recorder: Optional[HookRecorder],
) -> None:
    """Keep the new error (in ``errors``, with error feedback) and report the compression.

    Runs in a future callback once the bucket holds its approximation. It is handed the error
    dict rather than the state: a callback holding the state, and through it the process group,
    could drop the group's last reference on a gloo worker thread, which aborts the process.
    """
    if approximation.is_cuda:
        torch.cuda.synchronize(approximation.device)
    residual = carried = None
    if errors is not None:
        carried = errors.get(bucket_index)  # the error this call added to the bucket
        residual = original - approximation
        errors[bucket_index] = residual
    if recorder is not None:
        recorder.compression(_KIND, original, approximation, residual=residual, carried=carried, reduced=True)


def _then(future: Optional[torch.futures.Future], step: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """Run ``step`` once ``future`` succeeded (at once without a future); return its result's future."""
    if future is None:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(step())
        return done

    def after(finished: torch.futures.Future) -> torch.Tensor:
        finished.wait()  # re-raises the collective's failure
        return step()

    return future.then(after)


def _schedule(
    state: PowerSGDState,
    bucket: dist.GradBucket,
    first_round: list[torch.futures.Future],
    launch: Callable[[], torch.futures.Future[torch.Tensor]],
    device: torch.device,
) -> torch.futures.Future[torch.Tensor]:
    """Launch the bucket's second round once its first round completed; return the result's future.

    The launch happens in the callback of the first round, so the future completes without any
    further hook call. The next hook call waits until it is out (:func:`_await_second_round`),
    and so does the last bucket's own call, because DDP may launch a collective of its own right
    after the last hook call (the unused-parameter map).
    """
    result: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()
    )
    out = threading.Event()
    # The callback drops ``launch`` once it ran: what a future's callback still holds when it is
    # destroyed on a gloo worker thread must not hold the process group (gloo aborts dropping
    # its last reference there).
    pending = [launch]

    def second_round(_: Any) -> None:
        try:
            for future in first_round:
                future.wait()  # re-raises a failed first round
            decompressed = pending.pop()()
        except Exception as error:  # DDP raises it when it waits for this bucket
            pending.clear()
            result.set_exception(error)
            return
        finally:
            out.set()
        decompressed.add_done_callback(functools.partial(_forward, result))

    torch.futures.collect_all(first_round).add_done_callback(second_round)
    if bucket.is_last():
        out.wait()
    else:
        state._second_round_out = out
    return result


def _await_second_round(state: PowerSGDState) -> None:
    """Wait until the previous bucket's second round is launched, before this bucket launches anything."""
    out, state._second_round_out = state._second_round_out, None
    if out is not None:
        out.wait()


def _report_compression_stats(bucket: dist.GradBucket, state: PowerSGDState) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info(
            "PowerSGD compression stats at iteration %s: %s elements before, %s after, rate %s",
            state.iter,
            before,
            after,
            rate,
        )
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _run_hook(
    state: Any,
    bucket: dist.GradBucket,
    hook_name: str,
    compress: Callable[[PowerSGDState, dist.GradBucket, dist.ProcessGroup, Optional[HookRecorder]], torch.futures.Future[torch.Tensor]],
) -> torch.futures.Future[torch.Tensor]:
    """One hook call: plain averaging before ``start_powerSGD_iter``, ``compress`` after it."""
    recorder = current_recorder()
    group, compressing = _begin(state, bucket, hook_name)
    if compressing:
        future = compress(state, bucket, group, recorder)
    else:
        future = _allreduce_fut(group, bucket.buffer())
    state.maybe_increase_iter(bucket)
    return future


def _begin(state: Any, bucket: dist.GradBucket, hook_name: str) -> tuple[dist.ProcessGroup, bool]:
    """Validate the call and wait for pending work; return the group and whether to compress."""
    group = _check_state(state, hook_name)
    check_floating_bucket(bucket.buffer(), hook_name)
    _await_second_round(state)
    return group, state.iter >= state.start_powerSGD_iter


# -- layer-wise PowerSGD --


@dataclass
class _LayerPlan:
    """How one bucket's compressible gradients are batched, and their low-rank factors."""

    batches: list[torch.Tensor]
    """Matrices to compress, each a batch ``(count, rows, cols)``."""
    stacked: list[tuple[torch.Tensor, list[torch.Tensor]]]
    """Batches that are copies (stacks) and the gradients to copy their result back into."""
    ps: list[torch.Tensor] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)


def _split_layers(state: PowerSGDState, gradients: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split gradients into matrices worth compressing and tensors allreduced as they are."""
    to_compress, uncompressed = [], []
    for gradient in gradients:
        matrix = gradient.view(gradient.shape[0], -1) if gradient.dim() else gradient.view(1, 1)
        rows, cols = matrix.shape
        rank = min(rows, cols, state.matrix_approximation_rank)
        state.total_numel_before_compression += rows * cols
        compressed_numel = (rows + cols) * rank
        if compressed_numel * state.min_compression_rate < rows * cols:
            to_compress.append(matrix)
            state.total_numel_after_compression += compressed_numel
        else:
            uncompressed.append(gradient)
            state.total_numel_after_compression += rows * cols
    return to_compress, uncompressed


def _batch_by_shape(state: PowerSGDState, matrices: list[torch.Tensor]) -> _LayerPlan:
    """Group matrices by shape (first appearance first), stacking each group if so configured."""
    by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
    for matrix in matrices:
        by_shape[matrix.shape].append(matrix)
    plan = _LayerPlan(batches=[], stacked=[])
    for group in by_shape.values():
        if state.batch_tensors_with_same_shape and len(group) > 1:
            batch = torch.stack(group)
            plan.batches.append(batch)
            plan.stacked.append((batch, group))
        else:
            plan.batches.extend(matrix.unsqueeze(0) for matrix in group)
    return plan


def _low_rank_memory(
    state: PowerSGDState, bucket_index: int, like: torch.Tensor, p_numel: int, q_numel: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Return the flat P and Q memory of the bucket and whether Q must start random.

    With warm start the memory (and Q's values) carry over from the previous iteration.
    """
    if state.warm_start and bucket_index in state.p_memory_dict:
        return state.p_memory_dict[bucket_index], state.q_memory_dict[bucket_index], False
    p_memory = torch.empty(p_numel, device=like.device, dtype=like.dtype)
    q_memory = torch.empty(q_numel, device=like.device, dtype=like.dtype)
    if state.warm_start:
        logger.info("PowerSGD: %s elements for Ps and %s for Qs of bucket %s", p_numel, q_numel, bucket_index)
        state.p_memory_dict[bucket_index] = p_memory
        state.q_memory_dict[bucket_index] = q_memory
    return p_memory, q_memory, True


def _low_rank_shapes(plan: _LayerPlan, rank_limit: int) -> tuple[list[torch.Size], list[torch.Size]]:
    """Return the shapes of every batch's P ``(count, rows, r)`` and Q ``(count, cols, r)``."""
    p_shapes, q_shapes = [], []
    for batch in plan.batches:
        count, rows, cols = batch.shape
        rank = min(rows, cols, rank_limit)
        p_shapes.append(torch.Size((count, rows, rank)))
        q_shapes.append(torch.Size((count, cols, rank)))
    return p_shapes, q_shapes


def _carve(memory: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Return views of consecutive pieces of the flat ``memory`` with the given shapes."""
    views, offset = [], 0
    for shape in shapes:
        views.append(memory[offset : offset + shape.numel()].view(shape))
        offset += shape.numel()
    return views


def _prepare_qs(state: PowerSGDState, qs: list[torch.Tensor], fresh: bool, dtype: torch.dtype) -> None:
    """Orthogonalize the Qs, filling them with random values first unless warm-started."""
    if fresh:
        for q, values in zip(qs, _random_normal(state, [tuple(q.shape) for q in qs], dtype)):
            q.copy_(values)
    for q in qs:
        _orthogonalize(q, state.orthogonalization_epsilon)


def _unpack_average(reduced: torch.Tensor, world_size: int, tensors: list[torch.Tensor]) -> None:
    """Average the allreduced concatenation and copy it back into the tensors it came from."""
    reduced.div_(world_size)
    offset = 0
    for tensor in tensors:
        tensor.copy_(reduced[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def _compress_layers(
    state: PowerSGDState, bucket: dist.GradBucket, group: dist.ProcessGroup, recorder: Optional[HookRecorder]
) -> torch.futures.Future[torch.Tensor]:
    world_size = group.size()
    tensor = bucket.buffer()
    bucket_index = bucket.index()
    original = _incorporate_error(state, bucket_index, tensor, recorder)
    errors = state.error_dict if state.use_error_feedback else None

    to_compress, uncompressed = _split_layers(state, bucket.gradients())
    _report_compression_stats(bucket, state)
    plan = _batch_by_shape(state, to_compress)
    p_shapes, q_shapes = _low_rank_shapes(plan, state.matrix_approximation_rank)
    p_memory, q_memory, fresh = _low_rank_memory(
        state, bucket_index, tensor, sum(s.numel() for s in p_shapes), sum(s.numel() for s in q_shapes)
    )
    plan.ps, plan.qs = _carve(p_memory, p_shapes), _carve(q_memory, q_shapes)
    _prepare_qs(state, plan.qs, fresh, tensor.dtype)
    for batch, q, p in zip(plan.batches, plan.qs, plan.ps):
        torch.bmm(batch, q, out=p)

    first_round = []
    memory = None
    if uncompressed:
        # Averaged and copied back when decompressing: until then the bucket holds this rank's input.
        memory = torch.cat([t.view(-1) for t in uncompressed])
        first_round.append(allreduce_future(memory, group, recorder, watch_nonfinite=True))
    if plan.ps:
        # Ps are orthogonalized next: no need to average them.
        first_round.append(allreduce_future(p_memory, group, recorder, watch_nonfinite=True))

    def decompress() -> torch.Tensor:
        if recorder is not None and original is None:
            recorder.compression_input(_KIND, tensor)  # no copy of it: its last moment
        if memory is not None:
            _unpack_average(memory, world_size, uncompressed)
        q_memory.div_(world_size)
        for p, q, batch in zip(plan.ps, plan.qs, plan.batches):
            torch.bmm(p, q.transpose(1, 2), out=batch)
        for batch, gradients in plan.stacked:
            for i, gradient in enumerate(gradients):
                gradient.copy_(batch[i])
        _finish(errors, bucket_index, tensor, original, recorder)
        return tensor

    def second_round() -> torch.futures.Future[torch.Tensor]:
        for p in plan.ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for batch, p, q in zip(plan.batches, plan.ps, plan.qs):
            torch.bmm(batch.transpose(1, 2), p, out=q)
        return _then(allreduce_future(q_memory, group, recorder, watch_nonfinite=True) if plan.qs else None, decompress)

    return _schedule(state, bucket, first_round, second_round, tensor.device)


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""
    Compress the bucket's gradients layer by layer with PowerSGD, then average them.

    Gradients whose matrix (first dimension by the rest) is worth compressing under
    ``state.min_compression_rate`` are approximated by rank-``r`` factors found by one step of
    power iteration: with Q orthogonal (random at first, the previous one with warm start),
    P = MQ is allreduced and orthogonalized, Q = MᵀP is allreduced and averaged, and M becomes
    PQᵀ. The other gradients (biases among them) are averaged as they are, in one allreduce.
    With error feedback, what the approximation left out on this rank is added to the next step.
    The first ``state.start_powerSGD_iter`` iterations are plain averaging allreduces.

    Results equal torch's ``powerSGD_hook`` bit for bit. Unlike torch's, the hook issues its
    collectives in the same order on every rank, so any number of buckets works on gloo; like
    torch's, its future completes on its own (a wrapper may wait for it inside the hook).

    Arguments:
        state (PowerSGDState): hyperparameters and per-bucket memory; one state per model.
        bucket (dist.GradBucket): the flattened gradients of several parameters.

    Returns:
        A future of the bucket's averaged, decompressed gradients, written in place.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1,
        ...                       start_powerSGD_iter=10, min_compression_rate=0.5)
        >>> ddp_model.register_comm_hook(state, powerSGD_hook)
    """
    return _run_hook(state, bucket, "powerSGD_hook", _compress_layers)


# -- batched PowerSGD: the whole bucket as one square matrix --


def _square_low_rank_memory(
    state: PowerSGDState, bucket_index: int, like: torch.Tensor, side: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Return P and Q (``side x rank``) of the bucket and whether Q was just drawn at random."""
    if state.warm_start and bucket_index in state.p_memory_dict:
        return state.p_memory_dict[bucket_index], state.q_memory_dict[bucket_index], False
    p = torch.empty(side, rank, device=like.device, dtype=like.dtype)
    (q_values,) = _random_normal(state, [(side, rank)], like.dtype)
    q = q_values.to(like.device)
    if state.warm_start:
        logger.info("PowerSGD: P and Q of %s x %s for bucket %s", side, rank, bucket_index)
        state.p_memory_dict[bucket_index] = p
        state.q_memory_dict[bucket_index] = q
    return p, q, True


def _padded_square(tensor: torch.Tensor, side: int) -> torch.Tensor:
    """Return ``tensor`` zero-padded to ``side * side`` elements (itself if it already has them).

    A copy rather than resizing the bucket in place, so DDP's bucket keeps its own storage.
    """
    if tensor.numel() == side * side:
        return tensor
    padded = torch.zeros(side * side, device=tensor.device, dtype=tensor.dtype)
    padded[: tensor.numel()].copy_(tensor)
    return padded


def _compress_square(
    state: PowerSGDState, bucket: dist.GradBucket, group: dist.ProcessGroup, recorder: Optional[HookRecorder]
) -> torch.futures.Future[torch.Tensor]:
    world_size = group.size()
    tensor = bucket.buffer()
    bucket_index = bucket.index()
    length = tensor.numel()
    side = math.ceil(math.sqrt(length))
    rank = min(side, state.matrix_approximation_rank)
    state.total_numel_before_compression += length
    state.total_numel_after_compression += side * rank * 2
    square = _padded_square(tensor, side)
    _report_compression_stats(bucket, state)
    original = _incorporate_error(state, bucket_index, square, recorder)
    errors = state.error_dict if state.use_error_feedback else None

    matrix = square.view(side, side)
    p, q, _ = _square_low_rank_memory(state, bucket_index, square, side, rank)
    _orthogonalize(q.unsqueeze(0), state.orthogonalization_epsilon)
    torch.matmul(matrix, q, out=p)
    first_round = [allreduce_future(p, group, recorder, watch_nonfinite=True)]

    def decompress() -> torch.Tensor:
        if recorder is not None and original is None:
            recorder.compression_input(_KIND, square)  # no copy of it: its last moment
        q.div_(world_size)
        torch.matmul(p, q.t(), out=matrix)
        _finish(errors, bucket_index, square, original, recorder)
        if square is not tensor:
            tensor.copy_(square[:length])
        return tensor

    def second_round() -> torch.futures.Future[torch.Tensor]:
        _orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
        torch.matmul(matrix.t(), p, out=q)
        return _then(allreduce_future(q, group, recorder, watch_nonfinite=True), decompress)

    return _schedule(state, bucket, first_round, second_round, tensor.device)


def batched_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""
    Compress the whole bucket as one zero-padded square matrix with PowerSGD, then average it.

    Faster than :func:`powerSGD_hook` (one P and one Q per bucket) but usually much less
    accurate unless ``matrix_approximation_rank`` is 1: flattening many gradients into one square
    destroys most of their low-rank structure, so try :func:`powerSGD_hook` first. The rank is
    capped at the side of the square. The first ``state.start_powerSGD_iter`` iterations are
    plain averaging allreduces; ``min_compression_rate`` and ``batch_tensors_with_same_shape``
    do not apply.

    Results equal torch's algorithm bit for bit, where torch's runs. Unlike torch's hook this one
    works from its first compressing step, honours ``orthogonalization_epsilon`` and issues its
    collectives in the same order on every rank (see :func:`powerSGD_hook`).

    Arguments:
        state (PowerSGDState): hyperparameters and per-bucket memory; one state per model.
        bucket (dist.GradBucket): the flattened gradients of several parameters.

    Returns:
        A future of the bucket's averaged, decompressed gradients, written in place.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1)
        >>> ddp_model.register_comm_hook(state, batched_powerSGD_hook)
    """
    return _run_hook(state, bucket, "batched_powerSGD_hook", _compress_square)


describe_hook(powerSGD_hook, "powerSGD_hook")
describe_hook(batched_powerSGD_hook, "batched_powerSGD_hook")
