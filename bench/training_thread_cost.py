"""What a traced hook adds to the training thread, as a share of the untraced step's thread CPU.

The training thread is where a hook delays every bucket's launch (and where launch-bound GPU
jobs feel it most). This bench measures it directly, free of the wall-clock noise of a shared
machine: every gloo rank (2 by default) trains one model (the model of ``bench/hooks_vs_torch.py``,
25 MB buckets) whose registered hook hands each bucket to the untraced hook, to ``traced(hook)``
or to ``traced(hook, error_every=1)``, one variant per block of steps, the order rotating round by
round: the same model, the same buffers, the same memory. It reads each training thread's own
CPU clock (``time.thread_time_ns``) around every hook call and around every step, with metrics
on and spans recorded by an SDK tracer provider (a batch processor whose exporter drops them),
as users run it.

With two or more ranks a collective is in flight when the hook chains on it, as in any real job,
and tensorplay's callbacks run on gloo's thread. ``--world-size 1`` is the degenerate case: gloo
completes a one-rank collective at once, so whether a callback runs inline on the training thread
(the figure pass of a cast, finishing the record) is a race that load decides.

Per round, rank and variant: the median over its steps of the thread CPU inside the hook calls
and of the whole step. Printed per hook and traced variant, over every rank's rounds: the added
share of the step, (traced hook CPU − untraced hook CPU) / untraced step CPU, median and IQR; and
the same for the whole step's training-thread CPU, which also catches work a traced hook left to
callbacks that happened to run inline on the training thread.

    python bench/training_thread_cost.py [--world-size 2] [--rounds 21] [--steps 3] [--hooks allreduce_hook,...]
"""

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from tensorplay.telemetry import enable_metrics, flush

UNTRACED = "untraced"
VARIANTS = (UNTRACED, "traced", "traced error_every=1")


def hooks() -> dict[str, tuple[Callable[[], Any], Callable]]:
    """Hook display name -> (state factory, hook): every documented hook of the cost table."""
    table: dict[str, tuple[Callable[[], Any], Callable]] = {}
    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        table[name] = (lambda: None, getattr(default_hooks, name))
    for name in ("fp16_compress_wrapper", "bf16_compress_wrapper"):
        table[f"{name}(allreduce_hook)"] = (lambda: None, getattr(default_hooks, name)(default_hooks.allreduce_hook))

    def powersgd_state() -> Any:
        return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)

    table["powerSGD_hook"] = (powersgd_state, powersgd.powerSGD_hook)
    return table


class _DroppingExporter(SpanExporter):
    """Accepts every span and keeps none: spans are built and processed as users' are."""

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class Alternating:
    """The hook registered with DDP: calls the current variant and adds its thread CPU time."""

    def __init__(self, variants: dict[str, Callable]) -> None:
        self.variants = variants
        self.current = UNTRACED
        self.hook_ns = 0
        self.__name__ = self.__qualname__ = "alternating_hook"  # DDP checks and logs these

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        hook = self.variants[self.current]
        start = time.thread_time_ns()
        future = hook(state, bucket)
        self.hook_ns += time.thread_time_ns() - start
        return future


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=False)
    model(batch).square().mean().backward()
    optimizer.step()


def measure(name: str, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Per variant, per round: (median hook CPU ns per step, median step CPU ns)."""
    state_factory, hook = hooks()[name]
    alternating = Alternating(
        {
            UNTRACED: hook,
            "traced": traced(hook),  # the default sampling (TENSORPLAY_ERROR_EVERY, else 25)
            "traced error_every=1": traced(hook, error_every=1),
        }
    )
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]))
    model.register_comm_hook(state_factory(), alternating)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    for variant in VARIANTS:  # warm-up: DDP's bucket rebuild, PowerSGD's start iteration
        alternating.current = variant
        for _ in range(3):
            _step(model, optimizer, batch)
    results: dict[str, list[tuple[float, float]]] = {variant: [] for variant in VARIANTS}
    for round_index in range(args.rounds):
        shift = round_index % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            alternating.current = variant
            hook_ns, step_ns = [], []
            for _ in range(args.steps):
                alternating.hook_ns = 0
                start = time.thread_time_ns()
                _step(model, optimizer, batch)
                step_ns.append(time.thread_time_ns() - start)
                hook_ns.append(alternating.hook_ns)
            results[variant].append((statistics.median(hook_ns), statistics.median(step_ns)))
        flush(10.0)  # outside the measured steps: every span of the round ended
    return results


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


def shares(results: dict[str, list[tuple[float, float]]], variant: str) -> tuple[tuple, tuple]:
    """(added share inside the hook calls, added share of the whole step), each as (q1, median, q3)."""
    inside, whole = [], []
    for (hook_ns, step_ns), (base_hook_ns, base_step_ns) in zip(results[variant], results[UNTRACED]):
        inside.append((hook_ns - base_hook_ns) / base_step_ns)
        whole.append((step_ns - base_step_ns) / base_step_ns)
    return _quartiles(inside), _quartiles(whole)


def _percent(quartiles: tuple[float, float, float]) -> str:
    q1, median, q3 = quartiles
    return f"{100 * median:+7.2f} % ({100 * q1:+.2f} to {100 * q3:+.2f})"


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """One rank: train every hook's variants; rank 0 prints the table of every rank's rounds."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    enable_metrics(serve=False)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_DroppingExporter()))
    from opentelemetry import trace

    trace.set_tracer_provider(provider)
    if rank == 0:
        print(f"{world_size} gloo rank{'s' if world_size > 1 else ''}, {args.layers} x Linear({args.width}, {args.width}), "
              f"batch {args.batch}, metrics on, spans recorded (SDK, batch processor); {args.rounds} rounds x "
              f"{args.steps} steps per variant{', every rank' if world_size > 1 else ''}")
        print(f"{'hook':<40}{'variant':<22}{'untraced step':>14}{'untraced hooks':>15}"
              f"{'added inside the hook calls (IQR)':>40}{'added to the whole step (IQR)':>38}")
    for name in args.hooks.split(","):
        mine = measure(name, args)
        every: list[dict[str, list[tuple[float, float]]]] = [{} for _ in range(world_size)]
        dist.all_gather_object(every, mine)
        if rank != 0:
            continue
        results = {variant: [r for ranks in every for r in ranks[variant]] for variant in VARIANTS}
        base_hook = statistics.median(hook for hook, _ in results[UNTRACED]) / 1e6
        base_step = statistics.median(step for _, step in results[UNTRACED]) / 1e6
        for variant in VARIANTS[1:]:
            inside, whole = shares(results, variant)
            print(f"{name:<40}{variant:<22}{base_step:>11.1f} ms{base_hook:>12.2f} ms"
                  f"{_percent(inside):>40}{_percent(whole):>38}", flush=True)
    if rank == 0:
        print("share: (traced - untraced) training-thread CPU per step, over the untraced step's training-thread")
        print("CPU, per round (median of its steps); median and interquartile range over rounds (of every rank).")
    dist.destroy_process_group()
    provider.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant and round")
    parser.add_argument("--hooks", default=",".join(hooks()))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--world-size", type=int, default=2,
                        help="gloo ranks (default 2; 1 completes collectives before the hook chains on them)")
    args = parser.parse_args()
    unknown = sorted(set(args.hooks.split(",")) - set(hooks()))
    if unknown:
        sys.exit(f"unknown hooks {unknown}; choose from {sorted(hooks())}")

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from ranks import free_port

    torch.multiprocessing.start_processes(_rank, args=(args.world_size, free_port(), args), nprocs=args.world_size,
                                          start_method="spawn")


if __name__ == "__main__":
    main()
