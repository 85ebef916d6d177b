"""DDP communication hooks, each also available traced: ``traced(bf16_compress_hook)``.

``DDPCommHookType`` and ``register_ddp_comm_hook`` mirror torch's registry for every hook
tensorplay ships.
"""

import sys
from enum import Enum
from functools import partial
from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from . import debugging_hooks as debugging
from . import default_hooks as default
from . import powerSGD_hook as powerSGD

if sys.version_info >= (3, 11):
    from enum import member as _enum_member
else:  # before 3.11 a partial in an Enum body is a member already

    def _enum_member(value: Any) -> Any:
        return value


__all__ = ["DDPCommHookType", "register_ddp_comm_hook", "traced"]


def __getattr__(name: str) -> Any:
    """Resolve ``traced`` (the public contract names it here) from the telemetry on first use.

    The hooks themselves report through :mod:`tensorplay.telemetry.probe` only: importing them
    loads neither the OpenTelemetry SDK nor prometheus_client.
    """
    if name == "traced":
        from tensorplay.telemetry import traced

        return traced
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register(comm_hook: Callable, model: nn.Module, state: Any) -> None:
    model.register_comm_hook(state, comm_hook)


def _register_powerSGD(
    comm_hook: Callable,
    model: nn.Module,
    state: Any,
    matrix_approximation_rank: int,
    start_powerSGD_iter: int = 1_000,
) -> None:
    """Register a PowerSGD hook; ``state`` is the process group, as for the other hooks."""
    powerSGD_state = powerSGD.PowerSGDState(
        process_group=state,
        matrix_approximation_rank=matrix_approximation_rank,
        start_powerSGD_iter=start_powerSGD_iter,
    )
    model.register_comm_hook(powerSGD_state, comm_hook)


class DDPCommHookType(Enum):
    """
    Enumerate tensorplay's communication hooks as ready-to-register partials.

    Example::
        >>> # xdoctest: +SKIP
        >>> DDPCommHookType.FP16_COMPRESS.value(model=ddp_model, state=process_group)
    """

    ALLREDUCE = _enum_member(partial(_register, comm_hook=default.allreduce_hook))
    FP16_COMPRESS = _enum_member(partial(_register, comm_hook=default.fp16_compress_hook))
    BF16_COMPRESS = _enum_member(partial(_register, comm_hook=default.bf16_compress_hook))
    POWER_SGD = _enum_member(
        partial(_register_powerSGD, comm_hook=powerSGD.powerSGD_hook, matrix_approximation_rank=1)
    )
    POWER_SGD_RANK2 = _enum_member(
        partial(_register_powerSGD, comm_hook=powerSGD.powerSGD_hook, matrix_approximation_rank=2)
    )
    BATCHED_POWER_SGD = _enum_member(
        partial(_register_powerSGD, comm_hook=powerSGD.batched_powerSGD_hook, matrix_approximation_rank=1)
    )
    BATCHED_POWER_SGD_RANK2 = _enum_member(
        partial(_register_powerSGD, comm_hook=powerSGD.batched_powerSGD_hook, matrix_approximation_rank=2)
    )
    NOOP = _enum_member(partial(_register, comm_hook=debugging.noop_hook))


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model: nn.Module, state: Any = None) -> None:
    """
    Register the hook named by ``comm_hook_type`` on the DDP ``model`` with ``state``.

    Example::
        >>> # xdoctest: +SKIP
        >>> register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, ddp_model, process_group)
    """
    if not isinstance(comm_hook_type, DDPCommHookType):
        raise TypeError(
            f"register_ddp_comm_hook: comm_hook_type must be a DDPCommHookType, got {type(comm_hook_type).__name__}"
        )
    comm_hook_type.value(model=model, state=state)
