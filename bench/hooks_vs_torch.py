"""Benchmark: tensorplay's hooks vs torch's, and traced vs untraced, measured side by side.

Two gloo ranks on this machine train one model per variant, several 25 MB buckets each; the
variants of one hook take turns (A B C D A B C D ...) so that machine noise hits them alike.
Prints the median step time of every variant and its ratio to the reference.

With ``--exporter never-answers`` the traced variants run under an application's
``SimpleSpanProcessor`` whose OTLP exporter talks to a collector that accepts connections and
never answers (a listening socket on 127.0.0.1 that nobody reads): span export must not cost
training anything.

    python bench/hooks_vs_torch.py [--rounds 7] [--steps 4] [--hooks allreduce_hook,fp16_compress_hook,...]
                                   [--exporter none|never-answers]
"""

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks

WIDTH = 2048
LAYERS = 8  # 8 x 16.8 MB of float32 parameters: five to six 25 MB buckets
BATCH = 16


def _forward_to(hook: Callable) -> Callable:
    """torch's DDP refuses bf16 hook names on CPU builds; call them under another name."""

    def bench_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)

    return bench_hook


def _powersgd_variants() -> dict[str, dict[str, Callable[[], tuple[Any, Callable]]]]:
    try:
        from tensorplay.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ours
    except ImportError:
        return {}
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as theirs

    def state(module: Any) -> Callable[[], Any]:
        return lambda: module.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)

    def sequential(hook: Callable) -> Callable:
        # torch's hook hangs with several buckets on gloo unless each bucket finishes in turn.
        def torch_powerSGD_sequential(st: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            fut = hook(st, bucket)
            fut.wait()
            return fut

        return torch_powerSGD_sequential

    return {
        "powerSGD_hook": {
            "torch (bucket by bucket)": lambda: (state(theirs)(), sequential(theirs.powerSGD_hook)),
            "tensorplay": lambda: (state(ours)(), ours.powerSGD_hook),
            "traced": lambda: (state(ours)(), traced(ours.powerSGD_hook)),
            "traced error_every=1": lambda: (state(ours)(), traced(ours.powerSGD_hook, error_every=1)),
        }
    }


def variants() -> dict[str, dict[str, Callable[[], tuple[Any, Callable]]]]:
    """For each hook: variant name -> factory of (state, hook). The first variant is the reference."""
    table: dict[str, dict[str, Callable[[], tuple[Any, Callable]]]] = {}
    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        ours = getattr(default_hooks, name)
        theirs = getattr(torch_default, name)
        table[name] = {
            "torch": lambda theirs=theirs: (None, _forward_to(theirs)),
            "tensorplay": lambda ours=ours: (None, _forward_to(ours)),
            "traced": lambda ours=ours: (None, traced(ours)),
            "traced error_every=1": lambda ours=ours: (None, traced(ours, error_every=1)),
        }
    table.update(_powersgd_variants())
    return table


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=False)
    model(batch).square().mean().backward()
    optimizer.step()


def _never_answering_collector() -> tuple[socket.socket, str]:
    """A listening socket nobody reads: connections succeed, requests are never answered."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1024)
    return silent, f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces"


def _export_to_a_silent_collector() -> socket.socket:
    """Set the application's tracer provider: SimpleSpanProcessor -> OTLP -> a collector that never answers."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    silent, endpoint = _never_answering_collector()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return silent


def _bench_rank(
    rank: int, world_size: int, port: int, hooks: list[str], rounds: int, steps: int, exporter: str, out: Any
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    from tensorplay.telemetry import enable_metrics

    enable_metrics(serve=False)  # record metrics as a user would; nothing to scrape here
    silent = _export_to_a_silent_collector() if exporter == "never-answers" else None
    table = variants()
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randn(BATCH, WIDTH, generator=generator)
    results: dict[str, dict[str, list[float]]] = {}
    for hook_name in hooks:
        models = {}
        for variant, factory in table[hook_name].items():
            torch.manual_seed(0)
            model = DDP(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]))
            state, hook = factory()
            model.register_comm_hook(state, hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            for _ in range(3):  # warm-up: DDP's bucket rebuild, PowerSGD's start iteration
                _step(model, optimizer, batch)
            models[variant] = (model, optimizer)
        times: dict[str, list[list[float]]] = {variant: [] for variant in models}
        for _ in range(rounds):
            for variant, (model, optimizer) in models.items():
                dist.barrier()
                round_times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    _step(model, optimizer, batch)
                    round_times.append(time.perf_counter() - start)
                times[variant].append(round_times)
        results[hook_name] = times
        del models
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()
    if silent is not None:
        silent.close()
        os._exit(0)  # the span processor is stuck in an export that will never end: do not wait for it


def _ratio_columns(rounds: list[list[float]], reference: list[list[float]]) -> str:
    """Median and interquartile range of the per-round ratios of median step times."""
    ratios = sorted(statistics.median(mine) / statistics.median(ref) for mine, ref in zip(rounds, reference))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return f"{statistics.median(ratios):>10.3f}{f'{quartiles[0]:.3f}-{quartiles[2]:.3f}':>13}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hooks", default=",".join(variants()))
    parser.add_argument("--exporter", choices=("none", "never-answers"), default="none")
    args = parser.parse_args()
    hooks = args.hooks.split(",")
    unknown = sorted(set(hooks) - set(variants()))
    if unknown:
        sys.exit(f"unknown hooks {unknown}; choose from {sorted(variants())}")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from ranks import free_port

    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(target=_bench_rank, args=(rank, 2, port, hooks, args.rounds, args.steps, args.exporter, out))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    results = out.get()
    for process in processes:
        process.join()
    print(f"2 gloo ranks, {LAYERS} x Linear({WIDTH}, {WIDTH}) (~{LAYERS * WIDTH * WIDTH * 4 / 2**20:.0f} MB of "
          f"gradients, 25 MB buckets), {args.rounds} interleaved rounds x {args.steps} steps per variant")
    if args.exporter == "never-answers":
        print("traced variants export through SimpleSpanProcessor + OTLP to a collector that never answers")
    print(f"{'hook':<22}{'variant':<24}{'median ms':>10}{'vs torch':>10}{'IQR':>13}{'vs untraced':>13}{'IQR':>13}")
    for hook_name, times in results.items():
        torch_rounds = times[next(iter(times))]
        untraced_rounds = times["tensorplay"]
        for variant, rounds in times.items():
            median = statistics.median(t for round_times in rounds for t in round_times)
            line = f"{hook_name:<22}{variant:<24}{median * 1e3:>10.1f}"
            line += _ratio_columns(rounds, torch_rounds)
            if variant.startswith("traced"):
                line += _ratio_columns(rounds, untraced_rounds)
            print(line)
    print("vs torch / vs untraced: per round, this variant's median step time over that of torch's hook")
    print("(or of tensorplay's untraced hook) in the same round; the median of those ratios and their")
    print("interquartile range.")


if __name__ == "__main__":
    main()
