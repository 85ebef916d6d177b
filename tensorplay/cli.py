"""The ``tensorplay`` command: ``tensorplay demo`` runs a local multi-rank DDP job and reports on it;
``tensorplay report RUN_DIR`` draws a run's spans as an HTML page.

Each subcommand lives with what it runs (:mod:`tensorplay.demo.cli`, :mod:`tensorplay.report.cli`);
this module only puts them together, so neither package imports the other.
"""

from __future__ import annotations

import argparse
import sys

from tensorplay.demo.cli import add_demo_command, demo_command
from tensorplay.report.cli import add_report_command, demo_report_line, report_command

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``tensorplay`` argument parser with its ``demo`` and ``report`` subcommands."""
    parser = argparse.ArgumentParser(prog="tensorplay", description="Observable DDP communication hooks and Join.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_demo_command(commands)
    add_report_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``tensorplay`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        return report_command(args)
    if args.command == "demo":
        return demo_command(args, demo_report_line)
    parser.print_help(sys.stderr)
    return 2
