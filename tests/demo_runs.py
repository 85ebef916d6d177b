"""Run ``tensorplay demo`` as a user does, and the demo runs several test modules share.

:func:`start_demo` starts ``python -m tensorplay demo ...`` in a subprocess, its ranks serving
metrics on free ports of 127.0.0.1, and returns a :class:`DemoProcess` to wait on, read the run
directory of (:class:`~tensorplay.demo.rundir.RunDir`) and stop. :func:`run_demo` runs one to
completion, scraping the ranks' metrics endpoints meanwhile. Each configuration the tests need is
one session-scoped fixture (registered in ``conftest.py``), so ``test_demo.py`` and
``test_report.py`` check the same run instead of paying for two.
"""

from __future__ import annotations

import http.client
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from tensorplay.demo.rundir import RunDir

from .ranks import free_base_port
from .waiting import wait_until

__all__ = ["STRAGGLER_DELAY_MS", "Demo", "DemoProcess", "start_demo", "run_demo", "scrape", "has_sample", "two_ranks",
           "two_ranks_straggler", "three_ranks_uneven_straggler", "three_ranks_uneven", "two_ranks_never_synced"]

LINGER_S = 1.0  # the ranks keep serving metrics this long after training: time for a last scrape
RUN_TIMEOUT_S = 100.0
T = TypeVar("T")


def scrape(port: int) -> str | None:
    """The body of ``http://127.0.0.1:port/metrics``, or None if no HTTP server answers there.

    Before a rank's server listens, a connection to its port (in the ephemeral range) can be a
    TCP self-connection: the client reads back its own request (``BadStatusLine: GET /metrics``).
    That is "nothing answers" too, not a reason for the watching thread to die.
    """
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
            return response.read().decode()
    except (OSError, http.client.HTTPException):
        return None


def has_sample(body: str, name: str, **labels: str) -> bool:
    """Whether ``body`` (Prometheus text format) has a sample of ``name`` with these labels."""
    for line in body.splitlines():
        if line.startswith(name + "{"):
            if all(f'{key}="{value}"' in line.split("}")[0] for key, value in labels.items()):
                return True
    return False


@dataclass
class Demo:
    """A finished demo run: exit status, output, run dir, and what each rank's endpoint served."""

    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    scraped: dict[int, str] = field(default_factory=dict)

    def table(self) -> list[dict[str, str]]:
        """The report's per-rank rows, by column name."""
        return self._rows("rank  steps")

    def candidates(self) -> list[dict[str, str]]:
        """The report's table of the compression advice's candidates, by column name (none without advice)."""
        return self._rows("candidate  ") if "\ncandidate  " in self.stdout else []

    def _rows(self, header_start: str) -> list[dict[str, str]]:
        """The rows of the table whose header starts with ``header_start``, up to the next blank line."""
        lines = self.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(header_start))
        header = re.split(r"\s{2,}", lines[start].strip())
        rows = []
        for line in lines[start + 1:]:
            if not line.strip():
                break
            rows.append(dict(zip(header, re.split(r"\s{2,}", line.strip()))))
        return rows

    def verdict(self) -> str:
        return next(line for line in self.stdout.splitlines() if line.startswith("straggler: "))

    def communication(self) -> str:
        """The sentence on what communication costs the job's step."""
        return next(line for line in self.stdout.splitlines() if line.startswith("communication: "))


@dataclass
class DemoProcess:
    """A ``tensorplay demo`` started by :func:`start_demo`: its process, run dir, base port and output files."""

    process: subprocess.Popen
    run_dir: RunDir
    port: int
    world_size: int
    stdout_path: Path
    stderr_path: Path

    def output(self) -> str:
        """What the demo printed so far, stdout then stderr."""
        return self.stdout_path.read_text() + self.stderr_path.read_text()

    def exited(self) -> str | None:
        """Why waiting on the running demo is pointless (it exited), else None."""
        if self.process.poll() is None:
            return None
        return f"the demo exited ({self.process.returncode})"

    def wait_for(self, what: str, predicate: Callable[[], T], timeout: float) -> T:
        """Poll ``predicate`` until truthy; fail with the demo's output on timeout or once the demo exited."""
        return wait_until(predicate, timeout, what, gave_up=self.exited, details=self.output)

    def results_written(self) -> bool:
        """Whether every rank wrote its result file (after training and flushing its telemetry)."""
        return all(self.run_dir.result(rank).exists() for rank in range(self.world_size))

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> "Demo":
        """Wait for the demo to exit and return what it did; a demo still running then is stopped."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the demo did not exit in {timeout:.0f} s:\n{self.output()}")
        return Demo(self.process.returncode, self.stdout_path.read_text(), self.stderr_path.read_text(),
                    self.run_dir.path)

    def stop(self) -> None:
        """Stop a demo still running (a failed check): Ctrl-C makes the elastic agent stop every rank."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_demo(tmp_path: Path, world_size: int, *flags: str, linger_s: float = LINGER_S,
               port: int | None = None, niceness: int = 0) -> DemoProcess:
    """Start ``python -m tensorplay demo`` with its run dir and output files under ``tmp_path``.

    Its ranks serve metrics from base port ``port`` (default: free ports found now); a ``niceness``
    above 0 runs the launcher and its ranks at a lower CPU priority (``nice``).
    """
    port = free_base_port(world_size) if port is None else port
    run_dir = RunDir(tmp_path / "run")
    stdout_path, stderr_path = tmp_path / "demo.stdout", tmp_path / "demo.stderr"
    command = [*(["nice", "-n", str(niceness)] if niceness else []), sys.executable, "-m", "tensorplay", "demo",
               "--world-size", str(world_size), "--metrics-port", str(port), "--linger-s", repr(linger_s),
               "--run-dir", str(run_dir.path), *flags]
    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True)
    return DemoProcess(process, run_dir, port, world_size, stdout_path, stderr_path)


def _watch_metrics(demo: DemoProcess, scraped: dict[int, str]) -> None:
    """Scrape every rank's endpoint while the demo runs, until each served its rank's hook samples."""

    def scrape_ranks() -> bool:
        for rank in range(demo.world_size):
            body = scrape(demo.port + rank)
            if body and has_sample(body, "tensorplay_allreduce_latency_seconds_count", rank=str(rank)):
                scraped[rank] = body
        return len(scraped) == demo.world_size or demo.process.poll() is not None

    wait_until(scrape_ranks, RUN_TIMEOUT_S, "every rank's hook samples")


def run_demo(tmp_path: Path, world_size: int, *flags: str) -> Demo:
    """Run ``python -m tensorplay demo`` to completion, scraping the ranks' metrics meanwhile."""
    demo = start_demo(tmp_path, world_size, *flags)
    scraped: dict[int, str] = {}
    watcher = threading.Thread(target=_watch_metrics, args=(demo, scraped), daemon=True)
    watcher.start()
    finished = demo.finish()
    watcher.join()
    finished.scraped = scraped
    return finished


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """2 ranks, 12 steps, the default hook (fp16_compress_hook), no straggler; 2 batches per optimizer
    step, with no_sync() around the first one's backward only (it takes no effect: 2 reductions per step)."""
    return run_demo(tmp_path_factory.mktemp("two-ranks"), 2, "--steps", "12", "--accumulation-steps", "2",
                    "--no-sync-bug", "backward-only")


STRAGGLER_DELAY_MS = "100"
"""The fixtures' straggler sleeps this long per step: a job of 2 or 3 ranks names a straggler from 28-29 %
of every step (tensorplay.analysis.straggler.SMALL_JOB_SPREAD), and with 2-3 ranks sharing 2 busy cores a
step can take 100 ms, a 40 ms sleep (the demo's default) then only 30 % of it."""


@pytest.fixture(scope="session")
def two_ranks_straggler(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """2 ranks, 10 steps, allreduce_hook, rank 1 a straggler sleeping 100 ms per step."""
    return run_demo(tmp_path_factory.mktemp("two-ranks-straggler"), 2, "--steps", "10", "--straggler-rank", "1",
                    "--straggler-delay-ms", STRAGGLER_DELAY_MS, "--hook", "allreduce_hook")


@pytest.fixture(scope="session")
def three_ranks_uneven_straggler(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """3 ranks, uneven inputs (16, 20, 24 batches), rank 2 a straggler sleeping 100 ms per step. 16: the
    verdict's three blocks of the 15 steps every rank trained after the first hold 5 steps each (of 7,
    blocks of 2 steps let one odd step decide)."""
    return run_demo(tmp_path_factory.mktemp("three-ranks-uneven-straggler"), 3, "--steps", "16", "--uneven",
                    "--straggler-rank", "2", "--straggler-delay-ms", STRAGGLER_DELAY_MS)


@pytest.fixture(scope="session")
def two_ranks_never_synced(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """2 ranks, 10 steps, no_sync() entered after the first optimizer step and never left."""
    return run_demo(tmp_path_factory.mktemp("two-ranks-never-synced"), 2, "--steps", "10", "--no-sync-bug", "never-ends")


@pytest.fixture(scope="session")
def three_ranks_uneven(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """3 ranks, uneven inputs (12, 15, 18 batches), no straggler."""
    return run_demo(tmp_path_factory.mktemp("three-ranks-uneven"), 3, "--steps", "12", "--uneven")
