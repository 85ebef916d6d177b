"""A small real DDP training loop shared by the tests: same model, per-rank data, SGD steps."""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

LAYERS = 6
WIDTH = 256
BUCKET_CAP_MB = 0.3  # DDP's first bucket holds 1 MB; these layers make 3 or more buckets


def make_model(seed: int = 0) -> nn.Module:
    """Build the test model, identical on every rank for a given seed."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def rank_batch(rank: int, step: int, batch: int = 8) -> torch.Tensor:
    """Return rank ``rank``'s input for ``step``: different on every rank and every step."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(batch, WIDTH, generator=generator) * (1 + rank)


def passthrough(hook: Callable) -> Callable:
    """Wrap ``hook`` under another name: torch's DDP refuses bf16 hook names on CPU builds."""

    def forward_to_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)

    return forward_to_hook


def train(
    rank: int,
    hook: Optional[Callable],
    state: Any = None,
    steps: int = 4,
    seed: int = 0,
    lr: float = 0.1,
    loss_scale: float = 1.0,
) -> list[torch.Tensor]:
    """Train the test model with ``hook`` registered and return the final parameters."""
    model = DDP(make_model(seed), bucket_cap_mb=BUCKET_CAP_MB)
    if hook is not None:
        model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        (model(rank_batch(rank, step)).square().mean() * loss_scale).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def count_buckets(rank: int) -> int:
    """Return how many buckets DDP makes of the test model after its bucket rebuild."""
    seen: set[int] = set()

    def record(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.add(bucket.index())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    train(rank, record, steps=3)
    return len(seen)
