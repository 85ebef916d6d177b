"""How often the demo's straggler verdict is wrong: plain runs named a straggler, injected ones missed.

Runs ``tensorplay demo`` one run after another (never two at once): ``--plain`` runs with nothing
injected, then ``--injected`` runs with ``--straggler-rank 1 --straggler-delay-ms DELAY`` (about one
healthy step's length at the default 15 ms). For each run it keeps the verdict line and prints the
tallies: plain runs that named a rank (false stragglers) and injected runs that named rank 1, with
each run's highest share and median lateness as the verdict words them. ``--load N`` loads the
machine the same way every time: a ``tensorplay demo --world-size N`` trains beside the runs for
as long as they last (N busy processes: on a 2-core machine, 3 of them and the run's 2 ranks share
the cores); without it the machine is whatever it is.

Run from the repository root::

    python bench/false_stragglers.py --plain 30 --injected 10 --load 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator


def _free_base_port(count: int) -> int:
    """A port P with P..P+count-1 free now on 127.0.0.1 (the demo's ranks serve there)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            sockets = [socket.socket() for _ in range(count)]
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()


def _verdict(flags: list[str], steps: int) -> str:
    """Run one demo to completion and return its verdict line (or why there is none)."""
    with tempfile.TemporaryDirectory(prefix="tensorplay-bench-") as tmp:
        command = [sys.executable, "-m", "tensorplay", "demo", "--steps", str(steps), "--linger-s", "0",
                   "--metrics-port", str(_free_base_port(2)), "--run-dir", str(Path(tmp) / "run"), *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("straggler: ")]
    if done.returncode != 0 or not lines:
        return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:] }"
    return lines[0]


@contextlib.contextmanager
def _loaded(world_size: int) -> Iterator[None]:
    """A ``tensorplay demo`` of ``world_size`` ranks training beside the runs (none for 0)."""
    if world_size <= 0:
        yield
        return
    # The killed ranks may still be closing their files as the folder goes: not the bench's failure.
    with tempfile.TemporaryDirectory(prefix="tensorplay-load-", ignore_cleanup_errors=True) as tmp:
        load = subprocess.Popen(
            [sys.executable, "-m", "tensorplay", "demo", "--world-size", str(world_size), "--steps", "100000000",
             "--linger-s", "0", "--metrics-port", str(_free_base_port(world_size)), "--run-dir", str(Path(tmp) / "run")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            yield
        finally:
            # Ctrl-C, as a user stops a demo: it stops every rank it started (a SIGKILL of the
            # launcher's group would not reach ranks in sessions of their own).
            load.send_signal(signal.SIGINT)
            try:
                load.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(load.pid, signal.SIGKILL)
                load.wait()


def _named(verdict: str) -> int | None:
    found = re.match(r"straggler: rank (\d+) ", verdict)
    return int(found.group(1)) if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", type=int, default=30, help="runs with nothing injected (default 30)")
    parser.add_argument("--injected", type=int, default=10, help="runs with rank 1 sleeping (default 10)")
    parser.add_argument("--delay-ms", type=float, default=15.0, help="the injected sleep per step (default 15)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40, the demo's)")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="train a demo of N ranks beside the runs (default 0: no load of the bench's own)")
    args = parser.parse_args()
    with _loaded(args.load):
        return _tally(args)


def _tally(args: argparse.Namespace) -> int:
    """Run the plain runs, then the injected ones; print each verdict and the tallies."""
    false_stragglers = failed = 0
    for run in range(args.plain):
        verdict = _verdict([], args.steps)
        failed += verdict.startswith("failed")
        false_stragglers += _named(verdict) is not None
        print(f"plain {run + 1}/{args.plain}: {verdict}", flush=True)
    named = 0
    for run in range(args.injected):
        verdict = _verdict(["--straggler-rank", "1", "--straggler-delay-ms", f"{args.delay_ms:g}"], args.steps)
        failed += verdict.startswith("failed")
        named += _named(verdict) == 1
        print(f"injected {run + 1}/{args.injected}: {verdict}", flush=True)
    load = f"a {args.load}-rank demo beside them" if args.load else "none of the bench's own"
    print(f"false stragglers: {false_stragglers} of {args.plain} plain runs; "
          f"rank 1 sleeping {args.delay_ms:g} ms per step named in {named} of {args.injected}; "
          f"{failed} runs failed ({args.steps} steps, 2 ranks; load: {load})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
