"""The communication hooks ``tensorplay demo`` can run, by name, each registered as ``traced(...)``."""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tensorplay import traced
from tensorplay.telemetry.probe import describe_hook, hook_name, reports_collectives
from tensorplay.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks

__all__ = ["HOOK_NAMES", "DEFAULT_HOOK", "traced_hook"]

Hook = Callable[..., Any]


def _powersgd(batched: bool) -> tuple[Hook, Any]:
    from tensorplay.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    # Rank 1 compresses every layer of the demo model; error feedback starts after DDP's
    # bucket rebuild (torch requires start_powerSGD_iter > 1 with error feedback).
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    return (powersgd.batched_powerSGD_hook if batched else powersgd.powerSGD_hook), state


# name -> (hook, state) builder; PowerSGD's state is per model, so every call builds a new one.
_HOOKS: dict[str, Callable[[], tuple[Hook, Any]]] = {
    "allreduce_hook": lambda: (default_hooks.allreduce_hook, None),
    "fp16_compress_hook": lambda: (default_hooks.fp16_compress_hook, None),
    "bf16_compress_hook": lambda: (default_hooks.bf16_compress_hook, None),
    "fp16_compress_wrapper(allreduce_hook)": lambda: (
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook), None),
    "bf16_compress_wrapper(allreduce_hook)": lambda: (
        default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook), None),
    "powerSGD_hook": lambda: _powersgd(batched=False),
    "batched_powerSGD_hook": lambda: _powersgd(batched=True),
    "noop_hook": lambda: (debugging_hooks.noop_hook, None),
}

HOOK_NAMES: tuple[str, ...] = tuple(_HOOKS)
DEFAULT_HOOK = "fp16_compress_hook"


def traced_hook(name: str, blocked_at: Optional[tuple[int, Any]] = None,
                advise_every: Optional[int] = None) -> tuple[Hook, Any]:
    """Return ``(traced(hook, advise_every=advise_every), state)`` for the hook called ``name``, ready
    for ``register_comm_hook`` (``advise_every`` None: the library's default).

    ``blocked_at=(step, group)`` injects a hang inside a collective (``--hang-inside-collective``):
    at that step the first bucket is reduced over ``group``, which the peers never join, and the
    hook waits for it, as a rank stuck in a mismatched collective does.
    """
    hook, state = _HOOKS[name]()
    if blocked_at is not None:
        hook = _blocked_in_collective(hook, *blocked_at)
    return traced(hook, advise_every=advise_every), state


def _blocked_in_collective(hook: Hook, step: int, group: Any) -> Hook:
    calls = [0]

    def blocking(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        current = calls[0]
        if bucket.is_last():
            calls[0] += 1
        if current == step:
            future = hook(group, bucket)
            future.wait()  # never returns: the group's other member never launches this collective
            return future
        return hook(state, bucket)

    return describe_hook(blocking, hook_name(hook), reports_collectives(hook))
