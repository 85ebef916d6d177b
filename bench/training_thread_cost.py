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

The compression advice (``advise_every``): ``traced advise_every=0`` is the traced hook without
it (what tracing cost before the advice existed), ``traced`` the defaults, ``traced
advise_every=1`` the advice on every step the advice thread is free for (a step whose turn comes
while the previous advice is still computed is not advised). A per-round median hides the one
step in 100 that the default advises, so the default's cost is also given amortized over its
period: ((N - 1) x a step without advice + an advised step) / N, per round, from the
``advise_every=0`` block and the advised steps of the ``advise_every=1`` block. The CPU of
``tensorplay-advisor`` (off the training thread) per advised iteration is read from that thread's
own clock.

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
                                         [--variants "traced advise_every=0,traced,..."]
"""

import argparse
import json
import os
import statistics
import sys
import threading
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
from tensorplay.telemetry import DEFAULT_ADVISE_EVERY, enable_metrics, flush

UNTRACED = "untraced"
BEFORE_ADVICE = "traced advise_every=0"
EVERY_STEP_ADVICE = "traced advise_every=1"
OPTIONS = {
    UNTRACED: None,
    BEFORE_ADVICE: {"advise_every": 0},
    "traced": {},  # the defaults (TENSORPLAY_ERROR_EVERY / _ADVISE_EVERY, else 25 / 100)
    EVERY_STEP_ADVICE: {"advise_every": 1},
    "traced error_every=1": {"error_every": 1},
}
"""Variant name -> traced()'s options (None: the hook untraced)."""


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


class Round:
    """One variant's block of steps in one round: medians of its steps, and the advice it took."""

    def __init__(self, hook_ns: float, step_ns: float, advised_hook_ns: float | None, advised: int, steps: int,
                 advice_ns: int) -> None:
        self.hook_ns = hook_ns
        self.step_ns = step_ns
        self.advised_hook_ns = advised_hook_ns
        """Median hook CPU over the block's advised steps (None if none was)."""
        self.advised = advised
        self.steps = steps
        self.advice_ns = advice_ns
        """CPU of tensorplay-advisor over the block, its advice all done."""


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


def _advised(hook: Callable) -> int:
    """Iterations the traced hook's advice has begun so far (0 for the untraced hook)."""
    advisor = getattr(hook, "_advisor", None)
    return advisor.iterations_advised if advisor is not None else 0


def _advice_thread_ns() -> int:
    """CPU time of tensorplay-advisor so far (0 before it started)."""
    for thread in threading.enumerate():
        if thread.name == "tensorplay-advisor" and thread.ident is not None:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
    return 0


def measure(name: str, args: argparse.Namespace) -> dict[str, list[Round]]:
    """Per variant, per round: what its block of steps cost."""
    state_factory, hook = hooks()[name]
    variants = args.variants
    alternating = Alternating({v: hook if OPTIONS[v] is None else traced(hook, **OPTIONS[v]) for v in variants})
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]))
    model.register_comm_hook(state_factory(), alternating)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    for variant in variants:  # warm-up: DDP's bucket rebuild, PowerSGD's start iteration
        alternating.current = variant
        for _ in range(3):
            _step(model, optimizer, batch)
    flush(60.0)
    results: dict[str, list[Round]] = {variant: [] for variant in variants}
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            alternating.current = variant
            current = alternating.variants[variant]
            hook_ns, step_ns, advised_ns = [], [], []
            advice_start = _advice_thread_ns()
            for _ in range(args.steps):
                alternating.hook_ns = 0
                advised_before = _advised(current)
                start = time.thread_time_ns()
                _step(model, optimizer, batch)
                step_ns.append(time.thread_time_ns() - start)
                hook_ns.append(alternating.hook_ns)
                if _advised(current) > advised_before:
                    advised_ns.append(alternating.hook_ns)
            flush(60.0)  # outside the measured steps: every span and advice of the block done
            results[variant].append(Round(statistics.median(hook_ns), statistics.median(step_ns),
                                          statistics.median(advised_ns) if advised_ns else None, len(advised_ns),
                                          args.steps, _advice_thread_ns() - advice_start))
    return results


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


def shares(results: dict[str, list[Round]], variant: str) -> tuple[tuple, tuple]:
    """(added share inside the hook calls, added share of the whole step), each as (q1, median, q3)."""
    inside, whole = [], []
    for traced_round, base in zip(results[variant], results[UNTRACED]):
        inside.append((traced_round.hook_ns - base.hook_ns) / base.step_ns)
        whole.append((traced_round.step_ns - base.step_ns) / base.step_ns)
    return _quartiles(inside), _quartiles(whole)


def amortized_default(results: dict[str, list[Round]], every: int) -> tuple[float, float, float] | None:
    """The default advice's added share inside the hook calls, over its period of ``every`` steps:
    ((every - 1) x a step without advice + an advised step) / every, per round with an advised step."""
    shares_ = []
    for before, advised, base in zip(results[BEFORE_ADVICE], results[EVERY_STEP_ADVICE], results[UNTRACED]):
        if advised.advised_hook_ns is not None:
            period_ns = ((every - 1) * before.hook_ns + advised.advised_hook_ns) / every
            shares_.append((period_ns - base.hook_ns) / base.step_ns)
    return _quartiles(shares_) if len(shares_) >= 2 else None


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
        print(f"{'hook':<40}{'variant':<26}{'untraced step':>14}{'untraced hooks':>15}"
              f"{'added inside the hook calls (IQR)':>40}{'added to the whole step (IQR)':>38}")
    for name in args.hooks.split(","):
        mine = measure(name, args)
        every: list[dict[str, list[Round]]] = [{} for _ in range(world_size)]
        dist.all_gather_object(every, mine)
        if rank != 0:
            continue
        results = {variant: [r for ranks in every for r in ranks[variant]] for variant in args.variants}
        base_hook = statistics.median(r.hook_ns for r in results[UNTRACED]) / 1e6
        base_step = statistics.median(r.step_ns for r in results[UNTRACED]) / 1e6
        for variant in args.variants[1:]:
            inside, whole = shares(results, variant)
            print(f"{name:<40}{variant:<26}{base_step:>11.1f} ms{base_hook:>12.2f} ms"
                  f"{_percent(inside):>40}{_percent(whole):>38}", flush=True)
        if BEFORE_ADVICE in results and EVERY_STEP_ADVICE in results:
            _print_advice(name, results, base_step)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as raw:
                raw.write(json.dumps({"hook": name, "rounds": {v: [vars(r) for r in rs] for v, rs in results.items()}}) + "\n")
    if rank == 0:
        print("share: (traced - untraced) training-thread CPU per step, over the untraced step's training-thread")
        print("CPU, per round (median of its steps); median and interquartile range over rounds (of every rank).")
        print(f"amortized: advice every N steps, ((N - 1) x the {BEFORE_ADVICE} step + the median")
        print(f"advised step of {EVERY_STEP_ADVICE}) / N, per round; advice thread: CPU of tensorplay-advisor per")
        print("advised iteration (off the training thread), and as a share of the untraced step.")
    dist.destroy_process_group()
    provider.shutdown()


AMORTIZED_OVER = (100, 250, 500)
"""Advice periods the advised steps are amortized over (the default among them)."""


def _print_advice(name: str, results: dict[str, list[Round]], base_step_ms: float) -> None:
    """The advice amortized over periods around the default, and what the advice thread spent per advised iteration."""
    for every in sorted({*AMORTIZED_OVER, DEFAULT_ADVISE_EVERY}):
        amortized = amortized_default(results, every)
        variant = f"advice every {every}{' (default)' if every == DEFAULT_ADVISE_EVERY else ''}"
        print(f"{name:<40}{variant:<26}{'amortized':>29}{_percent(amortized) if amortized else 'no advised step':>40}")
    advised = results[EVERY_STEP_ADVICE]
    taken = sum(r.advised for r in advised)
    per_iteration = [r.advice_ns / r.advised / 1e6 for r in advised if r.advised]
    q1, median, q3 = _quartiles(per_iteration) if len(per_iteration) >= 2 else (0.0, 0.0, 0.0)
    print(f"{name:<40}{'advice thread':<26}{'':>29}{f'{median:.1f} ms ({q1:.1f} to {q3:.1f}) per advised iteration':>40}"
          f"  {100 * median / base_step_ms:.1f} % of the step; {taken}/{sum(r.steps for r in advised)} steps advised",
          flush=True)


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
    parser.add_argument("--json", help="append every round's figures, one line per hook, to this file")
    parser.add_argument("--variants", default=",".join(list(OPTIONS)[1:]),
                        help=f"traced variants, beside the untraced hook; choose from {list(OPTIONS)[1:]}")
    args = parser.parse_args()
    args.variants = [UNTRACED, *[v for v in args.variants.split(",") if v != UNTRACED]]
    unknown_variants = sorted(set(args.variants) - set(OPTIONS))
    if unknown_variants:
        sys.exit(f"unknown variants {unknown_variants}; choose from {list(OPTIONS)[1:]}")
    unknown = sorted(set(args.hooks.split(",")) - set(hooks()))
    if unknown:
        sys.exit(f"unknown hooks {unknown}; choose from {sorted(hooks())}")

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from ranks import free_port

    torch.multiprocessing.start_processes(_rank, args=(args.world_size, free_port(), args), nprocs=args.world_size,
                                          start_method="spawn")


if __name__ == "__main__":
    main()
