"""Hooks for headroom analysis: what training costs without gradient communication."""

from typing import Any

import torch
from torch.distributed import GradBucket

from tensorplay.telemetry.probe import describe_hook

__all__ = ["noop_hook"]


def noop_hook(_: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """
    Return a future that already holds the bucket, skipping all communication.

    Use it only for headroom analysis: if training gets barely faster with this hook, gradient
    communication is not the bottleneck. Gradients are not synchronized across ranks.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(None, noop_hook)
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


describe_hook(noop_hook, "noop_hook")
