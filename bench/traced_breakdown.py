"""Where a traced hook's time goes: the telemetry's share of a hook call, part by part.

Runs the model of ``bench/hooks_vs_torch.py`` as one gloo rank (world size 1: the allreduce is a
copy, so what is left is the hooks' own work and the telemetry's), a traced and an untraced copy
side by side in interleaved rounds, and prints:

* the CPU time per step of the traced copy over the untraced one (all threads of the process:
  the completion callbacks run on gloo's threads), median and quartiles of per-round ratios;
* per hook call, on the training thread (from ``cProfile``, which profiles only the thread it
  runs on and inflates Python-level parts a little): the untraced hook, the traced call and its
  parts: the compression figures that ran there (averaged over all calls), starting the record
  (span, record, gauges) and the rest of the bookkeeping.

The fp16/bf16 casts' figures (the non-finite check on every call, the exact error pass on sampled
steps) are taken in a callback of the bucket's collective, which runs on gloo's thread unless
the collective completed before the hook chained on it (with one rank it sometimes has): what
the table shows of them is what ran inline on the training thread.

    python bench/traced_breakdown.py [--hook fp16_compress_hook] [--error-every 25] [--rounds 13] [--steps 4]
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from tensorplay.telemetry import enable_metrics

PARTS = {
    "compression figures before launch": ("compression_figures.py", "compression_figures"),
    "cast figures after the collective": ("compression_figures.py", "cast_figures"),
    "  non-finite check of the result": ("compression_figures.py", "all_finite"),
    "start of the record": ("traced.py", "_start_record"),
    "which model the bucket is from": ("model_identity.py", "enter"),
    "collective bookkeeping": ("recorder.py", "collective_launching"),
    "following the future": ("recorder.py", "follow"),
}


def _hook_and_state(name: str) -> tuple[Callable[[], Any], Callable]:
    if name == "powerSGD_hook":
        def state() -> Any:
            return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)

        return state, powersgd.powerSGD_hook
    return (lambda: None), getattr(default_hooks, name)


def _model(hook: Callable, state: Any, width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]))
    model.register_comm_hook(state, hook)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=False)
    model(batch).square().mean().backward()
    optimizer.step()


def _profiled(stats: pstats.Stats, in_path: str, function: str) -> tuple[int, float]:
    """(calls, cumulative seconds) of ``function`` in files whose path contains ``in_path``."""
    calls, seconds = 0, 0.0
    for (path, _, name), (primitive, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if in_path in path and name == function:
            calls += primitive
            seconds += cumulative
    return calls, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", default="fp16_compress_hook")
    parser.add_argument("--error-every", type=int, default=None, help="traced(hook, error_every=N); default: traced's")
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from ranks import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    enable_metrics(serve=False)
    state, hook = _hook_and_state(args.hook)
    options = {} if args.error_every is None else {"error_every": args.error_every}
    copies = {
        "untraced": _model(hook, state(), args.width, args.layers),
        "traced": _model(traced(hook, **options), state(), args.width, args.layers),
    }
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    for model, optimizer in copies.values():
        for _ in range(3):
            _step(model, optimizer, batch)

    cpu: dict[str, list[float]] = {name: [] for name in copies}
    for _ in range(args.rounds):
        for name, (model, optimizer) in copies.items():
            start = time.process_time()
            for _ in range(args.steps):
                _step(model, optimizer, batch)
            cpu[name].append((time.process_time() - start) / args.steps)
    ratios = sorted(t / u for t, u in zip(cpu["traced"], cpu["untraced"]))
    q1, _, q3 = statistics.quantiles(ratios, n=4)

    profiled_steps = max(args.rounds * args.steps, 25)
    profiles = {}
    for name, (model, optimizer) in copies.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(profiled_steps):
            _step(model, optimizer, batch)
        profile.disable()
        profiles[name] = pstats.Stats(profile)
    calls, untraced_s = _profiled(profiles["untraced"], "ddp_comm_hooks", hook.__name__)
    traced_ms = 1e3 * _profiled(profiles["traced"], "telemetry/traced.py", "__call__")[1] / calls
    untraced_ms = 1e3 * untraced_s / calls
    parts = {
        label: 1e3 * _profiled(profiles["traced"], f"telemetry/{file}", function)[1] / calls
        for label, (file, function) in PARTS.items()
    }

    print(f"{args.hook}, traced(error_every={options.get('error_every', 'default')}): 1 gloo rank, "
          f"{args.layers} x Linear({args.width}, {args.width}), batch {args.batch}, {calls // profiled_steps} buckets per step")
    print(f"CPU time per step, traced / untraced: median {statistics.median(ratios):.3f} (IQR {q1:.3f}-{q3:.3f}, "
          f"{args.rounds} rounds x {args.steps} steps; untraced {1e3 * statistics.median(cpu['untraced']):.1f} ms)")
    print(f"per hook call on the training thread ({calls} calls, cProfile):")
    print(f"  {'untraced hook':40s} {untraced_ms:8.3f} ms")
    print(f"  {'traced hook':40s} {traced_ms:8.3f} ms   (+{traced_ms - untraced_ms:.3f} ms)")
    for label, ms in parts.items():
        print(f"    {label:38s} {ms:8.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
