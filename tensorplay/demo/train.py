"""One rank of the demo's training job; ``tensorplay demo`` starts it, and so can ``torchrun``.

It reads ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (and the rendezvous's ``MASTER_ADDR`` /
``MASTER_PORT``) from the environment, so the same entry point runs on many nodes::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m tensorplay.demo.train --steps 200 --hook powerSGD_hook

Each rank trains a small MLP (several DDP buckets) on synthetic regression data over gloo with
the chosen hook registered as ``traced(...)``, inside ``Join([ddp_model])`` when inputs are
uneven, serves its metrics and exports its spans. With ``--run-dir`` it also leaves its progress,
spans and results there, and rank 0 prints the per-rank table of :mod:`tensorplay.demo.table`
(and writes it to ``report.txt``): every rank reads its own span file and sends the spans to rank 0
over the process group, so the table covers every node without a shared filesystem.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry.sdk.trace import TracerProvider
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay.analysis.replicas import replica_sync
from tensorplay.analysis.span_reader import NoSpans, Spans, merge_spans, read_spans
from tensorplay.analysis.summary import summarize
from tensorplay.distributed.algorithms.join import Join
from tensorplay.telemetry import (
    TensorplayMetrics,
    configure_tracing,
    enable_metrics,
    flush,
    served_address,
    wait_for_final_scrape,
)
from tensorplay.telemetry.names import Metric
from tensorplay.telemetry.replica_sync import FINGERPRINT_EVERY_ENV

from .hang import RankStateWriter
from .hooks import traced_hook
from .options import accumulation_steps, add_job_arguments, extra_batches, hang_step, job_problem
from .progress import ProgressWriter
from .table import RankFacts, render
from .rundir import RunDir, write_json

__all__ = ["main", "make_model", "batch_count"]

IN_FEATURES = 128
WIDTH = 384
DEPTH = 6
OUT_FEATURES = 16
BUCKET_CAP_MB = 1.0  # about 0.6 MB per hidden layer: DDP makes four or more buckets
DEMO_FINGERPRINT_EVERY = 5
"""The demo's replicas are fingerprinted every 5 optimizer steps unless TENSORPLAY_FINGERPRINT_EVERY says otherwise."""


def make_model(seed: int = 0) -> nn.Module:
    """Build the demo's MLP, identical on every rank."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, WIDTH), nn.ReLU()]
    for _ in range(DEPTH - 2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, OUT_FEATURES))
    return nn.Sequential(*layers)


def batch_count(rank: int, steps: int, uneven: bool) -> int:
    """How many batches ``rank`` trains: ``steps``, or more on higher ranks with uneven inputs."""
    return steps + rank * extra_batches(steps) if uneven else steps


class _SyntheticData:
    """Regression targets from a fixed random teacher network; each rank draws its own inputs."""

    def __init__(self, rank: int) -> None:
        teacher = torch.Generator().manual_seed(1234)
        self._teacher = torch.randn(IN_FEATURES, OUT_FEATURES, generator=teacher) / IN_FEATURES**0.5
        self._inputs = torch.Generator().manual_seed(rank)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(size, IN_FEATURES, generator=self._inputs)
        return inputs, torch.tanh(inputs @ self._teacher)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise SystemExit(f"tensorplay.demo.train: {name} is not set; start it with `tensorplay demo` or torchrun")
    return int(value)


def _metrics_figures(metrics: TensorplayMetrics, rank: int) -> dict[str, float | None]:
    """This rank's compute time so far, and how many of its span exports failed, as tensorplay's metrics hold them."""
    labels = {"rank": str(rank)}
    sample = metrics.registry.get_sample_value
    return {
        "compute_seconds_sum": sample(f"{Metric.STEP_COMPUTE}_sum", labels),
        "compute_seconds_count": sample(f"{Metric.STEP_COMPUTE}_count", labels),
        "span_exports_failed":
            sample(f"{Metric.TELEMETRY_ERRORS}_total", {**labels, "reason": "span_export_failed"}) or 0.0,
    }


def _injected(delay_s: float, factor: int, batch_size: int) -> str | None:
    """The straggler the demo made of this rank, in words (None: none)."""
    if delay_s:
        return f"sleeps {delay_s * 1e3:g} ms per step"
    if factor != 1:
        return f"trains a {factor}x batch ({factor * batch_size} samples against its peers' {batch_size})"
    return None


def _injected_no_sync_bug(args: argparse.Namespace) -> str | None:
    """The no_sync() mistake the demo made on every rank, in words (None: none)."""
    if args.no_sync_bug == "backward-only":
        return (f"no_sync() wraps only the backward of {accumulation_steps(args) - 1} of every "
                f"{accumulation_steps(args)} batches (it takes no effect)")
    if args.no_sync_bug == "never-ends":
        return "no_sync() entered after the first optimizer step and never left"
    return None


def _serve_metrics(args: argparse.Namespace) -> tuple[TensorplayMetrics, str | None]:
    """Turn metrics on; if they cannot be served (a port taken), also return why, for the launcher's terminal.

    ``enable_metrics`` says why in a warning, which still reaches this rank's log.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        metrics = enable_metrics(port=args.metrics_port, addr=args.metrics_addr)
    for warning in caught:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    not_served = None if served_address() else "; ".join(str(w.message).removeprefix("tensorplay: ") for w in caught) or "metrics not served"
    return metrics, not_served


def _configure_tracing(args: argparse.Namespace, run_dir: RunDir | None, rank: int) -> TracerProvider | None:
    """Export spans to the run directory's span file and, if an endpoint is known, over OTLP."""
    otlp = bool(args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    span_file = str(run_dir.spans(rank)) if run_dir is not None else None
    if not otlp and span_file is None:
        return None
    return configure_tracing(endpoint=args.otlp_endpoint, otlp=otlp, span_file=span_file)


def _own_spans(run_dir: RunDir, rank: int) -> Spans | None:
    """This rank's spans, read by the analysis' reader (None if it exported none)."""
    try:
        return read_spans(run_dir.spans(rank))
    except NoSpans:
        return None


def _report_on_rank0(args: argparse.Namespace, run_dir: RunDir, result: dict[str, Any]) -> None:
    """Every rank sends its spans to rank 0, which derives the figures, prints and writes the table."""
    rank, world_size = result["rank"], result["world_size"]
    mine = (RankFacts(rank, result["straggler"], result["metrics_url"]), _own_spans(run_dir, rank))
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is not None:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        spans = merge_spans([part for _, part in gathered if part is not None])
        (summary, *_) = summarize(spans)  # the demo trains one model
        text = render(summary, [facts for facts, _ in gathered], args.hook, run_dir, nodes,
                      replica_sync(spans.optimizer_steps), _injected_no_sync_bug(args))
        run_dir.report.write_text(text + "\n", encoding="utf-8")
        print(text, flush=True)


def _blocked_collective(args: argparse.Namespace, rank: int, world_size: int) -> tuple[int, Any] | None:
    """For ``--hang-inside-collective``: the step and the group the hang rank blocks in, on that rank.

    Every rank creates the group (creating one is collective); only the hang rank reduces over it,
    so its other member never arrives.
    """
    if args.hang_rank is None or not args.hang_inside_collective:
        return None
    group = dist.new_group(sorted({args.hang_rank, (args.hang_rank + 1) % world_size}))
    return (hang_step(args), group) if rank == args.hang_rank else None


def train(args: argparse.Namespace) -> None:
    """Run this rank's part of the job described by ``args``."""
    rank, local_rank, world_size = _env_int("RANK"), _env_int("LOCAL_RANK"), _env_int("WORLD_SIZE")
    os.environ.setdefault(FINGERPRINT_EVERY_ENV, str(DEMO_FINGERPRINT_EVERY))  # read when the hook is traced
    run_dir = RunDir(args.run_dir) if args.run_dir else None
    if run_dir is not None:
        run_dir.path.mkdir(parents=True, exist_ok=True)
    metrics, not_served = _serve_metrics(args)
    served = served_address()
    metrics_url = f"http://{served[0]}:{served[1]}/metrics" if served else None
    provider = _configure_tracing(args, run_dir, rank)

    dist.init_process_group("gloo")
    model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    hook, state = traced_hook(args.hook, _blocked_collective(args, rank, world_size), args.advise_every)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = _SyntheticData(rank)
    batches = batch_count(rank, args.steps, args.uneven)
    straggler = args.straggler_rank == rank
    delay_s = args.straggler_delay_ms / 1e3 if straggler and args.straggler_kind == "sleep" else 0.0
    factor = args.straggler_batch_factor if straggler and args.straggler_kind == "batch" else 1
    batch_size = args.batch_size * factor
    progress = ProgressWriter(run_dir, rank, batches, metrics_url, not_served) if run_dir is not None else None
    live_state = RankStateWriter(run_dir, rank, metrics) if run_dir is not None else None
    stuck_at = hang_step(args) if args.hang_rank == rank and not args.hang_inside_collective else None
    started = time.perf_counter()
    losses: list[float] = []

    accumulation = accumulation_steps(args)
    never_left = model.no_sync() if args.no_sync_bug == "never-ends" else None
    with Join([model], enable=args.uneven):
        for step in range(batches):
            inputs, targets = data.batch(batch_size)
            steps_after = (step + 1) % accumulation == 0 or step == batches - 1  # the optimizer steps after this batch
            if step % accumulation == 0:
                optimizer.zero_grad()
            with contextlib.ExitStack() as unreduced:
                if not steps_after and args.no_sync_bug != "backward-only":
                    unreduced.enter_context(model.no_sync())  # as it should be: the forward decides
                loss = nn.functional.mse_loss(model(inputs), targets)
                if delay_s:
                    time.sleep(delay_s)  # the injected straggler: slow compute between forward and backward
                if step == stuck_at:
                    threading.Event().wait()  # the injected hang: stuck for good, as a data loader can be
                if not steps_after and args.no_sync_bug == "backward-only":
                    unreduced.enter_context(model.no_sync())  # the injected bug: too late, it takes no effect
                loss.backward()
            if steps_after:
                optimizer.step()
                if never_left is not None and step + 1 == accumulation:
                    never_left.__enter__()  # the injected bug: entered after the first step, never left
            losses.append(loss.item())
            if progress is not None:
                progress.step_done(step + 1, losses[-1])
            if live_state is not None:
                live_state.step_done(step + 1)
            if rank == 0 and run_dir is None and (step + 1) % max(1, batches // 10) == 0:
                print(f"rank 0: step {step + 1}/{batches}  loss {losses[-1]:.4f}", flush=True)

    wall_s = time.perf_counter() - started
    if live_state is not None:
        live_state.finished()
    flush()
    if provider is not None:
        provider.force_flush()
    if run_dir is not None:
        result = {
            "rank": rank,
            "local_rank": local_rank,
            "group_rank": int(os.environ.get("GROUP_RANK", "0")),
            "world_size": world_size,
            "hook": args.hook,
            "batches": batches,
            "uneven": args.uneven,
            "straggler": _injected(delay_s, factor, args.batch_size),
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "wall_seconds": wall_s,
            "metrics_url": metrics_url,
            **_metrics_figures(metrics, rank),
        }
        write_json(run_dir.result(rank), result)
        _report_on_rank0(args, run_dir, result)
    wait_for_final_scrape()  # if Prometheus scrapes this rank, it reads the final figures first
    time.sleep(args.linger_s)
    dist.destroy_process_group()
    if provider is not None:
        provider.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Parse the job's flags, check them against ``WORLD_SIZE`` and train this rank."""
    # The launcher forwards Ctrl-C as SIGINT; a rank may be blocked inside a collective, where a
    # Python-level KeyboardInterrupt would wait for the peers that are stopping too: just exit.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    parser = argparse.ArgumentParser(prog="python -m tensorplay.demo.train", description=__doc__.split("\n\n")[0])
    add_job_arguments(parser)
    args = parser.parse_args(argv)
    world_size = _env_int("WORLD_SIZE")
    problem = job_problem(args, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if problem is not None:
        parser.error(problem)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
