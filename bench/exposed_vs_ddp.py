"""tensorplay's exposed communication against DDP's own timers, iteration by iteration.

Runs tests/test_step_timeline.py's ``ddp_comparison`` (2 gloo ranks; rank 1 computes its last
bucket's gradients ``--sleep-ms`` late, so rank 0 waits for it in its last collective) ``--runs``
times, and prints per rank, over every compared iteration: tensorplay's exposed communication
(the last hook call to the last hook future done), DDP's (``backward_comm_time_end -
backward_compute_time_end`` of ``_get_ddp_logging_data()``, sample rate 1), their difference, and
the two gaps that make it up on the one wall clock both read: how long after tensorplay's last hook
call DDP's backward compute ended, and how long after the last hook future DDP's wait returned;
and how much of tensorplay's exposed communication lies past the step's end (busy + exposed -
the step tensorplay_step_seconds_total counts). Medians, with the IQR and the largest.

    python bench/exposed_vs_ddp.py [--runs 5] [--steps 8] [--sleep-ms 100]
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.ranks import run_ranks  # noqa: E402
from tests.test_step_timeline import ddp_comparison  # noqa: E402

COLUMNS = {
    "tensorplay": lambda row: row["ours_ms"],
    "DDP": lambda row: row["ddp_ms"],
    "difference": lambda row: row["ours_ms"] - row["ddp_ms"],
    "|difference|": lambda row: abs(row["ours_ms"] - row["ddp_ms"]),
    "call -> DDP compute end": lambda row: row["called_before_ms"],
    "last future -> DDP comm end": lambda row: row["done_before_ms"],
    "busy + exposed - step": lambda row: row["after_step_ms"],
}


def _summary(values: list[float]) -> str:
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{statistics.median(values):8.2f} ({quartiles[0]:.2f} to {quartiles[2]:.2f}; max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sleep-ms", type=float, default=100.0)
    args = parser.parse_args()
    rows: dict[int, list[dict]] = {0: [], 1: []}
    for _ in range(args.runs):
        for rank, compared in enumerate(run_ranks(ddp_comparison, 2, args.steps, args.sleep_ms / 1e3)):
            rows[rank] += compared
    print(f"2 gloo ranks, rank 1 {args.sleep_ms:g} ms late at its last bucket; {args.runs} runs x "
          f"{args.steps - 1} iterations per rank; ms, median (IQR; max)")
    for rank, compared in rows.items():
        print(f"rank {rank} ({'waits for rank 1' if rank == 0 else 'the rank waited for'}), {len(compared)} iterations")
        for name, column in COLUMNS.items():
            print(f"  {name:30s} {_summary([column(row) for row in compared])}")


if __name__ == "__main__":
    main()
