"""Backfill synthetic jobs and tensorplay's recording rules into Debian's Prometheus.

:func:`backfilled_prometheus` writes each job as OpenMetrics files (``ranks_per_file`` ranks each,
so promtool's memory stays bounded), turns them into TSDB blocks with ``promtool tsdb
create-blocks-from openmetrics``, starts Prometheus over those blocks on 127.0.0.1, and then
backfills the recording rules of ``deploy/prometheus/rules/tensorplay.rules.yml`` with ``promtool
tsdb create-blocks-from rules``, at the scrape interval, in dependency passes: a rule that reads
another recorded series is evaluated once that series is loaded (each pass restarts the server
over the new blocks). The result is what a Prometheus that scraped the jobs and evaluated the
rules all along would hold. promtool and prometheus are required; a missing one is an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import yaml

from .alert_rules import RULE_DIR
from .dashboard_queries import selectors
from .prometheus_server import PrometheusError, PrometheusServer
from .synthetic_job import SCRAPE_INTERVAL_S, SyntheticJob

__all__ = [
    "RECORDING_RULES",
    "BackfillError",
    "aligned_start",
    "backfilled_prometheus",
    "evaluation_time",
    "promtool_binary",
    "rule_passes",
    "wait_for_compaction",
]

RECORDING_RULES = RULE_DIR / "tensorplay.rules.yml"
BLOCK_S = 2 * 3600  # promtool and Prometheus cut blocks at 2 h boundaries


class BackfillError(RuntimeError):
    """promtool failed."""


def promtool_binary() -> str:
    """Return the path of ``promtool``; raise if it is not installed."""
    path = shutil.which("promtool")
    if not path:
        raise BackfillError("promtool is not installed (apt-get install -y prometheus, as .ci/run does)")
    return path


def aligned_start(minutes: float, now: float | None = None) -> float:
    """A start time for a job of ``minutes`` that puts all of it inside one 2 h block, a few
    hours back (promtool's blocks must not overlap the time a running server appends to)."""
    if minutes > BLOCK_S / 60 - 2:
        raise ValueError(f"a job of {minutes} minutes does not fit one 2 h block")
    now = time.time() if now is None else now
    return (now // BLOCK_S - 2) * BLOCK_S + 60.0


def evaluation_time(jobs: Sequence[SyntheticJob]) -> float:
    """When to evaluate alerts over backfilled ``jobs``: one scrape interval after their last
    scrape, when every recorded series has been evaluated on it (rule evaluations are offset from
    scrapes)."""
    return max(job.end_unix for job in jobs) + SCRAPE_INTERVAL_S


def rule_passes(rules: Sequence[dict]) -> list[list[dict]]:
    """Recording rules in dependency order: each pass reads only raw series and the series
    recorded by earlier passes."""
    by_name = {rule["record"]: rule for rule in rules}
    level: dict[str, int] = {}

    def depth(rule: dict, seen: frozenset[str] = frozenset()) -> int:
        name = rule["record"]
        if name in seen:
            raise ValueError(f"recording rules read each other in a cycle: {sorted(seen)}")
        if name not in level:
            reads = {s.metric for s in selectors(rule["expr"])} & set(by_name)
            level[name] = 1 + max((depth(by_name[dep], seen | {name}) for dep in reads), default=-1)
        return level[name]

    passes: dict[int, list[dict]] = {}
    for rule in rules:
        passes.setdefault(depth(rule), []).append(rule)
    return [passes[key] for key in sorted(passes)]


def _promtool(*args: str, timeout: float) -> None:
    result = subprocess.run(["nice", "-n", "10", promtool_binary(), *args], capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        raise BackfillError(f"promtool {' '.join(args[:3])}: {result.stdout[-2000:]}{result.stderr[-2000:]}")


def _move_blocks(source: Path, storage: Path) -> int:
    moved = 0
    for block in source.iterdir():
        if (block / "meta.json").exists():
            block.rename(storage / block.name)
            moved += 1
    return moved


def _ingest(jobs: Sequence[SyntheticJob], workdir: Path, storage: Path, ranks_per_file: int) -> int:
    """Write every job in files of ``ranks_per_file`` ranks, promtool each into a block while the
    next file is written; return the samples written."""
    samples = 0

    def ingest(path: Path) -> None:
        out = workdir / f"{path.stem}.blocks"
        _promtool("tsdb", "create-blocks-from", "openmetrics", "-q", str(path), str(out), timeout=3600)
        path.unlink()
        _move_blocks(out, storage)
        out.rmdir()

    with ThreadPoolExecutor(max_workers=2) as pool:
        pending = []
        for number, job in enumerate(jobs):
            for first in range(0, job.ranks, ranks_per_file):
                path = workdir / f"job{number}-ranks{first}.om"
                with open(path, "w", buffering=1 << 20) as out:
                    samples += job.write_openmetrics(out, first, min(first + ranks_per_file, job.ranks))
                pending.append(pool.submit(ingest, path))
                running = [p for p in pending if not p.done()]
                if len(running) >= 2:  # bound the files on disk
                    wait(running, return_when=FIRST_COMPLETED)
        for future in pending:
            future.result()
    return samples


def _backfill_rules(server: PrometheusServer, storage: Path, workdir: Path, start: float, end: float,
                    start_timeout: float) -> None:
    # promtool evaluates from --start up to but not including --end, at times shifted by the
    # group's own offset (as a running Prometheus does): two intervals more record an evaluation
    # that has seen the jobs' last scrape (see evaluation_time).
    groups = yaml.safe_load(RECORDING_RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    for number, rules_of_pass in enumerate(rule_passes(rules)):
        rule_file = workdir / f"rules-pass{number}.yml"
        rule_file.write_text(yaml.safe_dump({"groups": [{"name": f"pass{number}", "rules": rules_of_pass}]}))
        out = workdir / f"rules-pass{number}.blocks"
        _promtool("tsdb", "create-blocks-from", "rules", "-q", f"--url={server.url}", f"--start={start:.0f}",
                  f"--end={end + 2 * SCRAPE_INTERVAL_S:.0f}", f"--eval-interval={SCRAPE_INTERVAL_S:.0f}s", f"--output-dir={out}",
                  str(rule_file), timeout=3600)
        _move_blocks(out, storage)
        server.stop()
        server.start(timeout=start_timeout)


def wait_for_compaction(server: PrometheusServer, blocks: int, timeout: float = 600.0) -> None:
    """Wait until Prometheus has merged the overlapping backfilled blocks into ``blocks`` blocks
    (it does so within a minute of starting): queries are then timed on the blocks a long-running
    server would have."""
    import urllib.request

    def loaded() -> float:
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("prometheus_tsdb_blocks_loaded "):
                    return float(line.split()[1])
        raise PrometheusError("prometheus_tsdb_blocks_loaded not served")

    server.wait_until(lambda: loaded() <= blocks, timeout, f"compaction into {blocks} block(s)")


@contextmanager
def backfilled_prometheus(
    jobs: Sequence[SyntheticJob],
    workdir: os.PathLike | str,
    ranks_per_file: int = 512,
    compacted: bool = False,
    start_timeout: float = 120.0,
) -> Iterator[PrometheusServer]:
    """A Prometheus on 127.0.0.1 holding ``jobs`` and the recording rules over them.

    ``compacted``: wait until Prometheus has merged the blocks (for timing queries).
    The server is stopped when the block ends; ``workdir`` keeps its storage.
    """
    workdir = Path(workdir)
    storage = workdir / "tsdb"
    storage.mkdir(parents=True, exist_ok=True)
    start = min(job.start_unix for job in jobs)
    end = max(job.end_unix for job in jobs)
    if start // BLOCK_S != end // BLOCK_S:
        raise ValueError("the jobs must lie inside one 2 h block (see aligned_start)")
    _ingest(jobs, workdir, storage, ranks_per_file)
    server = PrometheusServer({}, workdir, rule_files=(), storage=storage)
    server.start(timeout=start_timeout)
    try:
        _backfill_rules(server, storage, workdir, start, end, start_timeout)
        if compacted:
            wait_for_compaction(server, blocks=1)
        yield server
    finally:
        server.stop()
