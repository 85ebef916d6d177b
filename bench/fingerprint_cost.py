"""What a replica fingerprint costs the training thread: per call, and per optimizer step at the default interval.

A fingerprint (tensorplay/telemetry/fingerprint.py) gathers 64 elements of every parameter and
hashes them; replica_sync takes one right after every ``TENSORPLAY_FINGERPRINT_EVERY``-th
optimizer step (default 100), on the training thread (CPU: the gather and the hash; CUDA: the
gather and an asynchronous copy, the hash at a later step). Two parameter sets:

* the demo's MLP (tensorplay/demo/train.py: 6 layers, 12 tensors, 0.65 M elements), beside its own
  optimizer step (forward, backward, Adam step of one process, batch 32), so the cost reads as a
  share of a step;
* 1e9 elements in the shapes of a 1-billion-parameter transformer (an embedding and 18 blocks of
  attention and MLP matrices with their biases and norms: 183 tensors, 1.01e9 elements) of
  float32, "simulated by size": the tensors are allocated (``torch.empty``) but never written, so
  they hold no memory beyond the pages the sample reads (the cost of a sample of 64 elements per
  tensor does not depend on the size of the tensor, nor on its values).

Per set, the thread CPU time and the wall time of one fingerprint (sample and hash, with the
sampled indices made once, as replica_sync keeps them; and the first call, which makes them),
median and interquartile range over ``--calls`` calls; then that per-call time divided by the
default interval, i.e. what each optimizer step pays on average. The CUDA path's training-thread
part (the gather and the launch of the copy) is measured too where a GPU is present.

Last, what counting costs each optimizer step (torch's global step hooks, fingerprints at the
default interval): on one gloo rank, the demo's MLP twice, each in DDP with Adam, one with
``traced(allreduce_hook)`` (metrics on, spans recorded by an SDK provider), one with the plain
hook; the thread CPU of each ``optimizer.step()``, the two alternating step by step; the difference
of the medians, with each one's IQR (it is within their spread); then replica_sync's two step
hooks alone, timed around direct calls after each backward (each call counts a reduced step, the
usual one: no span); then the same hooks called a second time after a backward, which counts an
unreduced step, the one step that has a span of its own (handed to ``tensorplay-finisher``).

    python bench/fingerprint_cost.py [--calls 200]
"""

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorplay import traced  # noqa: E402
from tensorplay.demo.train import make_model  # noqa: E402
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from tensorplay.telemetry import enable_metrics, flush, replica_sync  # noqa: E402
from tensorplay.telemetry.fingerprint import sample_indices, take_sample  # noqa: E402
from tensorplay.telemetry.replica_sync import DEFAULT_FINGERPRINT_EVERY  # noqa: E402

HIDDEN, FFN, VOCAB, BLOCKS = 2048, 8192, 50257, 18


def billion_shapes() -> list[tuple[int, ...]]:
    """A 1e9-element transformer's parameter shapes: embedding, then per block QKV, projection, two MLP
    matrices with their biases, and two norms (weight and bias)."""
    shapes: list[tuple[int, ...]] = [(VOCAB, HIDDEN)]
    for _ in range(BLOCKS):
        shapes += [(3 * HIDDEN, HIDDEN), (3 * HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (FFN, HIDDEN), (FFN,),
                   (HIDDEN, FFN), (HIDDEN,), (HIDDEN,), (HIDDEN,)]
    shapes += [(HIDDEN,), (HIDDEN,)]
    return shapes


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return median, q1, q3


def _timed(call: Callable[[], object], calls: int) -> tuple[list[float], list[float]]:
    """Thread CPU and wall seconds of each of ``calls`` calls."""
    cpu, wall = [], []
    for _ in range(calls):
        started_cpu, started = time.thread_time_ns(), time.perf_counter_ns()
        call()
        wall.append((time.perf_counter_ns() - started) / 1e9)
        cpu.append((time.thread_time_ns() - started_cpu) / 1e9)
    return cpu, wall


def fingerprint_once(parameters: list[torch.Tensor], indices: list[torch.Tensor]) -> int:
    """One fingerprint as replica_sync takes it on CPU: the sample, then its hash."""
    return take_sample(parameters, indices).value()


def demo_step_seconds(calls: int) -> list[float]:
    """Thread CPU seconds of one optimizer step of the demo's MLP (forward, backward, Adam), one process."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(32, 128), torch.randn(32, 16)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()

    for _ in range(10):
        step()
    return _timed(step, calls)[0]


def report(name: str, parameters: list[torch.Tensor], calls: int, step_s: float | None) -> None:
    numel = sum(p.numel() for p in parameters)
    started = time.thread_time_ns()
    indices = [sample_indices(p.numel(), p.device) for p in parameters]
    fingerprint_once(parameters, indices)
    first_ms = (time.thread_time_ns() - started) / 1e6
    cpu, wall = _timed(lambda: fingerprint_once(parameters, indices), calls)
    (median, q1, q3), (wall_median, _, _) = _quartiles(cpu), _quartiles(wall)
    per_step_ms = 1e3 * median / DEFAULT_FINGERPRINT_EVERY
    print(f"{name}: {len(parameters)} tensors, {numel:.3g} elements")
    print(f"  per fingerprint, thread CPU: {1e3 * median:.3f} ms (IQR {1e3 * q1:.3f} - {1e3 * q3:.3f}), "
          f"wall {1e3 * wall_median:.3f} ms; the first call (indices made): {first_ms:.3f} ms")
    line = f"  at the default interval ({DEFAULT_FINGERPRINT_EVERY} steps): {1e3 * per_step_ms:.2f} us per optimizer step"
    if step_s is not None:
        line += f", {100 * per_step_ms / (1e3 * step_s):.3f} % of the step ({1e3 * step_s:.2f} ms thread CPU, median)"
        line += f"; at every step: {100 * median / step_s:.2f} %"
    print(line)


def report_cuda(name: str, shapes: list[tuple[int, ...]], calls: int) -> None:
    """The training thread's part of a CUDA fingerprint: the gather and the launch of the copy (no wait)."""
    parameters = [torch.empty(shape, device="cuda") for shape in shapes]
    indices = [sample_indices(p.numel(), p.device) for p in parameters]
    take_sample(parameters, indices)
    torch.cuda.synchronize()
    cpu, _ = _timed(lambda: take_sample(parameters, indices), calls)
    torch.cuda.synchronize()
    median, q1, q3 = _quartiles(cpu)
    print(f"{name} on CUDA, training thread (gather, copy launched): {1e3 * median:.3f} ms (IQR {1e3 * q1:.3f} - "
          f"{1e3 * q3:.3f}); per optimizer step at the default interval {1e6 * median / DEFAULT_FINGERPRINT_EVERY:.2f} us")


class _Dropping(SpanExporter):
    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def counting_cost(steps: int) -> None:
    """Thread CPU of optimizer.step() over a traced DDP model against the same over an untraced one."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    enable_metrics(serve=False)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Dropping()))
    trace.set_tracer_provider(provider)
    inputs, targets = torch.randn(32, 128), torch.randn(32, 16)
    setups = {}
    for name, hook in (("untraced", allreduce_hook), ("traced", traced(allreduce_hook))):
        model = DDP(make_model())
        model.register_comm_hook(None, hook)
        setups[name] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
    seconds: dict[str, list[float]] = {name: [] for name in setups}
    for step in range(steps + 10):
        for name in (list(setups) if step % 2 else list(reversed(setups))):
            model, optimizer = setups[name]
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            started = time.thread_time_ns()
            optimizer.step()
            if step >= 10:
                seconds[name].append((time.thread_time_ns() - started) / 1e9)
    # The two hooks alone, called as torch calls them around a step (private names: a bench's look inside).
    model, optimizer = setups["traced"]
    hooks_s: dict[str, list[float]] = {"reduced": [], "unreduced": []}
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        for kind in hooks_s:  # the second step after one backward has no reduction since the first
            started = time.thread_time_ns()
            replica_sync._before_step(optimizer, (), {})
            replica_sync._after_step(optimizer, (), {})
            hooks_s[kind].append((time.thread_time_ns() - started) / 1e9)
    flush(10)
    (untraced, u1, u3), (traced_s, t1, t3) = _quartiles(seconds["untraced"]), _quartiles(seconds["traced"])
    (hooks, h1, h3), (unreduced, r1, r3) = _quartiles(hooks_s["reduced"]), _quartiles(hooks_s["unreduced"])
    print(f"counting, per optimizer step of the demo's MLP (Adam), thread CPU: untraced model {1e6 * untraced:.1f} us "
          f"(IQR {1e6 * u1:.1f} - {1e6 * u3:.1f}), traced {1e6 * traced_s:.1f} us (IQR {1e6 * t1:.1f} - {1e6 * t3:.1f}): "
          f"{1e6 * (traced_s - untraced):+.1f} us per step; the step hooks alone: {1e6 * hooks:.1f} us "
          f"(IQR {1e6 * h1:.1f} - {1e6 * h3:.1f}), {100 * hooks / untraced:.2f} % of the untraced step; "
          f"an unreduced step's, with its span: {1e6 * unreduced:.1f} us (IQR {1e6 * r1:.1f} - {1e6 * r3:.1f})")
    dist.destroy_process_group()
    provider.shutdown()


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the process group's store)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    step_s = statistics.median(demo_step_seconds(args.calls))
    report("demo MLP", list(make_model().parameters()), args.calls, step_s)
    shapes = billion_shapes()
    billion = [torch.empty(shape) for shape in shapes]  # never written: no memory beyond the sampled pages
    report("1e9 elements (transformer shapes, simulated by size)", billion, args.calls, None)
    if torch.cuda.is_available():
        report_cuda("demo MLP", [tuple(p.shape) for p in make_model().parameters()], args.calls)
        report_cuda("1e9 elements", shapes, args.calls)
    del billion
    counting_cost(args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
