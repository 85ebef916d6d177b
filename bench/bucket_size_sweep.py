"""Step time and exposed communication of the demo's model for each DDP bucket size, side by side in one run.

The data a user picks ``bucket_cap_mb`` from. 2 gloo ranks train the model of ``tensorplay demo``
(``tensorplay.demo.train.make_model``: an MLP of 2.6 MB of float32 gradients, batch 32, Adam) with
``traced(hook)`` (no advice, error sampling off: the step timeline alone). Each round trains a fresh
DDP model of every bucket size in turn -- the order rotating round by round, so that a load that
drifts over the run falls on every size alike -- for ``--warmup`` steps (DDP rebuilds its buckets
after the first) and then ``--steps`` measured steps, whose closing spans carry each iteration's busy
time, exposed communication and communication (docs/telemetry.md, "Busy time and exposed
communication").

Per size, at every measured step, the figures of the rank the other waits for (the least exposed
communication at that step, as the job's figure is defined): the step (busy + exposed), the exposed
communication, the communication and the share of it hidden, 1 - exposed / communication; medians
and IQR over every measured step of every round. And, measured side by side, each round's median step
over that round's median step at ``--reference`` MB (DDP's default, 25): median and range over rounds.

    python bench/bucket_size_sweep.py [--sizes 0.1,0.25,1,5,25,100] [--rounds 5] [--steps 30] [--warmup 3]
                                      [--hook allreduce_hook]
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.ranks import run_ranks  # noqa: E402

HOOKS = ("allreduce_hook", "fp16_compress_hook")
BATCH = 32


def sweep(rank: int, world_size: int, sizes: list[float], rounds: int, steps: int, warmup: int,
          hook_name: str) -> list[dict]:
    """This rank's measured iterations: one row per (round, size, step) with its step figures (ms)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tensorplay.demo.train import IN_FEATURES, OUT_FEATURES, make_model
    from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
    from tensorplay.telemetry import flush
    from tensorplay.telemetry.names import Attr

    from tests.sink import memory_sink

    sink = memory_sink()
    inputs = torch.Generator().manual_seed(rank)
    teacher = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(1234))
    rows = []
    for round_ in range(rounds):
        shift = round_ % len(sizes)
        for size in sizes[shift:] + sizes[:shift]:
            model = DDP(make_model(), bucket_cap_mb=size)
            model.register_comm_hook(None, sink.traced(getattr(default_hooks, hook_name), error_every=0, advise_every=0))
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            for _ in range(warmup + steps):
                batch = torch.randn(BATCH, IN_FEATURES, generator=inputs)
                optimizer.zero_grad()
                nn.functional.mse_loss(model(batch), torch.tanh(batch @ teacher)).backward()
                optimizer.step()
            assert flush(30)
            spans = [dict(span.attributes) for span in sink.finished()]
            sink.exporter.clear()
            buckets = 1 + max(span[Attr.BUCKET_INDEX] for span in spans if span[Attr.STEP] == warmup + steps - 1)
            for span in spans:
                if span[Attr.STEP] >= warmup and Attr.STEP_EXPOSED_COMMUNICATION_MS in span:
                    rows.append({"round": round_, "size": size, "step": span[Attr.STEP], "buckets": buckets,
                                 "busy": span[Attr.STEP_BUSY_MS], "exposed": span[Attr.STEP_EXPOSED_COMMUNICATION_MS],
                                 "communication": span[Attr.STEP_COMMUNICATION_MS]})
    return rows


def _spread(values: list[float], digits: int = 2) -> str:
    """Median (first quartile-third quartile)."""
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{statistics.median(values):.{digits}f} ({quartiles[0]:.{digits}f}-{quartiles[2]:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.1,0.25,1,5,25,100", help="bucket_cap_mb values, comma-separated")
    parser.add_argument("--reference", type=float, default=25.0, help="the size the step ratios are taken against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hook", choices=HOOKS, default="allreduce_hook")
    args = parser.parse_args()
    sizes = [float(size) for size in args.sizes.split(",")]
    if args.reference not in sizes:
        parser.error(f"--reference {args.reference:g} is not among --sizes")
    load = os.getloadavg()[0]
    per_rank = run_ranks(sweep, 2, sizes, args.rounds, args.steps, args.warmup, args.hook, timeout=3600)

    # Per (size, round, step), the job's figures: those of the rank with the least exposed communication.
    job: dict[tuple[float, int, int], dict] = {}
    for rows in per_rank:
        for row in rows:
            key = (row["size"], row["round"], row["step"])
            if key not in job or row["exposed"] < job[key]["exposed"]:
                job[key] = row
    print(f"2 gloo ranks, the demo's model (2.6 MB of float32 gradients), batch {BATCH}, traced({args.hook}); "
          f"{args.rounds} rounds x {args.steps} measured steps per size after {args.warmup} warm-up steps, the sizes "
          f"in rotating order; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("per step, the figures of the rank the other waits for (the least exposed communication); ms, median (IQR)")
    print(f"{'bucket_cap_mb':>13}  {'buckets':>7}  {'step':>20}  {'exposed':>20}  {'communication':>20}  "
          f"{'hidden %':>12}  {'exposed % of step':>17}  step / {args.reference:g} MB's (per round)")
    reference = {round_: statistics.median(row["busy"] + row["exposed"] for (size, r, _), row in job.items()
                                           if size == args.reference and r == round_) for round_ in range(args.rounds)}
    for size in sizes:
        rows = [row for (s, _, _), row in job.items() if s == size]
        steps = [row["busy"] + row["exposed"] for row in rows]
        hidden = [100 * max(0.0, 1 - row["exposed"] / row["communication"]) for row in rows if row["communication"] > 0]
        shares = [100 * row["exposed"] / (row["busy"] + row["exposed"]) for row in rows]
        ratios = [statistics.median(row["busy"] + row["exposed"] for (s, r, _), row in job.items()
                                    if s == size and r == round_) / reference[round_] for round_ in range(args.rounds)]
        buckets = sorted({row["buckets"] for row in rows})
        print(f"{size:13g}  {','.join(map(str, buckets)):>7}  {_spread(steps):>20}  "
              f"{_spread([row['exposed'] for row in rows]):>20}  {_spread([row['communication'] for row in rows]):>20}  "
              f"{_spread(hidden, 0):>12}  {_spread(shares, 0):>17}  "
              f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
