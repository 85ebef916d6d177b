"""tensorplay's rules, alerts and dashboards at 512 and 4,096 ranks, on Debian's Prometheus.

For each job size N it prints:

1. the series one rank serves and the job's total, counted from the real exposition;
2. alerts: every scenario of tests/synthetic_job.py (healthy, a x1.6 and a x1.2 straggler, a
   straggler with x2.5 backward, a slow node, uniformly slow, an uneven Join, an overflow, a node stepping on
   unreduced gradients with its replicas apart) as a job of N ranks over
   ``--scenario-minutes``, backfilled with the recording rules into one Prometheus; for each alert
   of deploy/prometheus/rules/tensorplay.alerts.yml, the ranks its expression returns at the end
   and held for its ``for:`` (count and first few), and the notifications Alertmanager makes of
   them (deploy/alertmanager/alertmanager.yml's group_by). The healthy job's highest share of
   every step (job:tensorplay_step_lateness:max_ratio5m) is the noise floor at N;
3. cost: one job of N ranks (the x1.6 straggler) over ``--minutes``, blocks compacted as a
   long-running server holds them; median and p95 wall time of every recording rule and alert
   expression (instant), and every dashboard panel query with the dashboard's default variables
   (instant, and a range over 1 h at a 15 s step; ``*`` marks the way the panel runs it), with
   the series and bytes answered and Prometheus' peak samples. Queries over 1 s are flagged
   ("> 1 s"; in brackets where the panel does not run the query that way).

``--noise-floor`` prints the share of every step the job waits for its latest healthy rank at 5 %
between-rank spread (``--spread``) for 64, 512, 4,096 and 10,000 ranks, from the generator alone
(over 10 seeds), as the recording rules compute it.

Run from the repository root (needs promtool and prometheus: apt-get install prometheus)::

    nice -n 10 python bench/rules_at_scale.py --ranks 512
    nice -n 10 python bench/rules_at_scale.py --ranks 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tensorplay.analysis.straggler import MIN_LATENESS_S, SHARE_THRESHOLD  # noqa: E402
from tensorplay.telemetry.names import Metric  # noqa: E402
from tests.alert_firing import firing, notifications  # noqa: E402
from tests.alert_rules import RULE_FILES, alerts  # noqa: E402
from tests.backfill import aligned_start, backfilled_prometheus, evaluation_time  # noqa: E402
from tests.dashboard_queries import dashboard_queries  # noqa: E402
from tests.prometheus_server import PrometheusServer  # noqa: E402
from tests.synthetic_job import SCRAPE_INTERVAL_S, Scenario, SyntheticJob, series_per_rank, standard_scenarios  # noqa: E402

SLOW_S = 1.0
RANGE_S = 3600
SHOWN_RANKS = 8
QUERY_BUDGET_S = 20.0  # stop repeating a query once its runs took this long together


# -- alerts ---------------------------------------------------------------------------------------


def alert_table(server: PrometheusServer, scenarios: list[Scenario], at: float) -> None:
    print(f"  {'alert':<30} {'job (scenario)':<22} {'ranks':>6}  {'first ranks':<40} {'alerts':>6} {'notif.':>6}")
    silent = []
    for name, rule in alerts().items():
        fired = firing(server, rule, at, SCRAPE_INTERVAL_S)
        if not fired:
            silent.append(name)
            if name != "TensorplayStragglerRank":
                continue  # the straggler alert's silence on most jobs is the point: shown per job
        for scenario in scenarios:
            of_job = [a for a in fired if a.labels.get("job") == scenario.job]
            ranks = sorted({int(a.labels["rank"]) for a in of_job if "rank" in a.labels})
            if not of_job and name != "TensorplayStragglerRank":
                continue
            first = ", ".join(map(str, ranks[:SHOWN_RANKS])) + (" ..." if len(ranks) > SHOWN_RANKS else "")
            hooks = sorted({a.labels["hook"] for a in of_job if "hook" in a.labels})
            first += f" ({len(hooks)} hooks)" if len(hooks) > 1 else ""
            print(f"  {name:<30} {scenario.job:<22} {len(ranks):>6}  {first or '-':<40} {len(of_job):>6} "
                  f"{notifications(of_job):>6}")
    print(f"  silent on every job: {', '.join(n for n in silent if n != 'TensorplayStragglerRank') or '-'}")


# -- timing ---------------------------------------------------------------------------------------


@dataclass
class Timing:
    runs_s: list[float]
    series: int
    bytes: int
    peak_samples: int | None
    error: str = ""

    def row(self, shown: bool = True) -> str:
        """One table row; a query over 1 s is flagged, in brackets when the panel does not run it so."""
        if self.error:
            return f"{'ERROR':>8} {self.error[:80]}"
        runs = sorted(self.runs_s)
        median = statistics.median(runs)
        p95 = runs[min(len(runs) - 1, int(round(0.95 * (len(runs) - 1))))]
        peak = f"{self.peak_samples:,}" if self.peak_samples is not None else "?"
        flag = ("  > 1 s" if shown else "  (> 1 s, not as shown)") if median > SLOW_S else ""
        return f"{median:8.3f} {p95:8.3f} {len(runs):>3} {self.series:>7} {self.bytes / 1e6:9.2f} {peak:>12}{flag}"


def timed_query(server: PrometheusServer, expr: str, at: float, repeats: int, range_s: float | None) -> Timing:
    """Run ``expr`` up to ``repeats`` times over HTTP, as Grafana would; wall time per run."""
    params = {"query": expr, "stats": "all"}
    if range_s is None:
        path, params["time"] = "query", f"{at:.3f}"
    else:
        path = "query_range"
        params.update(start=f"{at - range_s:.3f}", end=f"{at:.3f}", step=f"{SCRAPE_INTERVAL_S:g}")
    url = f"{server.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    runs, body = [], b""
    for _ in range(repeats):
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=300) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            return Timing([], 0, 0, None, json.load(error).get("error", str(error)))
        runs.append(time.perf_counter() - began)
        if sum(runs) > QUERY_BUDGET_S:
            break
    data = json.loads(body)["data"]
    result = data["result"]
    peak = data.get("stats", {}).get("samples", {}).get("peakSamples")
    return Timing(runs, len(result) if isinstance(result, list) and data["resultType"] != "scalar" else 1, len(body), peak)


def timing_table(server: PrometheusServer, at: float, repeats: int, dashboards: Path) -> None:
    header = f"  {'query':<76} {'median':>8} {'p95':>8} {'n':>3} {'series':>7} {'MB':>9} {'peak samples':>12}"
    print(header)
    group_s: dict[str, float] = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("record") or rule["alert"]
                kind = "rule" if "record" in rule else "alert"
                timing = timed_query(server, rule["expr"], at, repeats, None)
                print(f"  {kind + ' ' + name:<76} " + timing.row())
                group_s[group["name"]] = group_s.get(group["name"], 0.0) + (statistics.median(timing.runs_s)
                                                                            if timing.runs_s else float("nan"))
    print("  one evaluation of each rule group (sum of its rules' medians): "
          + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in group_s.items())
          + f"; all {sum(group_s.values()):.3f} s")
    for path in sorted(dashboards.glob("*.json")):
        # As a user opens it: every job, the dashboard's own rank and top-k defaults, 1 h shown.
        print(f"  dashboard {path.name} (default variables, $__range = 1h; * = as the panel runs it)")
        seen: dict[str, int] = {}
        for title, expr, instant in dashboard_queries(path, rate_interval="1m", time_range=f"{RANGE_S}s"):
            seen[title] = seen.get(title, 0) + 1
            name = title[:56] + (f" [{seen[title]}]" if seen[title] > 1 else "")
            for label, range_s in (("instant", None), ("1h", RANGE_S)):
                shown = (range_s is None) == instant  # how the panel runs it
                timing = timed_query(server, expr, at, repeats, range_s)
                print(f"    {name + ' ' + label + ('*' if shown else ' '):<74} " + timing.row(shown))


# -- noise floor ----------------------------------------------------------------------------------


def highest_healthy_share(ranks: int, seed: int, spread: float) -> tuple[float, float]:
    """The share of every step and the seconds per step the job waits for its latest healthy rank,
    as the recording rules compute them from the generator's end-of-step waits over the last 5m:
    the median of the ranks' fractions of time waited without the lowest, minus the lowest."""
    job = SyntheticJob(Scenario("healthy"), ranks, 6, 0.0, seed=seed, spread=spread)
    window = int(round(300 / SCRAPE_INTERVAL_S))
    increase = {family.name: values[:, -1] - values[:, -1 - window]
                for family in job.families if family.name in (Metric.STEP_WAIT, Metric.STEP_SECONDS, Metric.STEPS)
                for _, values in job.values(family, 0, ranks)}
    waited = increase[Metric.STEP_WAIT] / increase[Metric.STEP_SECONDS]
    ordered = np.argsort(waited)
    share = float(np.median(waited[ordered[1:]]) - waited[ordered[0]])
    latest = ordered[0]
    return share, share * float(increase[Metric.STEP_SECONDS][latest] / increase[Metric.STEPS][latest])


def noise_floor(sizes: list[int], seeds: int, spread: float) -> None:
    print(f"noise floor: the share of every step the job waits for its latest healthy rank, at {spread:.0%} "
          f"between-rank spread ({seeds} seeds; TensorplayStragglerRank needs {SHARE_THRESHOLD:.0%} "
          f"and {MIN_LATENESS_S * 1e3:g} ms)")
    print(f"  {'ranks':>7} {'mean':>6} {'min':>6} {'max':>6}   {'ms per step (max)':>17}")
    for ranks in sizes:
        figures = [highest_healthy_share(ranks, seed, spread) for seed in range(seeds)]
        shares = [share for share, _ in figures]
        print(f"  {ranks:>7} {statistics.mean(shares):6.1%} {min(shares):6.1%} {max(shares):6.1%}   "
              f"{1e3 * max(per_step for _, per_step in figures):17.1f}")


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--minutes", type=float, default=60, help="length of the timed job (default 60)")
    parser.add_argument("--scenario-minutes", type=float, default=16,
                        help="length of each scenario job (default 16: 5m windows and a 10m `for:`)")
    parser.add_argument("--scenarios", nargs="*", default=None, help="scenario names (default: all)")
    parser.add_argument("--hooks", nargs="+", default=["fp16_compress_hook"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dashboards", type=Path, default=ROOT / "dashboards")
    parser.add_argument("--ranks-per-file", type=int, default=512)
    parser.add_argument("--skip", choices=["alerts", "cost"], nargs="*", default=[])
    parser.add_argument("--noise-floor", type=int, nargs="*", default=None, metavar="RANKS",
                        help="print the noise floor for these job sizes (none given: 64 512 4096 10000) and exit")
    parser.add_argument("--spread", type=float, default=0.05,
                        help="between-rank lognormal spread for --noise-floor (default 0.05)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the data goes (default: a temporary folder)")
    args = parser.parse_args()

    if args.noise_floor is not None:
        noise_floor(args.noise_floor or [64, 512, 4096, 10000], seeds=10, spread=args.spread)
        return
    hooks = tuple(args.hooks)
    for ranks in args.ranks:
        per_rank = series_per_rank(hooks)
        print(f"\n=== {ranks} ranks, hooks {', '.join(hooks)}")
        print(f"series: {per_rank} per rank, {per_rank * ranks:,} for the job")
        workdir = Path(tempfile.mkdtemp(prefix=f"rules-at-scale-{ranks}-", dir=args.workdir))
        try:
            if "alerts" not in args.skip:
                scenarios = [s for s in standard_scenarios(ranks, hooks)
                             if args.scenarios is None or s.job in args.scenarios]
                start = aligned_start(args.scenario_minutes)
                jobs = [SyntheticJob(s, ranks, args.scenario_minutes, start) for s in scenarios]
                began = time.perf_counter()
                with backfilled_prometheus(jobs, workdir / "alerts", args.ranks_per_file) as server:
                    at = evaluation_time(jobs)
                    print(f"\nalerts: {len(jobs)} jobs of {ranks} ranks x {args.scenario_minutes:g} min "
                          f"(backfilled in {time.perf_counter() - began:.0f} s)")
                    alert_table(server, scenarios, at)
                    share = server.query_values('job:tensorplay_step_lateness:max_ratio5m', by="job", at=at)
                    print("  highest share of every step per job: "
                          + ", ".join(f"{j} {v:.1%}" for j, v in sorted(share.items())))
                shutil.rmtree(workdir / "alerts")
            if "cost" not in args.skip:
                scenario = standard_scenarios(ranks, hooks)[1]
                job = SyntheticJob(scenario, ranks, args.minutes, aligned_start(args.minutes))
                began = time.perf_counter()
                with backfilled_prometheus([job], workdir / "cost", args.ranks_per_file, compacted=True) as server:
                    print(f"\ncost: one job ({scenario.job}) of {ranks} ranks x {args.minutes:g} min, "
                          f"{per_rank * ranks * len(job.times):,} samples at most "
                          f"(backfilled and compacted in {time.perf_counter() - began:.0f} s); seconds, wall, over HTTP")
                    timing_table(server, evaluation_time([job]), args.repeats, args.dashboards)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
