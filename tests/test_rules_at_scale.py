"""tensorplay's alerts on a 64-rank job, the small version of bench/rules_at_scale.py.

Nine synthetic jobs (tests/synthetic_job.py, shaped from the real exposition) of 64 ranks and
16 minutes -- enough for the straggler rule's three 5m windows and its `for: 2m` -- are
backfilled, with the recording rules, into one Debian Prometheus; each alert expression is
evaluated at the end and must have held for its `for:`. The expected ranks come from the
generator (which ranks it made slow, how many iterations each shadowed, how many elements each
made non-finite, which stopped reducing) and, for the stragglers, also from
tensorplay/analysis/straggler.py's rule on the windows Prometheus recorded. The rule's Python run
over simulated steps (tests/rule_simulation.py, what the bench runs for a day of 10,000 ranks) is
checked here on a small job.

promtool and prometheus are required: a missing one fails the tests (CI installs Debian's
`prometheus`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from typing import Iterator

import numpy as np
import pytest

from tensorplay.analysis.straggler import (
    CRITICAL_HOLD_SHARE, CRITICAL_SHARE, MAX_RANKS_PER_JOB, WINDOW_S, WINDOWS, job_noise, outliers, shares_of,
)
from tensorplay.telemetry.names import Candidate, Metric

from .alert_firing import Alert, firing_in_order, notifications
from .alert_rules import alert_rules, alerts
from .backfill import aligned_start, backfilled_prometheus, evaluation_time
from .dashboard_queries import dashboard_paths, dashboard_queries, default_value, load_dashboard
from .prometheus_server import PrometheusServer
from .rule_simulation import run_rule
from .step_timing import BUCKETS_PER_STEP, COLLECTIVE_S, Spread, Timeline, simulate
from .synthetic_job import SCRAPE_INTERVAL_S, RANKS_PER_NODE, Scenario, SyntheticJob, standard_scenarios

RANKS = 64
MINUTES = 16
HOOKS = ("fp16_compress_hook", "bf16_compress_hook")


@pytest.fixture(scope="module")
def backfilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, SyntheticJob], PrometheusServer, float]]:
    """``({job: SyntheticJob}, Prometheus holding them, evaluation time)`` for every standard
    scenario; the overflow job runs two hooks."""
    scenarios = [
        replace(s, hooks=HOOKS, overflow_hooks=HOOKS) if s.overflow_hooks else s
        for s in standard_scenarios(RANKS)
    ]
    start = aligned_start(MINUTES)
    jobs = {s.job: SyntheticJob(s, RANKS, MINUTES, start) for s in scenarios}
    with backfilled_prometheus(list(jobs.values()), tmp_path_factory.mktemp("scale")) as server:
        yield jobs, server, evaluation_time(list(jobs.values()))


@pytest.fixture(scope="module")
def fired(backfilled) -> tuple[dict[str, SyntheticJob], dict[str, list[Alert]]]:
    """``({job: SyntheticJob}, {job: alerts firing at the end})``."""
    jobs, server, at = backfilled
    by_job: dict[str, list[Alert]] = defaultdict(list)
    for _, alerts in firing_in_order(server, alert_rules(), at, SCRAPE_INTERVAL_S):
        for alert in alerts:
            by_job[alert.labels["job"]].append(alert)
    return jobs, by_job


def _ranks(alerts: list[Alert], name: str) -> set[int]:
    return {int(a.labels["rank"]) for a in alerts if a.labels["alertname"] == name}


def _scenario(jobs: dict[str, SyntheticJob], **match) -> SyntheticJob:
    (job,) = [j for j in jobs.values() if all(getattr(j.scenario, k) == v for k, v in match.items())]
    return job


EDGE = 0.15
"""How near its threshold a rank's share may be for the module's decision and Prometheus' to differ:
the backfill evaluates each level of recording rules in a group of its own, each at its own offset
within the interval, so a recorded share and the threshold it is compared with can be an evaluation
apart (a running Prometheus evaluates the whole group at one instant), and at 64 ranks the
threshold moves by up to a tenth from one evaluation to the next."""


def _named_by_the_module(server: PrometheusServer, job: str, at: float) -> tuple[set[int], set[int]]:
    """``(surely, maybe)``: the ranks tensorplay/analysis/straggler.py names from the windows
    Prometheus recorded (each rank's fraction of its stepping time waited, and its mean step) now, 5
    and 10 minutes ago, clear of the threshold by EDGE; and those within EDGE of it in some window."""
    surely: set[int] | None = None
    maybe: set[int] | None = None
    for back in range(WINDOWS):
        when = at - back * WINDOW_S
        fractions = server.query_values(f'job_rank:tensorplay_step_wait_seconds:ratio5m{{job="{job}"}}', at=when)
        step_s = server.query_values(f'job_rank:tensorplay_step_seconds:mean5m{{job="{job}"}}', at=when)
        ranks = sorted(fractions, key=int)
        shares = shares_of([fractions[r] for r in ranks])
        noise = job_noise(shares)
        cost = shares * np.array([step_s[r] for r in ranks])
        if back == 0:
            now = dict(zip(map(int, ranks), shares))
        over = outliers(shares, cost, noise)
        near = over | (np.abs(shares - noise.threshold) < EDGE * noise.threshold)
        clear = over & (shares >= (1 + EDGE) * noise.threshold)
        surely = {int(r) for r, c in zip(ranks, clear) if c} & (surely if surely is not None else set(map(int, ranks)))
        maybe = {int(r) for r, n in zip(ranks, near) if n} & (maybe if maybe is not None else set(map(int, ranks)))
    capped = set(sorted(maybe, key=lambda r: -now[r])[:MAX_RANKS_PER_JOB])
    return surely & capped, capped


def test_the_straggler_alert_names_the_slow_ranks_as_the_module_does(backfilled, fired) -> None:
    jobs, server, at = backfilled
    _, by_job = fired
    for job in jobs.values():
        scenario: Scenario = job.scenario
        named = _ranks(by_job[scenario.job], "TensorplayStragglerRank")
        surely, maybe = _named_by_the_module(server, scenario.job, at)
        assert surely <= named <= maybe, (scenario, sorted(named), sorted(surely), sorted(maybe))
        # What the generator made: a rank with x1.6 compute or x2.5 backward stands out of 64; a
        # uniformly slow job, an uneven Join and a healthy job have none (x1.2 is near the line).
        if scenario.slow_factor >= 1.5 or scenario.backward_factor >= 2:
            assert named == surely == set(scenario.slow_ranks) | set(scenario.backward_ranks), (scenario, sorted(named))
        elif scenario.slow_factor == 1.0:
            assert named == maybe == set(), (scenario, sorted(named))
        stragglers = [a for a in by_job[scenario.job] if a.labels["alertname"] == "TensorplayStragglerRank"]
        ranks = [int(a.labels["rank"]) for a in stragglers]
        assert len(ranks) == len(set(ranks)), stragglers  # one severity per rank at a time
        for alert in stragglers:  # its value is its share of the step; critical from 20 % (held down to 18 %)
            assert 0 < alert.value < 1 and (alert.labels["severity"] == "warning" or alert.value >= CRITICAL_HOLD_SHARE), alert
        critical = {int(a.labels["rank"]) for a in stragglers if a.labels["severity"] == "critical"}
        assert {int(a.labels["rank"]) for a in stragglers if a.value >= CRITICAL_SHARE} <= critical, stragglers
    node = _scenario(jobs, slow_factor=1.6, slow_ranks=tuple(range(RANKS_PER_NODE, 2 * RANKS_PER_NODE)))
    assert notifications(a for a in by_job[node.scenario.job] if a.labels["alertname"] == "TensorplayStragglerRank") == 1


def test_the_rule_run_in_python_over_simulated_steps() -> None:
    """tests/rule_simulation.py, as the bench runs it for a day of 10,000 ranks, on an hour of 64:
    silent on a healthy job, even with one window alone; a rank with x1.6 compute named once three
    windows agree (15 minutes), its alert critical 2 minutes later, and with one window from the first."""
    def hour(scenario: Scenario):
        means = SyntheticJob(scenario, RANKS, 16, 0.0).work_mean_s
        return [simulate(means, Spread(0.1), 3600.0, SCRAPE_INTERVAL_S, np.random.default_rng(5))]

    healthy = hour(Scenario("healthy"))
    for windows in (WINDOWS, 1):
        run = run_rule(healthy, windows=windows)
        assert run.evaluations == 3600 / SCRAPE_INTERVAL_S - 19 and run.fired() == 0 and run.outlier_evaluations == 0
        assert run.highest_share < run.lowest_threshold
    slow = hour(Scenario("slow", slow_ranks=(21,), slow_factor=1.6))
    run = run_rule(slow)
    assert run.first_named_s == {21: WINDOWS * WINDOW_S}
    assert run.alerts == [(21, "critical", WINDOWS * WINDOW_S + 120)]  # its warning never fires: critical at once
    assert run_rule(slow, windows=1).first_named_s == {21: WINDOW_S}


def _late_rank_timeline(late_s: list[float]) -> Timeline:
    """4 ranks, 1 s steps, 60 a minute, one scrape a minute; rank 1 arrives ``late_s[m]`` late in minute m."""
    minutes = len(late_s)
    steps = np.full(minutes, 60.0)
    waits = np.full((4, minutes), 30.0)  # the peers wait 0.5 s of every step
    waits[1] = 60 * (0.5 - np.array(late_s))
    slowest = np.full(minutes, 40.0)
    return Timeline(60.0, steps, 60 * np.ones(minutes), slowest, steps * COLLECTIVE_S + slowest - waits,
                    np.zeros((4, minutes)))


def test_the_rule_run_in_python_hands_one_severity_over_to_the_other_as_the_rules_do() -> None:
    """The hand-over of tests/rules/straggler.test.yml's 'severity by the share', with whole windows
    (named from 15m, firing from 17m): rank 1 25 % late, then 12.5 % from 20m: critical until its
    warning has been pending 2 minutes from 23m (17.5 %, under the 18 % it holds to), then warning."""
    down = run_rule([_late_rank_timeline([0.25] * 20 + [0.125] * 15)])
    assert down.alerts == [(1, "critical", 17 * 60.0), (1, "warning", 25 * 60.0)]
    up = run_rule([_late_rank_timeline([0.125] * 20 + [0.25] * 15)])
    assert [(rank, severity) for rank, severity, _ in up.alerts] == [(1, "warning"), (1, "critical")]
    assert up.alerts[0][2] == 17 * 60.0 and 25 * 60.0 <= up.alerts[1][2] <= 26 * 60.0


def test_an_uneven_join_fires_once_for_the_job_naming_the_worst_rank(fired) -> None:
    jobs, by_job = fired
    job = _scenario(jobs, uneven_join=True)
    uneven = [a for a in by_job[job.scenario.job] if a.labels["alertname"] == "TensorplayUnevenInputs"]
    shadow = job.shadow_iterations
    assert (shadow >= 10).sum() > RANKS / 2  # most ranks shadowed: one alert still
    (alert,) = uneven
    assert int(alert.labels["rank"]) == int(np.argmax(shadow)) and alert.value == shadow.max()
    assert not any(_ranks(by_job[j], "TensorplayUnevenInputs") for j in jobs if j != job.scenario.job)


def test_an_overflow_fires_once_per_job_and_hook_naming_the_worst_rank(fired) -> None:
    jobs, by_job = fired
    job = _scenario(jobs, overflow_hooks=HOOKS)
    overflow = [a for a in by_job[job.scenario.job] if a.labels["alertname"] == "TensorplayGradientOverflow"]
    assert sorted(a.labels["hook"] for a in overflow) == sorted(HOOKS)
    (family,) = [f for f in job.families if f.name == Metric.NONFINITE]
    for series, values in job.values(family, 0, RANKS):
        totals = values[:, -1]
        assert (totals > 0).sum() > RANKS / 2
        (alert,) = [a for a in overflow if a.labels["hook"] == series.label("hook")]
        assert int(alert.labels["rank"]) == int(np.argmax(totals)) and alert.value == totals.max()
    assert notifications(overflow) == 1  # Alertmanager groups by alertname and job: both hooks in one
    assert not any(_ranks(by_job[j], "TensorplayGradientOverflow") for j in jobs if j != job.scenario.job)


def test_unreduced_steps_on_one_node_fire_once_per_job_naming_the_worst_rank_and_the_minority(fired, backfilled) -> None:
    """Node 1's 8 ranks stop reducing halfway (each a scrape after the one before): they take unreduced
    steps and each holds a fingerprint of its own. One TensorplayGradientsNotReduced names the rank
    that took the most; one TensorplayReplicasDiverged, whose minority is exactly those ranks."""
    jobs, by_job = fired
    _, server, at = backfilled
    job = _scenario(jobs, unreduced_ranks=tuple(range(RANKS_PER_NODE, 2 * RANKS_PER_NODE)))
    name = job.scenario.job
    (not_reduced,) = [a for a in by_job[name] if a.labels["alertname"] == "TensorplayGradientsNotReduced"]
    (family,) = [f for f in job.families if f.name == Metric.UNREDUCED_OPTIMIZER_STEPS]
    ((_, values),) = job.values(family, 0, RANKS)
    totals = values[:, -1]
    assert int(not_reduced.labels["rank"]) == int(np.argmax(totals)) == RANKS_PER_NODE and not_reduced.value == totals.max()
    (diverged,) = [a for a in by_job[name] if a.labels["alertname"] == "TensorplayReplicasDiverged"]
    assert diverged.value == RANKS_PER_NODE + 1  # the majority's fingerprint and one per rank of the node
    minority = server.query(f'job_rank:tensorplay_replica_fingerprint:minority{{job="{name}"}}', at)
    assert {int(s["metric"]["rank"]) for s in minority} == set(job.scenario.unreduced_ranks)
    for other in jobs:
        if other != name:
            assert not {a.labels["alertname"] for a in by_job[other]} & {"TensorplayGradientsNotReduced",
                                                                        "TensorplayReplicasDiverged"}, other


def test_no_other_alert_fires(fired) -> None:
    """Nothing hangs, no rank goes missing: the hang and missing-rank alerts stay silent on every job."""
    jobs, by_job = fired
    quiet = {"TensorplayRankStalled", "TensorplayJobHung", "TensorplayRankMetricsMissing"}
    assert set(alerts()) > quiet
    assert not [a for job in jobs for a in by_job[job] if a.labels["alertname"] in quiet]


def test_the_dashboards_default_view_draws_a_bounded_number_of_ranks(backfilled) -> None:
    """Every panel of both dashboards, as they open (every job, default ranks and top-k), as Grafana
    runs it (over the whole run, or at its end for instant panels): no query fails, none draws more ranks than the top-k or the default rank selection
    allows -- far fewer than the job's 64 -- and the straggler top-k shows the x1.6 rank."""
    jobs, server, at = backfilled
    start = at - MINUTES * 60
    drawn_by_panel: dict[str, set[tuple[str, str]]] = {}
    for path in dashboard_paths():
        dashboard = load_dashboard(path)
        bound = max(int(default_value(dashboard, "topk")), len(jobs) * len(default_value(dashboard, "rank")))
        assert bound < RANKS
        for title, expr, instant in dashboard_queries(path, rate_interval="1m", time_range=f"{MINUTES * 60}s"):
            series = server.query(expr, at) if instant else server.query_range(expr, start, at, SCRAPE_INTERVAL_S)
            ranks = {(s["metric"].get("job", ""), s["metric"]["rank"]) for s in series if "rank" in s["metric"]}
            assert len(ranks) <= bound, (path.name, title, len(ranks))
            drawn_by_panel.setdefault(title, set()).update(ranks)
    (job,) = [j for j in jobs.values() if j.scenario.slow_factor >= 1.5 and len(j.scenario.slow_ranks) == 1]
    top = [ranks for title, ranks in drawn_by_panel.items() if title.startswith("Straggler share of every step: highest")]
    assert top and (job.scenario.job, str(job.scenario.slow_ranks[0])) in top[0]


def test_the_jobs_exposed_communication_is_that_of_the_rank_everybody_waits_for(backfilled) -> None:
    """One straggler at x1.6: its 63 peers wait for it at every step's end, so the job's exposed
    communication per step (its least over the ranks) is the straggler's: one collective with no
    wait in it, on a rank whose backward hid the step's other collectives. Its share of the step,
    and the share hidden, are that rank's; every other rank's share is larger."""
    jobs, server, at = backfilled
    straggler = RANKS // 3
    name = _scenario(jobs, slow_factor=1.6, slow_ranks=(straggler,)).scenario.job

    def per_rank(record: str) -> dict[str, float]:
        return server.query_values(f'{record}{{job="{name}"}}', at=at)

    def of_job(record: str) -> float:
        (value,) = server.query_values(f'{record}{{job="{name}"}}', by="job", at=at).values()
        return value

    exposed = per_rank("job_rank:tensorplay_step_exposed_communication_seconds:mean5m")
    assert len(exposed) == RANKS and min(exposed, key=exposed.get) == str(straggler)
    # Backfilling evaluates each rule level at a slightly later instant than the one it reads.
    assert of_job("job:tensorplay_step_exposed_communication_seconds:min_mean5m") == pytest.approx(exposed[str(straggler)], rel=0.05)
    # One collective, plus the little it waits at the steps where a noisy peer's work ran longer still.
    assert COLLECTIVE_S <= exposed[str(straggler)] < 2 * COLLECTIVE_S
    shares = per_rank("job_rank:tensorplay_step_exposed_communication:ratio5m")
    assert shares[str(straggler)] == min(shares.values())
    assert of_job("job:tensorplay_step_exposed_communication:ratio5m") == pytest.approx(shares[str(straggler)], rel=0.05)
    hidden = per_rank("job_rank:tensorplay_step_communication_hidden:ratio5m")
    assert of_job("job:tensorplay_step_communication_hidden:ratio5m") == pytest.approx(hidden[str(straggler)], rel=0.05)
    # Its other buckets' collectives are hidden; what is exposed is its end-of-step collective (and wait).
    own = exposed[str(straggler)]
    assert hidden[str(straggler)] == pytest.approx(1 - own / (own + (BUCKETS_PER_STEP - 1) * COLLECTIVE_S), rel=0.05)


WIN_BACK_PANEL = "Exposed communication a candidate compression could win back per step (job, estimate)"


def test_the_advice_panels_draw_each_candidate_per_job_and_the_win_back_is_the_models(backfilled) -> None:
    """64 ranks serve each candidate's gauges: the job row's advice panels draw one line per job and
    candidate (no rank reaches them), the win-back estimate on the x1.6 straggler's job is its exposed
    communication x (1 - the candidate's wire ratio / fp16_compress_hook's 0.5), and on the overflow job
    fp16's worst error is +Inf and its non-finite elements every overflowing rank's."""
    jobs, server, at = backfilled
    advice = [(title, expr) for path in dashboard_paths()
              for title, expr, _ in dashboard_queries(path, rate_interval="1m", time_range=f"{MINUTES * 60}s")
              if title.startswith("Candidate compressions: ") or title == WIN_BACK_PANEL]
    assert len(advice) == 5  # the error's median and worst rank, the wire ratio, the non-finite, the win-back

    def by_job(expr: str) -> dict[str, dict[str, float]]:
        """``{job: {candidate: value}}``, every series of the query at ``at`` (none may carry a rank)."""
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for series in server.query(expr, at):
            assert "rank" not in series["metric"], expr
            out[series["metric"]["job"]][series["metric"]["candidate"]] = float(series["value"][1])
        return out

    answers = {expr: by_job(expr) for _, expr in advice}
    for title, expr in advice:
        assert {job: set(values) for job, values in answers[expr].items()} == {job: set(Candidate.ALL) for job in jobs}, title

    name = _scenario(jobs, slow_factor=1.6, slow_ranks=(RANKS // 3,)).scenario.job
    (exposed,) = server.query_values(
        f'job:tensorplay_step_exposed_communication_seconds:min_mean5m{{job="{name}"}}', by="job", at=at).values()
    (win_back,) = [expr for title, expr in advice if title == WIN_BACK_PANEL]
    wins = answers[win_back][name]
    wire = by_job(f'max by (job, candidate) (tensorplay_compression_candidate_wire_ratio{{job="{name}"}})')[name]
    assert wins == pytest.approx({candidate: exposed * max(0.0, 1 - wire[candidate] / 0.5) for candidate in Candidate.ALL})
    assert wins[Candidate.FP16] == 0 < wins[Candidate.POWERSGD_RANK4] < wins[Candidate.POWERSGD_RANK1] < exposed

    overflow = _scenario(jobs, overflow_hooks=HOOKS)
    (median, worst) = [expr for title, expr in advice if "error at the latest advice" in title]
    errors = answers[worst][overflow.scenario.job]
    overflowing = int((overflow._overflow_rate > 0).sum())
    assert math.isinf(errors[Candidate.FP16]) and overflowing < RANKS
    # Most of its ranks overflow: the median rank's fp16 error is +Inf too.
    assert math.isinf(answers[median][overflow.scenario.job][Candidate.FP16]) == (overflowing > RANKS / 2)
    assert all(math.isfinite(errors[candidate]) for candidate in Candidate.ALL if candidate != Candidate.FP16)
    (made,) = [answers[expr][overflow.scenario.job] for title, expr in advice if "non-finite" in title]
    assert made[Candidate.FP16] == len(HOOKS) * float(overflow._overflow_rate.sum()) > 0
    assert all(made[candidate] == 0 for candidate in Candidate.ALL if candidate != Candidate.FP16)


@pytest.mark.parametrize("kind", ["lognormal", "pareto"])
def test_the_step_spreads_are_what_they_say(kind: str) -> None:
    """The synthetic jobs' spreads: mean ~1 and standard deviation ~sigma; the heavy-tailed one has its
    tail (about one draw in a thousand 10 spreads above the mean) and nothing absurd beyond it."""
    draws = Spread(0.1, kind).draw(np.random.default_rng(3), (400, 5000)).astype(float)
    assert draws.mean() == pytest.approx(1.0 if kind == "pareto" else np.exp(0.005), abs=2e-3)
    assert draws.std() == pytest.approx(0.1, rel=0.05)
    tail = (draws > 2.0).mean()
    if kind == "lognormal":
        assert tail == 0.0
        return
    assert 5e-4 < tail < 2e-3
    # 20 million draws (a 10,000-rank job's 2,000 steps): none ~10^4 spreads long. Drawn from float32
    # uniforms, this seed gave one (a uniform of exactly 0, clipped): a step of 1,155 times the mean.
    rng = np.random.default_rng(0)
    assert max(float(Spread(0.1, kind).draw(rng, (2000, 1000)).max()) for _ in range(10)) < 1000
