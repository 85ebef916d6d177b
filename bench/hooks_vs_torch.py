"""Benchmark: tensorplay's hooks vs torch's, and traced vs untraced, measured side by side.

Hooks: allreduce_hook, fp16_compress_hook, bf16_compress_hook, both compress wrappers around
allreduce_hook, powerSGD_hook. Every variant of one hook trains its own copy of one model
(several 25 MB buckets); the variants
take turns (A B C D E A B C D E ...) so that machine noise hits them alike. Prints the median
step time of every variant and its ratio to the reference, then the overlap of communication
with the backward compute: how long backward took until its gradients were reduced, and how much
of that was communication left exposed (backward minus the backward of the same model under a
hook that communicates nothing, ``noop_hook``). Traced hooks that delayed a collective or stalled
the overlap would show there. Times are taken to the device's completion (CUDA events on a GPU).

Configurations (``--device``, ``--backend``, ``--world-size``):

* ``cpu gloo 2`` (the default): two gloo ranks on this machine.
* ``cuda nccl 1``: one rank on one GPU. NCCL reduces nothing at world size 1, so this measures
  what the hooks and their telemetry cost on the CUDA path (events, figures on the device),
  not communication.
* ``cuda gloo 2``: two ranks sharing one GPU (NCCL refuses two ranks on one device). gloo
  reduces CUDA tensors by copying them to the host and back, so communication is real and can
  overlap the backward compute.

With ``--exporter never-answers`` the traced variants run under an application's
``SimpleSpanProcessor`` whose OTLP exporter talks to a collector that accepts connections and
never answers (a listening socket on 127.0.0.1 that nobody reads): span export must not cost
training anything. With ``--budget-s`` rounds stop once a hook has used its share of that time
(after 3 rounds at least), so one run fits a fixed time on an unknown machine. With ``--json``
the results are added to that file (one entry per configuration), rewritten after every hook so
that a run cut short keeps what it measured.

    python bench/hooks_vs_torch.py [--rounds 7] [--steps 4] [--hooks allreduce_hook,fp16_compress_hook,...]
                                   [--exporter none|never-answers] [--device cpu|cuda] [--backend gloo|nccl]
                                   [--world-size 2] [--width 2048] [--layers 8] [--batch 16]
                                   [--budget-s SECONDS] [--json PATH]
"""

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks

COMPUTE_ONLY = "no communication"
"""The variant whose hook communicates nothing: the backward compute alone, for the overlap table."""
MIN_ROUNDS = 3  # with --budget-s, never fewer rounds than this

Variants = dict[str, Callable[[], tuple[Any, Callable]]]


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run measures; every rank gets the same."""

    device: str
    backend: str
    world_size: int
    width: int
    layers: int
    batch: int
    rounds: int
    steps: int
    budget_s: Optional[float]
    exporter: str

    @property
    def label(self) -> str:
        return f"{self.device} {self.backend} world size {self.world_size}"

    @property
    def model(self) -> str:
        megabytes = self.layers * (self.width + 1) * self.width * 4 / 2**20
        return (
            f"{self.layers} x Linear({self.width}, {self.width}), batch {self.batch} "
            f"(~{megabytes:.0f} MB of float32 gradients, 25 MB buckets)"
        )


def _forward_to(hook: Callable) -> Callable:
    """torch's DDP refuses bf16 hook names on CPU builds; call them under another name."""

    def bench_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)

    return bench_hook


def _powersgd_variants() -> dict[str, Variants]:
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


def variants() -> dict[str, Variants]:
    """For each hook: variant name -> factory of (state, hook). The first variant is the reference."""
    table: dict[str, Variants] = {}
    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        ours = getattr(default_hooks, name)
        theirs = getattr(torch_default, name)
        table[name] = {
            "torch": lambda theirs=theirs: (None, _forward_to(theirs)),
            "tensorplay": lambda ours=ours: (None, _forward_to(ours)),
            "traced": lambda ours=ours: (None, traced(ours)),
            "traced error_every=1": lambda ours=ours: (None, traced(ours, error_every=1)),
        }
    for name in ("fp16_compress_wrapper", "bf16_compress_wrapper"):
        ours = getattr(default_hooks, name)(default_hooks.allreduce_hook)
        theirs = getattr(torch_default, name)(torch_default.allreduce_hook)
        table[f"{name}(allreduce_hook)"] = {
            "torch": lambda theirs=theirs: (None, _forward_to(theirs)),
            "tensorplay": lambda ours=ours: (None, _forward_to(ours)),
            "traced": lambda ours=ours: (None, traced(ours)),
            "traced error_every=1": lambda ours=ours: (None, traced(ours, error_every=1)),
        }
    table.update(_powersgd_variants())
    for hook_variants in table.values():
        hook_variants[COMPUTE_ONLY] = lambda: (None, debugging_hooks.noop_hook)
    return table


def _mark(device: torch.device) -> Any:
    """Now on the device's clock: an event recorded on the current CUDA stream, else the host clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start: Any, end: Any) -> float:
    """Seconds from one mark to a later one; on CUDA once the device got there (the bench waits)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()  # outside the measured interval: the step is over on the host by now
    return start.elapsed_time(end) / 1e3


def _timed_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> tuple[float, float]:
    """One training step; returns its seconds and those of its backward, until the device finished each."""
    start = _mark(batch.device)
    optimizer.zero_grad(set_to_none=False)
    loss = model(batch).square().mean()
    backward_start = _mark(batch.device)
    loss.backward()
    backward_end = _mark(batch.device)
    optimizer.step()
    end = _mark(batch.device)
    return _seconds(start, end), _seconds(backward_start, backward_end)


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


def _join(rank: int, setup: Setup, port: int) -> torch.device:
    """Join the process group; return the device this rank trains on (one GPU: every rank on cuda:0)."""
    device = torch.device("cpu")
    options: dict[str, Any] = {}
    if setup.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        if setup.backend == "nccl":
            options["device_id"] = device
    init_method = f"tcp://127.0.0.1:{port}"
    dist.init_process_group(setup.backend, init_method=init_method, rank=rank, world_size=setup.world_size, **options)
    return device


def _build(setup: Setup, device: torch.device, factory: Callable[[], tuple[Any, Callable]], batch: torch.Tensor) -> tuple:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(setup.width, setup.width, device=device) for _ in range(setup.layers)]))
    state, hook = factory()
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(3):  # warm-up: DDP's bucket rebuild, PowerSGD's start iteration
        _timed_step(model, optimizer, batch)
    return model, optimizer


def _another_round(setup: Setup, rounds_done: int, hook_started: float, hooks: int, device: torch.device) -> bool:
    """Whether to run one more round of every variant; rank 0 decides for all ranks alike."""
    if rounds_done >= setup.rounds:
        return False
    if setup.budget_s is None or rounds_done < MIN_ROUNDS:
        return True
    in_time = time.monotonic() - hook_started < setup.budget_s / hooks
    decision = torch.tensor([int(in_time)], device=device)
    dist.broadcast(decision, src=0)
    return bool(decision.item())


def _bench_rank(rank: int, setup: Setup, port: int, hooks: list[str], out: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    device = _join(rank, setup, port)
    from tensorplay.telemetry import enable_metrics

    enable_metrics(serve=False)  # record metrics as a user would; nothing to scrape here
    silent = _export_to_a_silent_collector() if setup.exporter == "never-answers" else None
    table = variants()
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randn(setup.batch, setup.width, generator=generator).to(device)
    for hook_name in hooks:
        hook_started = time.monotonic()
        models = {variant: _build(setup, device, factory, batch) for variant, factory in table[hook_name].items()}
        times: dict[str, dict[str, list[list[float]]]] = {variant: {"step": [], "backward": []} for variant in models}
        rounds_done = 0
        while _another_round(setup, rounds_done, hook_started, len(hooks), device):
            for variant, (model, optimizer) in models.items():
                dist.barrier()
                measured = [_timed_step(model, optimizer, batch) for _ in range(setup.steps)]
                times[variant]["step"].append([step for step, _ in measured])
                times[variant]["backward"].append([backward for _, backward in measured])
            rounds_done += 1
        if rank == 0:
            out.put((hook_name, times))
        del models
    if rank == 0:
        out.put(None)
    dist.destroy_process_group()
    if silent is not None:
        silent.close()
        os._exit(0)  # the span processor is stuck in an export that will never end: do not wait for it


def _measure(setup: Setup, hooks: list[str]) -> Iterator[tuple[str, dict]]:
    """Run the ranks; yield (hook, times) as each hook is measured."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from ranks import free_port

    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(target=_bench_rank, args=(rank, setup, port, hooks, out)) for rank in range(setup.world_size)
    ]
    for process in processes:
        process.start()
    while (item := _next_result(out, processes)) is not None:
        yield item
    for process in processes:
        process.join()


def _next_result(out: Any, processes: list) -> Any:
    while out.empty():
        if any(process.exitcode not in (None, 0) for process in processes):
            sys.exit(f"a rank died: exit codes {[process.exitcode for process in processes]}")
        time.sleep(0.1)
    return out.get()


def _ratio_stats(rounds: list[list[float]], reference: list[list[float]]) -> dict[str, float]:
    """Median and quartiles of the per-round ratios of median times (this variant over the reference)."""
    ratios = sorted(statistics.median(mine) / statistics.median(ref) for mine, ref in zip(rounds, reference))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2]}


def _median_ms(rounds: list[list[float]]) -> float:
    return statistics.median(t for round_times in rounds for t in round_times) * 1e3


def summarize(times: dict[str, dict[str, list[list[float]]]]) -> dict[str, dict[str, Any]]:
    """Per variant: median step and backward ms, ratios to torch's and to the untraced hook, exposed communication."""
    reference = times[next(iter(times))]
    untraced = times["tensorplay"]
    compute_backward_ms = _median_ms(times[COMPUTE_ONLY]["backward"])
    summary: dict[str, dict[str, Any]] = {}
    for variant, measured in times.items():
        entry: dict[str, Any] = {
            "step_ms": _median_ms(measured["step"]),
            "backward_ms": _median_ms(measured["backward"]),
            "rounds": len(measured["step"]),
            "step_s_by_round": measured["step"],
            "backward_s_by_round": measured["backward"],
        }
        if variant != COMPUTE_ONLY:
            entry["vs_torch"] = _ratio_stats(measured["step"], reference["step"])
            entry["exposed_communication_ms"] = entry["backward_ms"] - compute_backward_ms
        if variant.startswith("traced"):
            entry["vs_untraced"] = _ratio_stats(measured["step"], untraced["step"])
            entry["backward_vs_untraced"] = _ratio_stats(measured["backward"], untraced["backward"])
        summary[variant] = entry
    return summary


def _columns(stats: dict[str, float]) -> str:
    spread = f"{stats['q1']:.3f}-{stats['q3']:.3f}"
    return f"{stats['median']:>10.3f}{spread:>13}"


def print_tables(setup: Setup, summaries: dict[str, dict[str, dict[str, Any]]]) -> None:
    print(f"{setup.label}: {setup.model}; interleaved rounds x {setup.steps} steps per variant")
    if setup.exporter == "never-answers":
        print("traced variants export through SimpleSpanProcessor + OTLP to a collector that never answers")
    print(f"{'hook':<40}{'variant':<26}{'median ms':>10}{'vs torch':>10}{'IQR':>13}{'vs untraced':>13}{'IQR':>13}")
    for hook_name, summary in summaries.items():
        for variant, entry in summary.items():
            if variant == COMPUTE_ONLY:
                continue
            line = f"{hook_name:<40}{variant:<26}{entry['step_ms']:>10.1f}{_columns(entry['vs_torch'])}"
            if "vs_untraced" in entry:
                line += _columns(entry["vs_untraced"])
            print(line)
    print("vs torch / vs untraced: per round, this variant's median step time over that of torch's hook")
    print("(or of tensorplay's untraced hook) in the same round; the median of those ratios and their")
    print("interquartile range.")
    print()
    print(f"{'hook':<40}{'variant':<26}{'backward ms':>12}{'exposed comm ms':>17}{'vs untraced':>13}{'IQR':>13}")
    for hook_name, summary in summaries.items():
        for variant, entry in summary.items():
            line = f"{hook_name:<40}{variant:<26}{entry['backward_ms']:>12.1f}"
            line += f"{entry['exposed_communication_ms']:>17.1f}" if "exposed_communication_ms" in entry else f"{'':>17}"
            if "backward_vs_untraced" in entry:
                line += _columns(entry["backward_vs_untraced"])
            print(line)
    print("backward: from backward's start until its gradients are reduced; exposed comm: that minus the")
    print(f"backward of the same model under noop_hook ('{COMPUTE_ONLY}'), i.e. communication that did not")
    print("overlap the backward compute. A traced hook that changed the overlap shows a backward ratio")
    print("vs untraced above 1.")


def save(path: str, setup: Setup, summaries: dict[str, dict[str, dict[str, Any]]], device_name: str) -> None:
    """Put this configuration's results into the JSON file at ``path`` (other configurations stay)."""
    runs: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as existing:
            runs = json.load(existing)
    runs[setup.label] = {
        "setup": dataclasses.asdict(setup),
        "model": setup.model,
        "device": device_name,
        "torch": torch.__version__,
        "hooks": summaries,
    }
    with open(path + ".tmp", "w") as written:
        json.dump(runs, written, indent=1)
    os.replace(path + ".tmp", path)


def _parse() -> tuple[Setup, list[str], Optional[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every variant (at most, with --budget-s)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant and round")
    parser.add_argument("--hooks", default=",".join(variants()))
    parser.add_argument("--exporter", choices=("none", "never-answers"), default="none")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget-s", type=float, default=None, help="stop adding rounds once this time is used")
    parser.add_argument("--json", default=None, help="add the results to this JSON file")
    args = parser.parse_args()
    hooks = args.hooks.split(",")
    unknown = sorted(set(hooks) - set(variants()))
    if unknown:
        sys.exit(f"unknown hooks {unknown}; choose from {sorted(variants())}")
    if args.backend == "nccl" and args.device != "cuda":
        sys.exit("--backend nccl needs --device cuda")
    setup = Setup(
        args.device, args.backend, args.world_size, args.width, args.layers, args.batch,
        args.rounds, args.steps, args.budget_s, args.exporter,
    )
    return setup, hooks, args.json


def main() -> None:
    setup, hooks, json_path = _parse()
    device_name = torch.cuda.get_device_name(0) if setup.device == "cuda" else "cpu"
    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    for hook_name, times in _measure(setup, hooks):
        summaries[hook_name] = summarize(times)
        print(f"measured {hook_name}: {summaries[hook_name]['tensorplay']['rounds']} rounds", file=sys.stderr)
        if json_path:
            save(json_path, setup, summaries, device_name)
    print_tables(setup, summaries)


if __name__ == "__main__":
    main()
