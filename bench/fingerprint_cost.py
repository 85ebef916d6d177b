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

    python bench/fingerprint_cost.py [--calls 200]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorplay.demo.train import make_model  # noqa: E402
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
