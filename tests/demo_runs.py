"""Run ``tensorplay demo`` as a user does, and the demo runs several test modules share.

:func:`run_demo` runs ``python -m tensorplay demo ...`` in a subprocess to completion, scraping
the ranks' metrics endpoints meanwhile. Each configuration the tests need is one session-scoped
fixture (registered in ``conftest.py``), so ``test_demo.py`` and ``test_report.py`` check the
same run instead of paying for two.
"""

from __future__ import annotations

import http.client
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .ranks import free_base_port

__all__ = ["Demo", "run_demo", "scrape", "has_sample", "two_ranks", "two_ranks_straggler",
           "three_ranks_uneven_straggler", "three_ranks_uneven"]

LINGER_S = "1.0"  # the ranks keep serving metrics this long after training: time for a last scrape


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
        lines = self.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank  steps"))
        header = re.split(r"\s{2,}", lines[start].strip())
        rows = []
        for line in lines[start + 1:]:
            if not line.strip():
                break
            rows.append(dict(zip(header, re.split(r"\s{2,}", line.strip()))))
        return rows

    def verdict(self) -> str:
        return next(line for line in self.stdout.splitlines() if line.startswith("straggler: "))


def _watch_metrics(process: subprocess.Popen, base_port: int, world_size: int, scraped: dict[int, str]) -> None:
    """Scrape every rank's endpoint while the demo runs, until each served its rank's hook samples."""
    while process.poll() is None and len(scraped) < world_size:
        for rank in range(world_size):
            body = scrape(base_port + rank)
            if body and has_sample(body, "tensorplay_allreduce_latency_seconds_count", rank=str(rank)):
                scraped[rank] = body
        time.sleep(0.2)


def run_demo(tmp_path: Path, world_size: int, *flags: str) -> Demo:
    """Run ``python -m tensorplay demo`` to completion, scraping the ranks' metrics meanwhile."""
    port = free_base_port(world_size)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "tensorplay", "demo", "--world-size", str(world_size),
               "--metrics-port", str(port), "--linger-s", LINGER_S, "--run-dir", str(run_dir), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    scraped: dict[int, str] = {}
    watcher = threading.Thread(target=_watch_metrics, args=(process, port, world_size, scraped), daemon=True)
    watcher.start()
    stdout, stderr = process.communicate(timeout=100)
    watcher.join()
    return Demo(process.returncode, stdout, stderr, run_dir, scraped)


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """2 ranks, 12 steps, the default hook (fp16_compress_hook), no straggler."""
    return run_demo(tmp_path_factory.mktemp("two-ranks"), 2, "--steps", "12")


@pytest.fixture(scope="session")
def two_ranks_straggler(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """2 ranks, 10 steps, allreduce_hook, rank 1 a straggler."""
    return run_demo(tmp_path_factory.mktemp("two-ranks-straggler"), 2, "--steps", "10", "--straggler-rank", "1",
                    "--hook", "allreduce_hook")


@pytest.fixture(scope="session")
def three_ranks_uneven_straggler(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """3 ranks, uneven inputs (8, 10, 12 batches), rank 2 a straggler."""
    return run_demo(tmp_path_factory.mktemp("three-ranks-uneven-straggler"), 3, "--steps", "8", "--uneven",
                    "--straggler-rank", "2")


@pytest.fixture(scope="session")
def three_ranks_uneven(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """3 ranks, uneven inputs (12, 15, 18 batches), no straggler."""
    return run_demo(tmp_path_factory.mktemp("three-ranks-uneven"), 3, "--steps", "12", "--uneven")
