"""TensorplayStragglerRank on real jobs: ``tensorplay demo`` runs scraped by Debian's Prometheus with the
project's rules, the straggler's windows scaled down so that a run of a minute or two holds three.

The rule files are copied with every ``[5m]`` window, the straggler rule's ``offset 5m`` and
``offset 10m`` and the alert's ``for: 2m`` (and its critical's ``keep_firing_for``) scaled by ``--window / 5m`` (20 s: windows of 20 s, 20 and
40 s back, a ``for:`` of 8 s); nothing else changes. Prometheus scrapes the ranks every second
and evaluates the rules every second. For each run it prints, once every rank has written its
result: each rank's share of every step and its cost in ms, the job's threshold and its peers'
spread, the stragglers (three windows agree); then when each alert of TensorplayStragglerRank
went pending and fired, at which severity; how many evaluations found each rank above the job's
noise in its window; and the demo's own verdict (the same rule over the run's spans).

Run from the repository root (needs prometheus: apt-get install prometheus), one job at a time::

    python bench/straggler_on_real_jobs.py --steps 1200 -- --straggler-rank 1 --straggler-kind batch --straggler-batch-factor 6
    python bench/straggler_on_real_jobs.py --steps 1200 -- --straggler-rank 2 --straggler-delay-ms 5
    python bench/straggler_on_real_jobs.py --steps 600 -- --straggler-rank 1 --straggler-kind batch
    python bench/straggler_on_real_jobs.py --from-spans /tmp/straggler-real-job-XXXX/demo/run 1
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tensorplay.analysis.run import aggregate  # noqa: E402
from tensorplay.analysis.span_reader import read_spans  # noqa: E402
from tensorplay.analysis.straggler import MAD_TO_SIGMA, shares_of  # noqa: E402
from tests.alert_rules import RULE_FILES  # noqa: E402
from tests.demo_runs import start_demo  # noqa: E402
from tests.prometheus_server import PrometheusServer  # noqa: E402
from tests.ranks import free_base_port  # noqa: E402

LINGER_S = 25.0


def scaled_rules(folder: Path, window_s: int) -> list[Path]:
    """The project's rule files with the 5m windows, the straggler's offsets, for: and keep_firing_for: scaled to ``window_s``."""
    scale = window_s / 300
    paths = []
    for path in RULE_FILES:
        text = path.read_text().replace("[5m]", f"[{window_s}s]")
        text = text.replace("offset 10m", f"offset {2 * window_s}s").replace("offset 5m", f"offset {window_s}s")
        text = re.sub(r"(- alert: TensorplayStragglerRank\n(?:.*\n)*?\s+for: )2m",
                      lambda match: f"{match.group(1)}{round(120 * scale)}s", text)
        text = text.replace("keep_firing_for: 2m", f"keep_firing_for: {round(120 * scale)}s")  # the straggler's only
        (folder / path.name).write_text(text)
        paths.append(folder / path.name)
    return paths


def _values(server: PrometheusServer, expr: str, scale: float = 100.0) -> dict[str, float]:
    return {s["metric"].get("rank", ""): round(scale * float(s["value"][1]), 2) for s in server.query(expr)}


def _spreads_out(values: np.ndarray, row: int) -> tuple[float, float]:
    """How far ``values[row]`` is above its peers' median, in their robust spread; and that spread."""
    peers = np.delete(values, row)
    spread = MAD_TO_SIGMA * float(np.median(np.abs(peers - np.median(peers))))
    return (float(values[row]) - float(np.median(peers))) / max(spread, 1e-12), spread


def separation(run_dir: Path, rank: int) -> str:
    """The rank's lateness share, busy-time share and latest-to-arrive count, each against its peers'."""
    spans = read_spans(run_dir)
    run = aggregate(spans, 0)
    hooks, row = spans.hooks, int(np.searchsorted(run.ranks, rank))
    mine = hooks.model == 0
    rows = np.searchsorted(run.ranks, hooks.rank[mine])
    last_call = np.full((len(run.ranks), run.steps), -np.inf)
    np.maximum.at(last_call, (rows, hooks.step[mine]), hooks.start_s[mine])
    busy = (last_call[:, 1:] - run.step_end_s[:, :-1]).sum(axis=1)
    period = (run.step_end_s[:, 1:] - run.step_end_s[:, :-1]).sum(axis=1)
    busy_share = (busy - np.median(busy)) / period
    waits = run.end_waits()
    waited, seconds = (np.array([w.waits_s for w in waits]), np.array([w.steps_s for w in waits]))
    lateness = shares_of(waited.sum(axis=1) / seconds.sum(axis=1))
    per_step = shares_of(np.divide(waited, seconds, out=np.zeros_like(waited), where=seconds > 0))
    latest = (np.argmax(per_step, axis=0)[None, :] == np.arange(len(run.ranks))[:, None]).mean(axis=1)
    words = []
    for name, values, unit in (("lateness share", lateness, "%"), ("busy-time share", busy_share, "%"),
                               ("latest to arrive on", latest, "% of steps")):
        out, spread = _spreads_out(values, row)
        peers = ", ".join(f"{100 * v:.0f}" for v in np.delete(values, row))
        apart = f"{out:.0f} spreads of ±{100 * spread:.2f}" if spread >= 1e-4 else "the peers' alike"
        words.append(f"{name} {100 * values[row]:.1f} {unit} (peers {peers}; {apart})")
    return f"rank {rank}: " + "; ".join(words)


def run(world_size: int, steps: int, window_s: int, flags: list[str]) -> None:
    folder = Path(tempfile.mkdtemp(prefix="straggler-real-job-"))
    port = free_base_port(world_size)
    rules = scaled_rules(folder, window_s)
    print(f"tensorplay demo --world-size {world_size} --steps {steps} {' '.join(flags)} "
          f"(windows of {window_s} s; load average {open('/proc/loadavg').read().split()[0]})", flush=True)
    targets = [f"127.0.0.1:{port + rank}" for rank in range(world_size)]
    with PrometheusServer(targets, folder / "prometheus", job="demo", rule_files=rules) as server:
        began = time.time()
        (folder / "demo").mkdir()
        demo = start_demo(folder / "demo", world_size, "--steps", str(steps), *flags, linger_s=LINGER_S, port=port)
        seen: dict[str, float] = {}
        above: dict[str, int] = {}
        reported = False
        while demo.process.poll() is None:
            for alert in server.query('ALERTS{alertname="TensorplayStragglerRank"}'):
                labels = alert["metric"]
                seen.setdefault(f"rank {labels['rank']} {labels['severity']} {labels['alertstate']}",
                                round(time.time() - began, 1))
            for rank in _values(server, "job_rank:tensorplay_step_lateness:outlier_ratio5m"):
                above[rank] = above.get(rank, 0) + 1
            if demo.results_written() and not reported:
                reported = True
                threshold = _values(server, "job:tensorplay_step_lateness:threshold_ratio5m")
                spread = _values(server, "job:tensorplay_step_lateness:peers_spread_ratio5m")
                print(f"  at the end of training: share of every step % "
                      f"{_values(server, 'job_rank:tensorplay_step_lateness:ratio5m')}, ms per step "
                      f"{_values(server, 'job_rank:tensorplay_step_lateness_seconds:mean5m', 1e3)}; threshold "
                      f"{threshold.get('')} %, peers' spread ±{spread.get('')} %; stragglers (three windows) "
                      f"{_values(server, 'job_rank:tensorplay_step_lateness:straggler_ratio5m')}", flush=True)
            time.sleep(1)
        print(f"  alerts, first seen (s after the start): {seen or 'none'}")
        print(f"  evaluations with the rank above the job's noise in its window: {above or 'none'}")
        for line in demo.stdout_path.read_text().splitlines():
            if line.startswith(("straggler:", "injected:")):
                print(f"  {line}")
        injected = re.search(r"--straggler-rank (\d+)", " ".join(flags))
        if injected and demo.process.returncode == 0:
            print(f"  {separation(demo.run_dir.path, int(injected.group(1)))}")
        print(f"  exit {demo.process.returncode}; spans and logs in {folder / 'demo'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--window-s", type=int, default=20, help="the 5m windows scaled to this (default 20)")
    parser.add_argument("--from-spans", nargs=2, metavar=("DIR", "RANK"), default=None,
                        help="print the three figures of RANK from a run's span files, and exit")
    parser.add_argument("demo_flags", nargs="*", help="after --: the demo's straggler flags")
    args = parser.parse_args()
    if args.from_spans:
        print(separation(Path(args.from_spans[0]), int(args.from_spans[1])))
        return
    run(args.world_size, args.steps, args.window_s, args.demo_flags)


if __name__ == "__main__":
    main()
