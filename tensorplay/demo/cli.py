"""The ``tensorplay demo`` subcommand: its flags, and running a local multi-rank DDP job with a report.

The ``tensorplay`` command itself (both subcommands) is :mod:`tensorplay.cli`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .hang import EXIT_HUNG, HangWatch
from .launch import Interrupted, RanksFailed, launch_ranks
from .options import add_job_arguments, job_argv, job_problem
from .progress import ProgressDisplay
from .rundir import RunDir

__all__ = ["add_demo_command", "demo_command"]

DEFAULT_WORLD_SIZE = 2
DEMO_METRICS_ADDR = "127.0.0.1"
EXIT_INTERRUPTED = 130


def add_demo_command(commands: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand to the ``tensorplay`` parser's subcommands."""
    demo = commands.add_parser(
        "demo",
        help="run a local multi-rank DDP job with traced hooks and report on it",
        description="Train a small MLP with DDP on local gloo ranks, the chosen hook traced, serve each rank's "
                    "metrics, export the spans, and print a per-rank report with a straggler verdict.",
    )
    demo.add_argument("--world-size", type=int, default=DEFAULT_WORLD_SIZE, metavar="N",
                      help=f"ranks to start on this machine (default {DEFAULT_WORLD_SIZE})")
    add_job_arguments(demo, metrics_addr=DEMO_METRICS_ADDR)
    demo.set_defaults(usage_error=demo.error)


def demo_command(args: argparse.Namespace, html_report: Callable[[Path], str]) -> int:
    """Check the flags, run the ranks with a progress line, print the report; return the exit status.

    ``html_report(run_dir)`` writes the run's HTML page and returns the line that says where it is.
    """
    if args.world_size < 1:
        args.usage_error(f"--world-size must be at least 1, got {args.world_size}")
    problem = job_problem(args, args.world_size, args.world_size)
    if problem is not None:
        args.usage_error(problem)
    if args.run_dir is None:
        args.run_dir = tempfile.mkdtemp(prefix="tensorplay-demo-")
    args.run_dir = os.path.abspath(args.run_dir)
    run_dir = RunDir(args.run_dir)
    if not run_dir.is_unused():
        args.usage_error(f"--run-dir {args.run_dir} must be a new or empty directory")
    run_dir.path.mkdir(parents=True, exist_ok=True)

    print(f"tensorplay demo: {args.world_size} ranks x {args.steps} steps, traced({args.hook}), gloo on 127.0.0.1; "
          f"run dir {run_dir.path}", file=sys.stderr, flush=True)
    hang_watch = HangWatch(run_dir, args.world_size, args.stall_timeout_s)
    try:
        with ProgressDisplay(run_dir, args.world_size), hang_watch:
            launch_ranks(args.world_size, job_argv(args), run_dir)
    except Interrupted:
        if hang_watch.report is not None:  # printed before the ranks were stopped
            print(f"every rank stopped (exit status {EXIT_HUNG})", flush=True)
            return EXIT_HUNG
        print("\ntensorplay demo: interrupted; every rank stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RanksFailed as failure:
        print(f"\ntensorplay demo: {failure}", file=sys.stderr)
        return 1
    if not run_dir.report.exists():
        print(f"\ntensorplay demo: rank 0 wrote no report ({run_dir.report}); see the rank logs in {run_dir.logs}",
              file=sys.stderr)
        return 1
    print(run_dir.report.read_text(encoding="utf-8"), end="")
    print(f"rank logs: {run_dir.logs}")
    if args.otlp_endpoint:
        print(_otlp_outcome(args.otlp_endpoint, run_dir))
    print(html_report(run_dir.path))
    return 0


def _otlp_outcome(endpoint: str, run_dir: RunDir) -> str:
    """Whether the spans reached ``endpoint``, as the ranks' own count of failed exports says.

    Each rank counts its failed exports (``tensorplay_telemetry_errors_total{reason="span_export_failed"}``)
    and leaves the count in its result once its spans of training are flushed.
    """
    failed: dict[int, int] = {}
    for rank, result in run_dir.results().items():
        if result.get("span_exports_failed"):
            failed[rank] = int(result["span_exports_failed"])
    if not failed:
        return f"spans were also exported over OTLP to {endpoint}"
    ranks = ", ".join(str(rank) for rank in sorted(failed))
    count = sum(failed.values())
    return (f"spans did not all reach {endpoint} over OTLP: {count} export{'s' if count > 1 else ''} failed "
            f"on rank{'s' if len(failed) > 1 else ''} {ranks}; the rank logs in {run_dir.logs} say why")
