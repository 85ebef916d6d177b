"""``tensorplay demo`` run as a user runs it: ``python -m tensorplay demo ...`` in a subprocess.

Each run is short (a handful of steps) and checks several things at once: exit status, the
per-rank table, the straggler verdict, the span files, and the metrics endpoints scraped while
the ranks run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .ranks import free_base_port

pytestmark = pytest.mark.timeout(120)

LINGER_S = "1.0"  # the ranks keep serving metrics this long after training: time for a last scrape


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
            return response.read().decode()
    except OSError:
        return None


def _has_sample(body: str, name: str, **labels: str) -> bool:
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
            body = _scrape(base_port + rank)
            if body and _has_sample(body, "tensorplay_allreduce_latency_seconds_count", rank=str(rank)):
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


def _assert_ran(demo: Demo, world_size: int) -> None:
    assert demo.returncode == 0, demo.stderr
    assert "training 100%" in demo.stderr  # the launcher showed the ranks' progress
    assert sorted(demo.scraped) == list(range(world_size)), "a rank's /metrics did not answer during the run"
    for rank in range(world_size):
        assert (demo.run_dir / f"spans-rank{rank}.jsonl").stat().st_size > 0
    assert [row["rank"] for row in demo.table()] == [str(r) for r in range(world_size)]


def test_two_ranks_report_no_straggler_and_serve_metrics(tmp_path: Path) -> None:
    demo = run_demo(tmp_path, 2, "--steps", "12")
    _assert_ran(demo, 2)
    assert demo.verdict().startswith("straggler: none"), demo.stdout
    assert "injected:" not in demo.stdout
    for rank, body in demo.scraped.items():
        assert _has_sample(body, "tensorplay_wire_bytes_total", rank=str(rank), hook="fp16_compress_hook")
    for row in demo.table():
        assert row["steps"] == "12" and row["shadowed"] == "-"
        assert row["non-finite"] == "0" and row["rel. error"] != "-"  # fp16 compresses; step 0 is sampled


def test_two_ranks_name_the_injected_straggler(tmp_path: Path) -> None:
    demo = run_demo(tmp_path, 2, "--steps", "10", "--straggler-rank", "1", "--hook", "allreduce_hook")
    _assert_ran(demo, 2)
    assert demo.verdict().startswith("straggler: rank 1 "), demo.stdout
    assert "injected: rank 1 sleeps 40 ms per step (found)" in demo.stdout
    assert all(row["rel. error"] == "-" for row in demo.table())  # allreduce_hook does not compress


def test_three_ranks_uneven_with_straggler(tmp_path: Path) -> None:
    demo = run_demo(tmp_path, 3, "--steps", "8", "--uneven", "--straggler-rank", "2")
    _assert_ran(demo, 3)
    assert [row["steps"] for row in demo.table()] == ["8", "10", "12"]
    assert [row["shadowed"] for row in demo.table()] == ["4", "2", "0"]
    assert demo.verdict().startswith("straggler: rank 2 "), demo.stdout


def test_three_ranks_uneven_inputs_are_no_straggler(tmp_path: Path) -> None:
    demo = run_demo(tmp_path, 3, "--steps", "12", "--uneven")
    _assert_ran(demo, 3)
    rows = demo.table()
    assert [row["shadowed"] for row in rows] == ["6", "3", "0"]
    assert [row["last joiner"] for row in rows] == ["no", "no", "yes"]
    assert demo.verdict().startswith("straggler: none"), demo.stdout
    assert "uneven inputs: rank 0 shadowed 6, rank 1 shadowed 3 iterations inside Join" in demo.stdout


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    port = free_base_port(2)
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorplay", "demo", "--steps", "100000", "--metrics-port", str(port),
         "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while not all(_scrape(port + rank) for rank in range(2)):  # both ranks are up and training
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 130
    assert "interrupted; every rank stopped" in stderr
    assert "Traceback" not in stderr
    assert _scrape(port) is None and _scrape(port + 1) is None  # the ranks are gone


BAD_FLAGS = [
    (["--world-size", "0"], "--world-size must be at least 1"),
    (["--world-size", "2", "--straggler-rank", "2"], "--straggler-rank 2 is not a rank of this job"),
    (["--world-size", "1", "--straggler-rank", "0"], "--straggler-rank needs peers"),
    (["--hook", "no_such_hook"], "invalid choice: 'no_such_hook'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "many"], "invalid int value: 'many'"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_exits_non_zero_with_a_message(tmp_path: Path, flags: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "tensorplay", "demo", "--run-dir", str(tmp_path / "run"), *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.skipif(shutil.which("tensorplay") is None, reason="console script not installed")
def test_console_script_runs_the_same_cli() -> None:
    result = subprocess.run(["tensorplay", "demo", "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0
    for flag in ("--world-size", "--steps", "--hook", "--straggler-rank", "--straggler-delay-ms", "--uneven",
                 "--metrics-port", "--otlp-endpoint"):
        assert flag in result.stdout
