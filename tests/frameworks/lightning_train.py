"""A seeded Lightning script on 2 CPU processes: torch's bf16 hook, then tensorplay's, through TracedCommHook.

Every fit accumulates gradients over 2 batches per optimizer step (``accumulate_grad_batches``):
Lightning runs the first batch's forward and backward inside DDP's ``no_sync()``.

``python lightning_train.py OUT_DIR`` uses Lightning's default launcher, which starts rank 1 by
running this script again, and fits three times in the same processes: with torch's own
``bf16_compress_hook`` (the reference), with ``TracedCommHook(bf16_compress_hook)``, and with
torch's ``powerSGD_hook`` (the reference for the spawn run).
``python lightning_train.py OUT_DIR --spawn`` fits once with ``DDPStrategy(start_method="spawn")``:
the Trainer and its callbacks are pickled to the workers, here
``TracedCommHook(powerSGD_hook, make_state=...)``, whose state is made in each worker.
Before that, in the main process, it writes how TracedCommHook refuses what it cannot serve to
``OUT_DIR/refusals.json``.

Metrics come on through ``TENSORPLAY_METRICS_PORT`` (set by the caller, as under torchrun); each
rank sets up tracing to ``OUT_DIR/spans-rank{r}.jsonl`` in ``LightningModule.setup``, and writes
``OUT_DIR/rank{r}-{run}.pt`` (final parameters) and ``OUT_DIR/metrics-rank{r}.txt`` (its own
``/metrics``, scraped over HTTP once training ended).
"""

import functools
import json
import os
import sys
import types
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.utils.data import DataLoader, TensorDataset

from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from tensorplay.integrations.lightning import TracedCommHook
from tensorplay.telemetry import configure_tracing, flush

STEPS = 4
ACCUMULATE = 2  # batches per optimizer step: Lightning runs the first inside DDP's no_sync()
POWERSGD = {"process_group": None, "matrix_approximation_rank": 1, "start_powerSGD_iter": 2}  # compresses steps 2 and 3


def torch_bf16(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook under another name: DDP refuses that name on CPU builds."""
    return torch_hooks.bf16_compress_hook(state, bucket)


class TorchHook(pl.Callback):
    """The reference: torch's hook registered on the DDP model, as TracedCommHook does with its own."""

    def __init__(self, hook: Any, make_state: Any = lambda: None) -> None:
        self.hook, self.make_state = hook, make_state

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(self.make_state(), self.hook)


class Regression(pl.LightningModule):
    def __init__(self, out_dir: str, run: str) -> None:
        super().__init__()
        self.out_dir, self.run = out_dir, run
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))

    def setup(self, stage: str) -> None:
        configure_tracing(span_file=f"{self.out_dir}/spans-rank{self.global_rank}.jsonl", otlp=False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_fit_end(self) -> None:
        torch.save([p.detach().clone() for p in self.parameters()], f"{self.out_dir}/rank{self.global_rank}-{self.run}.pt")
        if self.run.startswith("traced"):
            flush(30)
            port = int(os.environ["TENSORPLAY_METRICS_PORT"]) + int(os.environ["LOCAL_RANK"])
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
            Path(f"{self.out_dir}/metrics-rank{self.global_rank}.txt").write_text(body)


def fit(out_dir: str, run: str, callback: pl.Callback, strategy: DDPStrategy) -> None:
    pl.seed_everything(0, verbose=False)  # seeds random, numpy and torch on every rank alike
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 4, generator=generator))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[callback],
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(Regression(out_dir, run), DataLoader(data, batch_size=8))


def _refusal(call: Any) -> str:
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def check_refusals(out_dir: str) -> None:
    """A Trainer without DDP (refused to fit, free to validate, test, predict), a model that is not DDP,
    a strategy with a hook of its own, a bad option."""
    single = pl.Trainer(accelerator="cpu", devices=1, callbacks=[TracedCommHook(bf16_compress_hook)], max_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)
    data = DataLoader(TensorDataset(torch.zeros(8, 16), torch.zeros(8, 4)), batch_size=8)
    not_ddp = types.SimpleNamespace(strategy=types.SimpleNamespace(model=nn.Linear(1, 1)))
    both = types.SimpleNamespace(strategy=DDPStrategy(ddp_comm_hook=torch_bf16, ddp_comm_wrapper=torch_hooks.bf16_compress_wrapper))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TracedCommHook(bf16_compress_hook).setup(both, None, "fit")  # type: ignore[arg-type]
    refusals = {
        "single device": _refusal(lambda: single.fit(Regression(out_dir, "refused"), data)),
        # No backward pass, no hook: the callback stands aside wherever the strategy is not DDP.
        "single device, not fitting": [
            _refusal(lambda: single.validate(Regression(out_dir, "validated"), data, verbose=False)),
            _refusal(lambda: single.test(Regression(out_dir, "tested"), data, verbose=False)),
            _refusal(lambda: single.predict(Regression(out_dir, "predicted"), data)),
        ],
        "not a DDP model": _refusal(lambda: TracedCommHook(bf16_compress_hook).on_fit_start(not_ddp, None)),
        "strategy hook too": [str(w.message).split(":")[0] for w in caught if issubclass(w.category, RuntimeWarning)],
        "bad option": _refusal(lambda: TracedCommHook(bf16_compress_hook, error_every=-1)).split(":")[0],
        "state twice": _refusal(lambda: TracedCommHook(powerSGD_hook, state=0, make_state=int)),
    }
    Path(f"{out_dir}/refusals.json").write_text(json.dumps(refusals))


def main() -> None:
    out_dir = sys.argv[1]
    if "--spawn" in sys.argv:
        check_refusals(out_dir)
        make_state = functools.partial(PowerSGDState, **POWERSGD)
        traced_powersgd = TracedCommHook(powerSGD_hook, make_state=make_state, error_every=1)
        fit(out_dir, "traced-powerSGD", traced_powersgd, DDPStrategy(start_method="spawn"))
    else:
        fit(out_dir, "torch", TorchHook(torch_bf16), DDPStrategy())
        fit(out_dir, "traced", TracedCommHook(bf16_compress_hook), DDPStrategy())
        torch_state = functools.partial(torch_powersgd.PowerSGDState, **POWERSGD)
        fit(out_dir, "torch-powerSGD", TorchHook(torch_powersgd.powerSGD_hook, torch_state), DDPStrategy())


if __name__ == "__main__":
    main()
