"""``tensorplay demo`` run as a user runs it: ``python -m tensorplay demo ...`` in a subprocess.

Each run is short (a handful of steps) and checks several things at once: exit status, the
per-rank table, the straggler verdict, the span files, and the metrics endpoints scraped while
the ranks run. The runs are session fixtures of ``demo_runs.py``, shared with ``test_report.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tensorplay.analysis.straggler import CRITICAL_SHARE
from tensorplay.demo.rundir import RunDir

from .demo_runs import Demo, has_sample, scrape, start_demo
from .sink import MemorySink

pytestmark = pytest.mark.timeout(120)

def test_scraping_a_port_that_echoes_is_nothing_answering() -> None:
    """What a TCP self-connection to a rank's port looks like before its server listens: the
    request comes back as the response (seen once in CI: the watcher thread died on it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def echo() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.sendall(connection.recv(4096))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        assert scrape(port) is None
    finally:
        thread.join(5)
        listener.close()


def _assert_ran(demo: Demo, world_size: int) -> None:
    assert demo.returncode == 0, demo.stderr
    assert "training 100%" in demo.stderr  # the launcher showed the ranks' progress
    assert sorted(demo.scraped) == list(range(world_size)), "a rank's /metrics did not answer during the run"
    for rank in range(world_size):
        assert RunDir(demo.run_dir).spans(rank).stat().st_size > 0
    assert [row["rank"] for row in demo.table()] == [str(r) for r in range(world_size)]


def test_two_ranks_report_no_straggler_and_serve_metrics(two_ranks: Demo) -> None:
    demo = two_ranks
    _assert_ran(demo, 2)
    assert demo.verdict().startswith("straggler: none"), demo.stdout
    assert "injected: none" in demo.stdout.splitlines()  # said, not left out: nothing was injected
    for rank, body in demo.scraped.items():
        assert has_sample(body, "tensorplay_wire_bytes_total", rank=str(rank), hook="fp16_compress_hook")
    assert all(row["costs the job"].endswith(" %") and row["end wait"].endswith(" ms") for row in demo.table())
    for row in demo.table():
        assert row["steps"] == "12" and row["shadowed"] == "-"
        assert row["non-finite"] == "0" and row["rel. error"] != "-"  # fp16 compresses; step 0 is sampled
        assert row["exposed comm"].endswith(" ms") and row["hidden"].endswith(" %")
    # What communication costs the step, and the advice the demo takes by default (every 5th step).
    assert re.fullmatch(r"communication: \d+\.\d ms of every \d+\.\d ms step is exposed \(\d+ %\), on rank [01], the one "
                        r"the others wait for; the backward hides \d+ % of it; .*", demo.communication()), demo.stdout
    assert [row["candidate"] for row in demo.candidates()] == ["fp16", "bf16", "powersgd_rank1", "powersgd_rank2",
                                                                "powersgd_rank4"], demo.stdout
    assert "compression advice: " in demo.stdout and "wins back: an estimate, if the exposed communication" in demo.stdout


def test_two_ranks_name_the_injected_straggler(two_ranks_straggler: Demo) -> None:
    demo = two_ranks_straggler
    _assert_ran(demo, 2)
    assert demo.verdict().startswith("straggler: rank 1 costs the job "), demo.stdout
    assert "injected: rank 1 sleeps 100 ms per step (found)" in demo.stdout and "injected: none" not in demo.stdout
    # Its peers wait for its 100 ms sleep at the end of every step: that is what it costs the job.
    shares = [int(row["costs the job"].removesuffix(" %")) for row in demo.table()]
    lateness_ms = float(re.search(r"every step \((\d+\.\d) ms, critical\)", demo.verdict()).group(1))
    assert shares[0] == 0 and shares[1] >= 100 * CRITICAL_SHARE and lateness_ms >= 0.8 * 100, demo.stdout
    assert all(row["rel. error"] == "-" for row in demo.table())  # allreduce_hook does not compress


def test_three_ranks_uneven_with_straggler(three_ranks_uneven_straggler: Demo) -> None:
    demo = three_ranks_uneven_straggler
    _assert_ran(demo, 3)
    assert [row["steps"] for row in demo.table()] == ["16", "20", "24"]
    assert [row["shadowed"] for row in demo.table()] == ["8", "4", "0"]
    assert demo.verdict().startswith("straggler: rank 2 "), demo.stdout


def test_three_ranks_uneven_inputs_are_no_straggler(three_ranks_uneven: Demo) -> None:
    demo = three_ranks_uneven
    _assert_ran(demo, 3)
    rows = demo.table()
    assert [row["shadowed"] for row in rows] == ["6", "3", "0"]
    assert [row["last joiner"] for row in rows] == ["no", "no", "yes"]
    assert demo.verdict().startswith("straggler: none"), demo.stdout
    assert "uneven inputs: rank 0 shadowed 6, rank 1 shadowed 3 iterations inside Join" in demo.stdout


def _starting(demo: Demo, starts: list[str]) -> None:
    lines = demo.stdout.splitlines()
    for start in starts:
        assert any(line.startswith(start) for line in lines), (start, demo.stdout)


def test_a_no_sync_around_the_backward_only_is_named_with_what_to_do(two_ranks: Demo) -> None:
    # 12 batches, 2 per optimizer step: every batch reduced anyway. The spans show the 5 steps a
    # later iteration followed; step 5's fingerprint rode on the iteration after it.
    _starting(two_ranks, [
        "gradient reductions: 2 per optimizer step on every rank (5 steps each): if these are the micro-batches of "
        "gradient accumulation, no_sync() wraps only the backward: wrap the forward too",
        "unreduced optimizer steps: none",
        "replica fingerprints: equal on every rank at the 1 step compared (5)",
        "injected: no_sync() wraps only the backward of 1 of every 2 batches (it takes no effect)",
    ])


def test_a_no_sync_that_never_ends_is_named_with_what_to_do(two_ranks_never_synced: Demo) -> None:
    # 10 steps, only the first reduced: after it no hook is called, so steps 2 to 10 (and their
    # fingerprints, at 5 and 10) are known from their own spans.
    demo = two_ranks_never_synced
    assert demo.returncode == 0, demo.stderr
    _starting(demo, [
        "gradient reductions: 0.10 per optimizer step on every rank (10 steps each): some steps' gradients were never reduced",
        "unreduced optimizer steps: rank 0: 9 of 10, rank 1: 9 of 10, the first at step 2: each such step trained its rank "
        "on its own gradients, and the replicas drift apart -- a no_sync() that is never left? End no_sync() before the "
        "micro-batch whose backward precedes the step",
        "replica fingerprints: differ at 2 of the 2 steps compared, from step 5 on, where 2 different fingerprints were "
        "held and the ranks split evenly",
        "injected: no_sync() entered after the first optimizer step and never left",
    ])


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    demo = start_demo(tmp_path, 2, "--steps", "100000")
    try:
        demo.wait_for("both ranks up and training", lambda: all(scrape(demo.port + r) for r in range(2)), 60)
        demo.process.send_signal(signal.SIGINT)
        stopped = demo.finish(30)
    finally:
        demo.stop()
    assert stopped.returncode == 130
    assert "interrupted; every rank stopped" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert scrape(demo.port) is None and scrape(demo.port + 1) is None  # the ranks are gone


BAD_FLAGS = [
    (["--world-size", "0"], "--world-size must be at least 1"),
    (["--world-size", "2", "--straggler-rank", "2"], "--straggler-rank 2 is not a rank of this job"),
    (["--world-size", "1", "--straggler-rank", "0"], "--straggler-rank needs peers"),
    (["--hook", "no_such_hook"], "invalid choice: 'no_such_hook'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "many"], "invalid int value: 'many'"),
    (["--straggler-batch-factor", "0"], "--straggler-batch-factor must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--accumulation-steps", "0"], "--accumulation-steps must be at least 1"),
    (["--no-sync-bug", "backward-only", "--accumulation-steps", "1"], "--no-sync-bug backward-only needs batches to accumulate"),
    (["--no-sync-bug", "sometimes"], "invalid choice: 'sometimes'"),
    (["--advise-every", "-1"], "--advise-every must be >= 0 (0: never), got -1"),
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


def test_a_ranks_final_state_write_does_not_race_its_writer_thread(tmp_path: Path, monkeypatch, sink: MemorySink) -> None:
    """A rank's last state write (training over) and its writer thread's periodic one used to share
    one temporary file: when the thread renamed it first, the rank's own rename failed and the rank
    died at the end of a finished run. Here the final write holds its temporary file for longer
    than the thread's period, as a loaded machine does."""
    from tensorplay.demo import hang
    from tensorplay.demo.rundir import read_json, write_json

    thread_wrote = threading.Event()

    def slow_final_write(path: Path, value: dict) -> None:
        if threading.current_thread() is not threading.main_thread():
            write_json(path, value)
            thread_wrote.set()
            return
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(value), encoding="utf-8")
        thread_wrote.clear()
        thread_wrote.wait(timeout=4 * hang._WRITE_EVERY_S)  # the thread writes meanwhile, if it still runs
        os.replace(partial, path)

    monkeypatch.setattr(hang, "write_json", slow_final_write)
    run_dir = RunDir(tmp_path)
    writer = hang.RankStateWriter(run_dir, 0, sink.metrics)
    assert thread_wrote.wait(timeout=5)  # the thread is writing every period
    writer.finished()
    assert read_json(run_dir.state(0))["finished"] is True
