"""How often the demo's straggler verdict is wrong: plain runs named a straggler, injected ones missed.

Runs ``tensorplay demo`` one run after another (never two at once): ``--plain`` runs with nothing
injected, then ``--injected`` runs with ``--straggler-rank 1 --straggler-delay-ms DELAY`` (about one
healthy step's length at the default 15 ms). For each run it keeps the verdict line and prints the
tallies: plain runs that named a rank (false stragglers) and injected runs that named rank 1, with
each run's highest share and median lateness as the verdict words them. The machine is whatever
it is: run it on a loaded one to see what contention does.

Run from the repository root::

    python bench/false_stragglers.py --plain 30 --injected 10
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


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


def _named(verdict: str) -> int | None:
    found = re.match(r"straggler: rank (\d+) ", verdict)
    return int(found.group(1)) if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", type=int, default=30, help="runs with nothing injected (default 30)")
    parser.add_argument("--injected", type=int, default=10, help="runs with rank 1 sleeping (default 10)")
    parser.add_argument("--delay-ms", type=float, default=15.0, help="the injected sleep per step (default 15)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40, the demo's)")
    args = parser.parse_args()

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
    print(f"false stragglers: {false_stragglers} of {args.plain} plain runs; "
          f"rank 1 sleeping {args.delay_ms:g} ms per step named in {named} of {args.injected}; "
          f"{failed} runs failed ({args.steps} steps, 2 ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
