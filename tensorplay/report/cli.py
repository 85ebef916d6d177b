"""The ``tensorplay report RUN_DIR`` command, and the line ``tensorplay demo`` ends with."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tensorplay.analysis.span_reader import NoSpans

from .build import INSTALL_HINT, ReportUnavailable, write_report

__all__ = ["add_report_command", "report_command", "demo_report_line", "EXIT_BAD_INPUT"]

EXIT_BAD_INPUT = 2


def add_report_command(commands: argparse._SubParsersAction) -> None:
    """Add the ``report`` subcommand to the ``tensorplay`` parser's subcommands."""
    report = commands.add_parser(
        "report",
        help="draw a run's spans as one self-contained HTML page",
        description="Read the span files (*.jsonl) of a run - tensorplay demo's run directory, or any job's "
                    "configure_tracing(span_file='spans-rank{rank}.jsonl') - and write one HTML page of figures: compute per step per "
                    "rank, busy time and exposed communication, allreduce latency heatmaps, bytes per hook, compression "
                    "error, what another hook would give (the compression advice), Join, and the straggler "
                    f"verdict. Needs matplotlib ({INSTALL_HINT}). Exit status 2 when some input could not be "
                    "read or is missing: a rank of the job with no spans, which the verdict cannot judge (what "
                    "could be read is still drawn).",
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory, or one span file")
    report.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="where to write the page (default RUN_DIR/report.html)")


def report_command(args: argparse.Namespace) -> int:
    """Write the report of ``args.run_dir``; say what could not be read; return the exit status."""
    if args.out is not None and not args.out.absolute().parent.is_dir():  # refused before any reading
        print(f"tensorplay report: --out {args.out}: no directory {args.out.absolute().parent} to write it in",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        report, out = write_report(args.run_dir, args.out)
    except ReportUnavailable as error:
        print(f"tensorplay report: {error}", file=sys.stderr)
        return 1
    except NoSpans as error:
        print(f"tensorplay report: nothing to draw: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as error:
        print(f"tensorplay report: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for problem in report.problems:
        print(f"tensorplay report: {problem}", file=sys.stderr)
    for line in report.verdict_lines() + report.communication_lines() + report.sync.lines():
        print(line)
    print(f"report: {out}")
    return EXIT_BAD_INPUT if report.problems else 0


def demo_report_line(run_dir: Path) -> str:
    """Write the demo's HTML report and say where it is, or how to get one; never raises."""
    try:
        _, out = write_report(run_dir)
    except ReportUnavailable:
        return f"HTML report: {INSTALL_HINT}, then tensorplay report {run_dir}"
    except Exception as error:  # noqa: BLE001  (the demo never fails because of its report)
        return f"HTML report: not written ({type(error).__name__}: {error})"
    return f"HTML report: {out}"
