"""The ``tensorplay`` command: ``tensorplay demo`` runs a local multi-rank DDP job and reports on it;
``tensorplay report RUN_DIR`` draws a run's spans as an HTML page."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from tensorplay.report.cli import add_report_command, demo_report_line, report_command

from .hang import EXIT_HUNG, HangWatch
from .launch import Interrupted, RanksFailed, launch_ranks
from .options import add_job_arguments, job_argv, job_problem
from .progress import ProgressDisplay
from .rundir import RunDir

__all__ = ["main", "build_parser"]

DEFAULT_WORLD_SIZE = 2
DEMO_METRICS_ADDR = "127.0.0.1"
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """The ``tensorplay`` argument parser with its ``demo`` and ``report`` subcommands."""
    parser = argparse.ArgumentParser(prog="tensorplay", description="Observable DDP communication hooks and Join.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a local multi-rank DDP job with traced hooks and report on it",
        description="Train a small MLP with DDP on local gloo ranks, the chosen hook traced, serve each rank's "
                    "metrics, export the spans, and print a per-rank report with a straggler verdict.",
    )
    demo.add_argument("--world-size", type=int, default=DEFAULT_WORLD_SIZE, metavar="N",
                      help=f"ranks to start on this machine (default {DEFAULT_WORLD_SIZE})")
    add_job_arguments(demo)
    demo.set_defaults(metrics_addr=DEMO_METRICS_ADDR, usage_error=demo.error)
    add_report_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``tensorplay`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        return report_command(args)
    if args.command != "demo":
        parser.print_help(sys.stderr)
        return 2
    return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    """Check the flags, run the ranks with a progress line, print the report."""
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
        if hang_watch.report is not None:
            print("\n" + hang_watch.report.render(), flush=True)
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
        print(f"spans were also exported over OTLP to {args.otlp_endpoint}")
    print(demo_report_line(run_dir.path))
    return 0
