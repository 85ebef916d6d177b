"""The default DDP communication hooks: plain allreduce and fp16/bf16 compression.

Same semantics and arithmetic as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``,
so swapping the import changes no gradient bit. Each hook also reports its compression and
collectives to the telemetry probe, which costs one branch when nobody traces the call.
"""

from typing import Any, Callable, cast

import torch
import torch.distributed as dist

from tensorplay.telemetry.probe import current_recorder, describe_hook, hook_name, reports_collectives

from ._common import (
    allreduce_future,
    check_floating_bucket,
    check_hook,
    first_value,
    resolve_process_group,
)

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
]

_COMPRESSION_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _allreduce_fut(
    process_group: dist.ProcessGroup, tensor: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` over ``process_group`` in place; the future holds the result."""
    group = resolve_process_group(process_group, "allreduce_hook")
    check_floating_bucket(tensor, "allreduce_hook")
    tensor.div_(group.size())
    return allreduce_future(tensor, group, current_recorder()).then(first_value)


def allreduce_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """
    Average the bucket's gradients across workers with one ``allreduce``.

    Registering this hook leaves DDP's behaviour unchanged: results equal DDP without a hook.
    Use it as a reference, or wrap it to log what passes through.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(process_group, allreduce_hook)
    """
    return _allreduce_fut(process_group, bucket.buffer())


def _compress_hook(
    dtype: torch.dtype,
    name: str,
    process_group: dist.ProcessGroup,
    bucket: dist.GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    group = resolve_process_group(process_group, name)
    world_size = group.size()
    buffer = (
        cast(tuple[torch.Tensor, ...], bucket)[0]
        if isinstance(bucket, tuple)
        else bucket.buffer()
    )
    check_floating_bucket(buffer, name)
    # Divide after the cast, as torch does, so the arithmetic is identical.
    compressed = buffer.to(dtype).div_(world_size)
    compiling = torch.compiler.is_compiling()
    recorder = current_recorder()
    if recorder is not None:
        # ``buffer`` stays as it is until ``decompress``, chained after the reported allreduce.
        recorder.compression(
            _COMPRESSION_NAMES[dtype], buffer, compressed, scale=world_size, recomputable=not compiling
        )

    def decompress(fut: Any) -> torch.Tensor:
        # Decompress into the bucket's own buffer to keep peak memory down.
        value = fut if isinstance(fut, torch.Tensor) else fut.value()[0]
        buffer.copy_(value)
        return buffer

    if compiling:
        reduced = dist._functional_collectives.all_reduce(compressed, "sum", group)
        return decompress(reduced)
    return allreduce_future(compressed, group, recorder).then(decompress)


def fp16_compress_hook(
    process_group: dist.ProcessGroup,
    bucket: dist.GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """
    Compress by casting the bucket to ``torch.float16`` divided by the process group size.

    The float16 tensors are allreduced, then cast back into the bucket's own dtype
    (such as ``float32``). Dividing before the allreduce keeps the sum from overflowing.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(process_group, fp16_compress_hook)
    """
    return _compress_hook(torch.float16, "fp16_compress_hook", process_group, bucket)


def bf16_compress_hook(
    process_group: dist.ProcessGroup,
    bucket: dist.GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """
    Compress by casting the bucket to ``torch.bfloat16`` divided by the process group size.

    The bfloat16 tensors are allreduced, then cast back into the bucket's own dtype.
    torch's DDP refuses a hook of this ``__name__`` on builds without CUDA/NCCL, although gloo
    reduces bfloat16 correctly; ``traced(bf16_compress_hook)`` is accepted everywhere.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(process_group, bf16_compress_hook)
    """
    return _compress_hook(torch.bfloat16, "bf16_compress_hook", process_group, bucket)


def _compress_wrapper(
    dtype: torch.dtype,
    wrapper_name: str,
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]],
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    check_hook(hook, wrapper_name)
    compression_name = _COMPRESSION_NAMES[dtype]

    def compress_wrapper_hook(
        hook_state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        compressed = original.to(dtype)
        recorder = current_recorder()
        if recorder is not None:
            # DDP's own buffer: the wrapped hook works on ``compressed``, DDP reads the result later.
            recorder.compression(compression_name, original, compressed, recomputable=True)
        bucket.set_buffer(compressed)

        fut = hook(hook_state, bucket)

        def decompress(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            decompressed = bucket.buffer()
            decompressed.copy_(fut.value())
            return decompressed

        return fut.then(decompress)

    # torch's name, which DDP logs and checks; the display name composes.
    compress_wrapper_hook.__name__ = compress_wrapper_hook.__qualname__ = f"{wrapper_name}_hook"
    return describe_hook(
        compress_wrapper_hook,
        f"{wrapper_name}({hook_name(hook)})",
        reports_collectives=reports_collectives(hook),
    )


def fp16_compress_wrapper(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]],
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """
    Cast the bucket to ``torch.float16`` for ``hook``, and its result back to the input dtype.

    ``fp16_compress_hook`` is therefore equivalent to ``fp16_compress_wrapper(allreduce_hook)``.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = PowerSGDState(process_group=process_group, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, fp16_compress_wrapper(powerSGD_hook))
    """
    return _compress_wrapper(torch.float16, "fp16_compress_wrapper", hook)


def bf16_compress_wrapper(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]],
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """
    Cast the bucket to ``torch.bfloat16`` for ``hook``, and its result back to the input dtype.

    ``bf16_compress_hook`` is therefore equivalent to ``bf16_compress_wrapper(allreduce_hook)``.
    The returned hook is named ``bf16_compress_wrapper_hook`` as torch's is, a name torch's DDP
    refuses without CUDA/NCCL; register ``traced(...)`` of it on gloo/CPU.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = PowerSGDState(process_group=process_group, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, bf16_compress_wrapper(powerSGD_hook))
    """
    return _compress_wrapper(torch.bfloat16, "bf16_compress_wrapper", hook)


for _hook in (allreduce_hook, fp16_compress_hook, bf16_compress_hook):
    describe_hook(_hook, _hook.__name__)
del _hook
