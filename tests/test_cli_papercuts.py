"""What the ``tensorplay`` command tells a new user when something is off: a port that is no port or
is taken, a hung job (pids and the stuck rank's stack, while the ranks are up), a rank killed by a
signal, a report into a missing directory, a mistyped subcommand flag, and which version it is.

Flag handling runs in this process (``tensorplay.cli.main``); what needs ranks runs a real demo.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tensorplay.cli import main
from tensorplay.demo.options import add_job_arguments

from .ranks import free_base_port
from .waiting import wait_until

DEMO = [sys.executable, "-m", "tensorplay", "demo"]
RUN_TIMEOUT_S = 120


def _environment() -> dict[str, str]:
    """The test's environment without span export settings, so a rank's log holds only what it says."""
    return {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``tensorplay *argv``, which must exit 2 on its flags; return what it said on stderr."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_bad_metrics_port_in_the_environment_is_refused_like_the_flag(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flag = _refusal(capsys, "demo", "--metrics-port", "abc")
    assert "argument --metrics-port: invalid int value: 'abc'" in flag
    monkeypatch.setenv("TENSORPLAY_METRICS_PORT", "abc")
    env = _refusal(capsys, "demo", "--run-dir", str(tmp_path / "run"))
    assert env.startswith("usage: tensorplay demo")
    assert "TENSORPLAY_METRICS_PORT='abc' (the default of --metrics-port) is not a port number" in env
    monkeypatch.setenv("TENSORPLAY_METRICS_PORT", "65535")
    assert "the ranks serve on ports 65535..65536, which must lie within 1..65535" in _refusal(capsys, "demo")
    assert not (tmp_path / "run").exists()  # nothing was started


def test_a_mistyped_demo_flag_shows_the_demos_usage(capsys: pytest.CaptureFixture[str]) -> None:
    said = _refusal(capsys, "demo", "--bogus")
    assert said.startswith("usage: tensorplay demo ") and "--world-size N" in said
    assert said.rstrip().endswith("tensorplay demo: error: unrecognized arguments: --bogus")
    assert _refusal(capsys, "--bogus").rstrip().endswith("tensorplay: error: unrecognized arguments: --bogus")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"tensorplay {importlib.metadata.version('tensorplay')}\n"


def test_metrics_addr_help_gives_the_one_default_that_applies(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    torchrun = argparse.ArgumentParser()  # the per-rank entry point's flags, as tensorplay.demo.train adds them
    add_job_arguments(torchrun)
    helps = []
    for show_help in (lambda: main(["demo", "--help"]), lambda: torchrun.parse_args(["--help"])):
        with pytest.raises(SystemExit):
            show_help()
        helps.append(next(line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("--metrics-addr ADDR")))
    demo, entry_point = helps
    assert demo.endswith("(default 127.0.0.1)") and "0.0.0.0" not in demo
    assert entry_point.endswith("(default $TENSORPLAY_METRICS_ADDR, else 0.0.0.0)") and "127.0.0.1" not in entry_point


def test_report_into_a_missing_directory_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "missing" / "report.html"
    assert main(["report", str(tmp_path), "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert said == f"tensorplay report: --out {out}: no directory {out.parent} to write it in\n"
    assert not out.parent.exists()


@pytest.fixture(scope="module")
def hung_with_a_taken_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.CompletedProcess, int]]:
    """2 ranks; rank 1 stops for good at step 2, and its metrics port is taken by this test."""
    port = free_base_port(2)
    run_dir = tmp_path_factory.mktemp("hung") / "run"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        yield subprocess.run([*DEMO, "--steps", "6", "--hang-rank", "1", "--hang-at-step", "2",
                              "--stall-timeout-s", "5", "--metrics-port", str(port), "--run-dir", str(run_dir)],
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_environment()), port


def test_a_rank_whose_port_is_taken_says_so_in_the_terminal(
        hung_with_a_taken_port: tuple[subprocess.CompletedProcess, int]) -> None:
    result, port = hung_with_a_taken_port
    assert re.search(rf"^tensorplay demo: rank 1: cannot serve metrics on 127\.0\.0\.1:{port + 1} \(.*in use\); "
                     "training goes on", result.stderr, re.MULTILINE), result.stderr
    assert "rank 0: cannot serve" not in result.stderr


def test_the_hang_report_gives_pids_and_the_stuck_ranks_stack_before_stopping(
        hung_with_a_taken_port: tuple[subprocess.CompletedProcess, int]) -> None:
    result, _ = hung_with_a_taken_port
    assert result.returncode == 3, result.stderr
    report = result.stdout
    pids = {int(rank): int(pid) for rank, pid in re.findall(r"^  rank (\d): .*; pid (\d+)$", report, re.MULTILINE)}
    assert set(pids) == {0, 1} and len(set(pids.values())) == 2, report
    stack = report.split("rank 1's training thread, innermost frames last:\n", 1)[1]
    assert re.search(r'File ".*tensorplay/demo/train\.py", line \d+, in train\n\s+threading\.Event\(\)\.wait\(\)',
                     stack), report
    assert "py-spy dump --native --pid PID" in report
    assert report.rstrip().endswith("every rank stopped (exit status 3)")  # after all of the above


def _rank_pid(demo_pid: int) -> int:
    """The pid of the one rank the demo started (a child of its process), read from /proc."""
    ranks = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
        if parent == demo_pid and b"tensorplay.demo.train" in command:
            ranks.append(int(stat.parent.name))
    assert len(ranks) == 1, ranks
    return ranks[0]


def test_a_rank_killed_by_sigkill_is_named_with_its_empty_log(tmp_path: Path) -> None:
    """One rank, kept up after training; this test kills it with SIGKILL, as the OOM killer would."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen([*DEMO, "--world-size", "1", "--steps", "2", "--linger-s", str(RUN_TIMEOUT_S),
                                "--metrics-port", str(free_base_port(1)), "--run-dir", str(run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_environment())
    try:
        wait_until(lambda: (run_dir / "report.txt").exists(), RUN_TIMEOUT_S, "the rank trained, reported, now lingers",
                   gave_up=lambda: None if process.poll() is None else f"the demo exited with {process.returncode}")
        os.kill(_rank_pid(process.pid), signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, stderr
    assert re.search(r"^tensorplay demo: rank 0 was killed by SIGKILL \(exit code -9\), .*out-of-memory killer.*; "
                     r"its log \S+/stderr\.log is empty$", stderr, re.MULTILINE), stderr


def test_a_demo_whose_collector_never_answered_does_not_say_its_spans_were_exported(tmp_path: Path) -> None:
    """Nothing listens at the OTLP endpoint: the demo trains and reports, and its last words say the
    spans did not reach the collector, with the ranks' count of failed exports (it used to say they
    were exported whatever happened)."""
    endpoint = f"http://127.0.0.1:{free_base_port(1)}"
    result = subprocess.run([*DEMO, "--world-size", "2", "--steps", "2", "--otlp-endpoint", endpoint,
                             "--metrics-port", str(free_base_port(2)), "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_environment())
    assert result.returncode == 0, result.stderr
    assert "were also exported" not in result.stdout
    said = re.search(rf"^spans did not all reach {re.escape(endpoint)} over OTLP: (\d+) exports failed on ranks 0, 1; "
                     r"the rank logs in \S+ say why$", result.stdout, re.MULTILINE)
    assert said and int(said[1]) >= 2, result.stdout
