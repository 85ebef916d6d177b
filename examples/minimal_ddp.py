"""Train a small model with DDP on two local gloo ranks using tensorplay's fp16 compression hook."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook


def run(rank: int, world_size: int) -> None:
    """Train for a few steps on rank ``rank`` and print the loss."""
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)))
    model.register_comm_hook(None, fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for step in range(20):
        inputs = torch.randn(32, 64, generator=generator)
        loss = (model(inputs) - inputs.sum(dim=1, keepdim=True)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(run, args=(2,), nprocs=2)
