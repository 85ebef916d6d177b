"""What telling the DDP models of a traced hook apart costs per bucket.

Runs as one gloo rank. Inside a real DDP hook, on a real ``GradBucket`` of 200 parameters, it
times :meth:`ModelsOfHook.enter` (the per-bucket look-up of ``traced``) against ``bucket.is_last()``
(the cheapest call a hook makes, as a yardstick) in interleaved rounds, after the look-up has
placed the bucket once, and prints the medians and quartiles of the rounds.

    python bench/model_lookup.py [--rounds 15] [--calls 5000]
"""

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay.telemetry.model_identity import ModelsOfHook


def _per_call_us(call: Any, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(100)]), bucket_cap_mb=25)
    models = ModelsOfHook()
    rounds: list[tuple[float, float]] = []

    def timing_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        models.enter(bucket)  # places the bucket: what every later call finds
        for _ in range(args.rounds):
            rounds.append((_per_call_us(lambda: models.enter(bucket), args.calls), _per_call_us(bucket.is_last, args.calls)))
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model.register_comm_hook(None, timing_hook)
    model(torch.randn(2, 64)).sum().backward()
    dist.destroy_process_group()
    for name, values in (("ModelsOfHook.enter", [r[0] for r in rounds]), ("bucket.is_last", [r[1] for r in rounds])):
        q1, median, q3 = statistics.quantiles(values, n=4)
        print(f"{name:16} {median:.3f} us per call (IQR {q1:.3f}-{q3:.3f}, {len(values)} rounds x {args.calls})")


if __name__ == "__main__":
    main()
