"""Where the compression advice's work can run: a copy of the bucket, or its arithmetic, on the training thread.

The advice needs each bucket as DDP handed it over, which every hook (or its collective)
rewrites. The training thread can either compute every candidate's figures itself, before the
hook runs, or copy the bucket and leave the arithmetic to another thread. This bench measures
both on one thread, per bucket of the bench model of ``bench/training_thread_cost.py`` (a bucket
of two Linear(2048, 2048) layers, 33.6 MB after DDP's rebuild): the thread CPU of
``buffer.clone()`` and of ``candidate_figures.bucket_sums`` (what the training thread would pay
instead), each after the caches were flushed by a pass over a larger buffer, as a backward pass
leaves them. Median and interquartile range over the repetitions, the two measured alternately.

    python bench/advice_cost.py [--repeats 21] [--width 2048] [--dtype float32]
"""

import argparse
import statistics
import time
from typing import Callable

import torch

from tensorplay.telemetry.candidate_figures import bucket_sums


def _thread_ms(work: Callable[[], object], evict: torch.Tensor) -> float:
    evict.add_(1.0)  # a pass over more memory than any cache holds
    start = time.thread_time_ns()
    work()
    return (time.thread_time_ns() - start) / 1e6


def _quartiles(values: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):8.2f} ms ({q1:.2f} to {q3:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    shapes = [torch.Size((args.width,)), torch.Size((args.width, args.width))] * 2
    layout, offset = [], 0
    for shape in shapes:
        layout.append((offset, shape))
        offset += shape.numel()
    bucket = torch.randn(offset, generator=torch.Generator().manual_seed(0)).to(dtype)
    evict = torch.zeros(4 * offset)
    copies, arithmetic = [], []
    for _ in range(args.repeats):
        copies.append(_thread_ms(bucket.clone, evict))
        arithmetic.append(_thread_ms(lambda: bucket_sums(bucket, layout, 2), evict))
    size_mb = bucket.numel() * bucket.element_size() / 1e6
    print(f"one thread, a {size_mb:.1f} MB {args.dtype} bucket ({len(shapes) // 2} x Linear({args.width}, {args.width})), "
          f"{args.repeats} repetitions, thread CPU, median (IQR):")
    print(f"  copy (buffer.clone()):                     {_quartiles(copies)}")
    print(f"  every candidate's figures (bucket_sums):   {_quartiles(arithmetic)}")
    print(f"  ratio of the medians, arithmetic / copy:   {statistics.median(arithmetic) / statistics.median(copies):8.1f}")


if __name__ == "__main__":
    main()
