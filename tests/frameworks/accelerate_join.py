"""An Accelerate script with uneven inputs: tensorplay's traced hook and Join on the prepared model.

``accelerate launch --multi_gpu --num_processes 2 accelerate_join.py OUT_DIR`` (README's command;
on CPU as well: ``--cpu`` starts one process), gloo. On one process ``accelerator.prepare`` leaves
the model unwrapped, and the script says so instead of failing on ``register_comm_hook``. Rank r trains on
``3 + 2 r`` batches of its own, 2 per optimizer step (``gradient_accumulation_steps``: the first
inside ``no_sync()``), inside ``tensorplay``'s ``Join`` (Accelerate's
``join_uneven_inputs`` does nothing on CPU). Metrics come on through ``TENSORPLAY_METRICS_PORT``
(the torchrun way); each rank writes ``OUT_DIR/metrics-rank{r}.txt`` (its own ``/metrics``,
scraped over HTTP once training ended) and ``OUT_DIR/rank{r}.pt`` (final parameters).
"""

import os
import sys
import urllib.request
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from tensorplay.distributed.algorithms.join import Join
from tensorplay.telemetry import flush

BASE_BATCHES, EXTRA_BATCHES_PER_RANK = 3, 2
ACCUMULATE = 2  # batches per optimizer step, the first inside no_sync() (accelerator.accumulate)


def main() -> None:
    out_dir = sys.argv[1]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    set_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    if not isinstance(model, DDP):  # one process: prepare leaves the model as it is
        raise SystemExit(f"DDP needs 2 or more processes, this is {accelerator.num_processes}: "
                         f"accelerate launch --multi_gpu --num_processes 2 {sys.argv[0]}")
    model.register_comm_hook(None, traced(bf16_compress_hook))

    rank = accelerator.process_index
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator))
               for _ in range(BASE_BATCHES + EXTRA_BATCHES_PER_RANK * rank)]
    with Join([model]):
        for inputs, targets in batches:
            with accelerator.accumulate(model):  # steps (and zeroes) only every ACCUMULATE batches
                accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
                optimizer.step()
                optimizer.zero_grad()

    flush(30)
    torch.save([p.detach().clone() for p in model.parameters()], f"{out_dir}/rank{rank}.pt")
    port = int(os.environ["TENSORPLAY_METRICS_PORT"]) + int(os.environ["LOCAL_RANK"])
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    Path(f"{out_dir}/metrics-rank{rank}.txt").write_text(body)
    accelerator.end_training()


if __name__ == "__main__":
    main()
