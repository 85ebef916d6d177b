"""The ``tensorplay`` command: ``tensorplay demo`` runs a local multi-rank DDP job and reports on it;
``tensorplay report RUN_DIR`` draws a run's spans as an HTML page.

Each subcommand lives with what it runs (:mod:`tensorplay.demo.cli`, :mod:`tensorplay.report.cli`);
this module only puts them together, so neither package imports the other.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from tensorplay.demo.cli import add_demo_command, demo_command
from tensorplay.report.cli import add_report_command, demo_report_line, report_command

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``tensorplay`` argument parser with its ``demo`` and ``report`` subcommands."""
    parser = argparse.ArgumentParser(prog="tensorplay", description="Observable DDP communication hooks and Join.")
    parser.add_argument("--version", action="version", version=f"tensorplay {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_demo_command(commands)
    add_report_command(commands)
    for command in commands.choices.values():
        command.set_defaults(usage_error=command.error)  # a subcommand's mistakes get its own usage
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("tensorplay")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    """Run the ``tensorplay`` command line; returns the exit status."""
    parser = build_parser()
    # Flags the subcommand does not know are left over here, not refused by the top-level parser,
    # which would print its own usage for a mistake made in the subcommand's.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "usage_error", parser.error)(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "report":
        return report_command(args)
    if args.command == "demo":
        return demo_command(args, demo_report_line)
    parser.print_help(sys.stderr)
    return 2
