"""What every tensorplay hook shares: validating its inputs and launching reported collectives."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist

from tensorplay.telemetry.probe import HookRecorder

__all__: list[str] = []


def resolve_process_group(state: Any, hook_name: str) -> dist.ProcessGroup:
    """Return the process group a default hook's ``state`` names (``None`` means WORLD)."""
    if state is None:
        return dist.group.WORLD
    if isinstance(state, dist.ProcessGroup):
        return state
    raise TypeError(
        f"{hook_name}: state must be a torch.distributed.ProcessGroup or None "
        f"(the process group to reduce over), got {type(state).__name__}"
    )


def check_floating_bucket(tensor: torch.Tensor, hook_name: str) -> None:
    """Raise ValueError when a bucket holds a dtype that cannot be averaged or compressed."""
    if not tensor.is_floating_point():
        raise ValueError(
            f"{hook_name}: cannot handle a bucket of dtype {tensor.dtype}; "
            "gradient buckets must hold floating-point values"
        )


def check_hook(hook: Any, wrapper_name: str) -> None:
    """Raise TypeError unless ``hook`` can be called as ``hook(state, bucket)``."""
    if not callable(hook):
        raise TypeError(
            f"{wrapper_name}: expected a communication hook hook(state, bucket), "
            f"got {type(hook).__name__}"
        )
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin without an introspectable signature: trust the caller
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"{wrapper_name}: {getattr(hook, '__name__', hook)!r} is not a communication hook: "
            f"it must accept (state, bucket), its signature is {signature}"
        ) from None


def allreduce_future(
    tensor: torch.Tensor, group: dist.ProcessGroup, recorder: HookRecorder | None, watch_nonfinite: bool = False
) -> torch.futures.Future[list[torch.Tensor]]:
    """Launch an async sum-allreduce of ``tensor`` in place and report it to ``recorder``.

    With a recorder, the future returned is the one the recorder hands back: chain on it.
    ``watch_nonfinite``: see :meth:`HookRecorder.collective_launching`.
    """
    if recorder is None:
        return dist.all_reduce(tensor, group=group, async_op=True).get_future()
    token = recorder.collective_launching(tensor, watch_nonfinite=watch_nonfinite)
    try:
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    except BaseException as error:
        recorder.collective_not_launched(token, error)
        raise
    return recorder.collective_launched(token, future)


def first_value(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    """Unwrap the single tensor of an allreduce future."""
    return future.value()[0]


HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
