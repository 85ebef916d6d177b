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

The straggler rule at scale, run in Python over jobs simulated step by step (tests/step_timing.py:
every step each rank's work times its own noise, the step as long as its slowest rank; the rule as
tests/rule_simulation.py evaluates it, with tensorplay/analysis/straggler.py's decision, which
tests/test_straggler_analysis.py ties to the rule files), for the job sizes given (default 64,
512, 4,096 and 10,000 ranks):

* ``--noise-floor``: the share of every step the job waits for its latest healthy rank, and the
  rule's threshold beside it, over 10 seeds;
* ``--smallest``: the smallest straggler named within three windows (its compute ``f`` times a
  typical rank's, like the scenarios' x1.6), for each per-step spread of ``--step-noise`` (default
  5, 10 and 20 %): named by the rule at 15 minutes and its alert firing at 17, in every one of
  ``--seeds`` jobs; beside it how often that rank was the latest to arrive, against the most any
  healthy rank was;
* ``--day``: a healthy job over a simulated day (5,760 evaluations at 15 s): the alerts fired,
  the evaluations at which some rank was above the job's noise in its current window, and what
  one window alone (no persistence) would have fired.

Every job draws its ranks' persistent spread from ``--spread``/``--spread-kind`` (5 % lognormal:
what healthy GPUs of one type show) and each step's noise from ``--step-noise``/
``--step-noise-kind`` (lognormal, or ``pareto``: Pareto II of shape 3, a heavy tail of rare long
steps, with the same standard deviation); the backfilled jobs above use the same parameters.

Run from the repository root (needs promtool and prometheus: apt-get install prometheus)::

    nice -n 10 python bench/rules_at_scale.py --ranks 512
    nice -n 10 python bench/rules_at_scale.py --ranks 4096 --repeats 3
    nice -n 10 python bench/rules_at_scale.py --smallest
    nice -n 10 python bench/rules_at_scale.py --day --step-noise 0.1
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

from tensorplay.analysis.straggler import MIN_LATENESS_S, job_noise, shares_of  # noqa: E402
from tensorplay.telemetry.names import Metric  # noqa: E402
from tests.alert_firing import firing_in_order, notifications  # noqa: E402
from tests.alert_rules import RULE_FILES, alert_rules  # noqa: E402
from tests.backfill import aligned_start, backfilled_prometheus, evaluation_time  # noqa: E402
from tests.dashboard_queries import dashboard_queries  # noqa: E402
from tests.prometheus_server import PrometheusServer  # noqa: E402
from tests.rule_simulation import RuleRun, run_rule  # noqa: E402
from tests.step_timing import KINDS, Spread, Timeline, simulate  # noqa: E402
from tests.synthetic_job import SCRAPE_INTERVAL_S, Scenario, SyntheticJob, series_per_rank, standard_scenarios  # noqa: E402

SLOW_S = 1.0
RANGE_S = 3600
SHOWN_RANKS = 8
QUERY_BUDGET_S = 20.0  # stop repeating a query once its runs took this long together


# -- alerts ---------------------------------------------------------------------------------------


def alert_table(server: PrometheusServer, scenarios: list[Scenario], at: float) -> None:
    print(f"  {'alert':<36} {'job (scenario)':<22} {'ranks':>6}  {'first ranks':<40} {'alerts':>6} {'notif.':>6}")
    silent = []
    for rule, fired in firing_in_order(server, alert_rules(), at, SCRAPE_INTERVAL_S):
        name = rule["alert"] + (f" ({rule['labels']['severity']})" if rule["alert"] == "TensorplayStragglerRank" else "")
        if not fired:
            silent.append(name)
            if not name.startswith("TensorplayStragglerRank"):
                continue  # the straggler alert's silence on most jobs is the point: shown per job
        for scenario in scenarios:
            of_job = [a for a in fired if a.labels.get("job") == scenario.job]
            ranks = sorted({int(a.labels["rank"]) for a in of_job if "rank" in a.labels})
            if not of_job and not name.startswith("TensorplayStragglerRank"):
                continue
            first = ", ".join(map(str, ranks[:SHOWN_RANKS])) + (" ..." if len(ranks) > SHOWN_RANKS else "")
            hooks = sorted({a.labels["hook"] for a in of_job if "hook" in a.labels})
            first += f" ({len(hooks)} hooks)" if len(hooks) > 1 else ""
            print(f"  {name:<36} {scenario.job:<22} {len(ranks):>6}  {first or '-':<40} {len(of_job):>6} "
                  f"{notifications(of_job):>6}")
    print(f"  silent on every job: {', '.join(n for n in silent if not n.startswith('TensorplayStragglerRank')) or '-'}")


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


@dataclass(frozen=True)
class Noise:
    """The job's two spreads: between its ranks (persistent) and of each step."""

    spread: Spread
    step: Spread

    def words(self) -> str:
        return (f"{self.spread.sigma:.0%} {self.spread.kind} spread between ranks, "
                f"{self.step.sigma:.0%} {self.step.kind} per step")


def _job(scenario: Scenario, ranks: int, noise: Noise, seed: int, minutes: float = 6) -> SyntheticJob:
    return SyntheticJob(scenario, ranks, minutes, 0.0, seed=seed, spread=noise.spread.sigma,
                        spread_kind=noise.spread.kind, step_noise=noise.step)


def highest_healthy_share(ranks: int, seed: int, noise: Noise) -> tuple[float, float, float]:
    """The share of every step and the seconds per step the job waits for its latest healthy rank,
    and the rule's threshold, as the recording rules compute them over the last 5m."""
    job = _job(Scenario("healthy"), ranks, noise, seed)
    window = int(round(300 / SCRAPE_INTERVAL_S))
    increase = {family.name: values[:, -1] - values[:, -1 - window]
                for family in job.families if family.name in (Metric.STEP_WAIT, Metric.STEP_SECONDS, Metric.STEPS)
                for _, values in job.values(family, 0, ranks)}
    shares = shares_of(increase[Metric.STEP_WAIT] / increase[Metric.STEP_SECONDS])
    latest = int(np.argmax(shares))
    per_step = increase[Metric.STEP_SECONDS][latest] / increase[Metric.STEPS][latest]
    return float(shares[latest]), float(shares[latest] * per_step), job_noise(shares).threshold


def noise_floor(sizes: list[int], seeds: int, noise: Noise) -> None:
    print(f"noise floor: the share of every step the job waits for its latest healthy rank, and the rule's "
          f"threshold, at {noise.words()} ({seeds} seeds; a straggler also costs {MIN_LATENESS_S * 1e3:g} ms)")
    print(f"  {'ranks':>7} {'mean':>6} {'min':>6} {'max':>6}   {'ms per step (max)':>17}   {'threshold (min-max)':>19}"
          f"   {'jobs over it':>12}")
    for ranks in sizes:
        figures = [highest_healthy_share(ranks, seed, noise) for seed in range(seeds)]
        shares = [share for share, _, _ in figures]
        thresholds = [threshold for _, _, threshold in figures]
        over = sum(share >= threshold for share, _, threshold in figures)
        print(f"  {ranks:>7} {statistics.mean(shares):6.1%} {min(shares):6.1%} {max(shares):6.1%}   "
              f"{1e3 * max(per_step for _, per_step, _ in figures):17.1f}   "
              f"{min(thresholds):9.1%}-{max(thresholds):.1%}   {over:>6} of {seeds}", flush=True)


# -- the rule in Python, over simulated jobs -------------------------------------------------------

NAMED_BY_S = 900.0  # three 5-minute windows
FIRED_BY_S = 1020.0  # ... and the alert's `for: 2m`
FACTORS = np.round(np.arange(1.02, 3.001, 0.02), 2)


def _straggler_job(ranks: int, factor: float, noise: Noise, seed: int) -> tuple[RuleRun, Timeline, int]:
    """A job whose rank ``ranks // 3`` computes ``factor`` times a typical rank, run for 17 minutes."""
    straggler = ranks // 3
    scenario = Scenario(f"straggler-x{factor:g}", slow_ranks=(straggler,), slow_factor=factor)
    means = _job(scenario, ranks, noise, seed).work_mean_s
    timeline = simulate(means, noise.step, FIRED_BY_S + SCRAPE_INTERVAL_S, SCRAPE_INTERVAL_S,
                        np.random.default_rng([seed, ranks, 23]))
    return run_rule([timeline]), timeline, straggler


def _named_in_time(run: RuleRun, rank: int) -> bool:
    """Named by three windows at 15 minutes, and its alert fired by 17 (and no healthy rank's)."""
    fired = {r for r, _, at in run.alerts if at <= FIRED_BY_S}
    return run.first_named_s.get(rank, float("inf")) <= NAMED_BY_S and fired == {rank}


def smallest_named(ranks: int, noise: Noise, seed: int) -> tuple[float, float, float]:
    """The smallest factor of FACTORS named in time (bisection: named is monotone in the factor, seed
    for seed), and at it how often the straggler was the latest to arrive and the most any healthy
    rank was (fractions of the steps)."""
    low, high = 0, len(FACTORS) - 1
    if not _named_in_time(*_straggler_job(ranks, FACTORS[high], noise, seed)[::2]):
        return float("inf"), float("nan"), float("nan")
    while low < high:
        middle = (low + high) // 2
        run, _, rank = _straggler_job(ranks, FACTORS[middle], noise, seed)
        if _named_in_time(run, rank):
            high = middle
        else:
            low = middle + 1
    _, timeline, rank = _straggler_job(ranks, FACTORS[low], noise, seed)
    latest = timeline.latest.sum(axis=1) / timeline.steps.sum()
    return float(FACTORS[low]), float(latest[rank]), float(np.delete(latest, rank).max())


def smallest_table(sizes: list[int], noise: Noise, step_spreads: list[float], seeds: int) -> None:
    print(f"smallest straggler named within 3 windows: its compute x f a typical rank's, named by the rule at "
          f"15 min and its alert firing at 17, in every one of {seeds} jobs; {noise.spread.sigma:.0%} "
          f"{noise.spread.kind} spread between ranks, {noise.step.kind} per-step noise. Beside it: the share of "
          f"steps it arrived last at that f, against the most any healthy rank did")
    print(f"  {'ranks':>7} " + " ".join(f"{f'{sigma:.0%} per step':>34}" for sigma in step_spreads))
    for ranks in sizes:
        cells = []
        for sigma in step_spreads:
            found = [smallest_named(ranks, Noise(noise.spread, Spread(sigma, noise.step.kind)), seed)
                     for seed in range(seeds)]
            factor, latest, healthy = max(found)
            cells.append(f"x{factor:.2f} (latest {latest:5.1%}, healthy {healthy:5.1%})")
        print(f"  {ranks:>7} " + " ".join(f"{cell:>34}" for cell in cells), flush=True)


def healthy_day(ranks: int, noise: Noise, seed: int, hours: float) -> tuple[RuleRun, RuleRun]:
    """A healthy job over ``hours``, simulated an hour at a time: the rule, and one window alone."""
    means = _job(Scenario("healthy"), ranks, noise, seed).work_mean_s
    rng = np.random.default_rng([seed, ranks, 29])
    pieces = [simulate(means, noise.step, 3600.0, SCRAPE_INTERVAL_S, rng) for _ in range(int(round(hours)))]
    return run_rule(pieces), run_rule(pieces, windows=1)


def day_table(sizes: list[int], noise: Noise, seeds: int, hours: float) -> None:
    print(f"a healthy job over {hours:g} h ({int(hours * 3600 / SCRAPE_INTERVAL_S):,} evaluations at "
          f"{SCRAPE_INTERVAL_S:g} s), {noise.words()}; per job (seed): alerts fired by the rule / by one "
          f"window alone, evaluations with a rank above the job's noise in its window, the highest share, "
          f"the threshold's range")
    for ranks in sizes:
        for seed in range(seeds):
            began = time.perf_counter()
            rule, single = healthy_day(ranks, noise, seed, hours)
            print(f"  {ranks:>7} ranks, seed {seed}: {rule.fired()} alerts ({single.fired()} with one window); "
                  f"above the noise at {rule.outlier_evaluations} of {rule.evaluations} evaluations; highest share "
                  f"{rule.highest_share:.1%}; threshold {rule.lowest_threshold:.1%}-{rule.highest_threshold:.1%} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)


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
    parser.add_argument("--smallest", type=int, nargs="*", default=None, metavar="RANKS",
                        help="print the smallest straggler named within 3 windows at these sizes (none given: "
                             "64 512 4096 10000) for each --step-noise, and exit")
    parser.add_argument("--day", type=int, nargs="*", default=None, metavar="RANKS",
                        help="run a healthy job of these sizes (none given: 64 512 4096 10000) for --hours and "
                             "print the alerts fired, and exit")
    parser.add_argument("--hours", type=float, default=24.0, help="length of the --day job (default 24)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="jobs per size (default: 10 for --noise-floor, 3 for --smallest, 1 for --day)")
    parser.add_argument("--spread", type=float, default=0.05, help="spread between ranks (default 0.05)")
    parser.add_argument("--spread-kind", choices=KINDS, default="lognormal")
    parser.add_argument("--step-noise", type=float, nargs="+", default=None,
                        help="per-step spread (default 0.1; --smallest: 0.05 0.1 0.2)")
    parser.add_argument("--step-noise-kind", choices=KINDS, default="lognormal")
    parser.add_argument("--workdir", type=Path, default=None, help="where the data goes (default: a temporary folder)")
    args = parser.parse_args()

    sizes = [64, 512, 4096, 10000]
    step_spreads = args.step_noise or ([0.05, 0.1, 0.2] if args.smallest is not None else [0.1])
    noise = Noise(Spread(args.spread, args.spread_kind), Spread(step_spreads[0], args.step_noise_kind))
    if args.noise_floor is not None:
        noise_floor(args.noise_floor or sizes, args.seeds or 10, noise)
        return
    if args.smallest is not None:
        smallest_table(args.smallest or sizes, noise, step_spreads, args.seeds or 3)
        return
    if args.day is not None:
        for sigma in step_spreads:
            day_table(args.day or sizes, Noise(noise.spread, Spread(sigma, args.step_noise_kind)), args.seeds or 1,
                      args.hours)
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
                jobs = [SyntheticJob(s, ranks, args.scenario_minutes, start, spread=noise.spread.sigma,
                                     spread_kind=noise.spread.kind, step_noise=noise.step) for s in scenarios]
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
                job = SyntheticJob(scenario, ranks, args.minutes, aligned_start(args.minutes), spread=noise.spread.sigma,
                                   spread_kind=noise.spread.kind, step_noise=noise.step)
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
