"""tensorplay's alerts on a 64-rank job, the small version of bench/rules_at_scale.py.

Nine synthetic jobs (tests/synthetic_job.py, shaped from the real exposition) of 64 ranks and
16 minutes -- enough for the 5m windows and the straggler's `for: 10m` -- are backfilled, with the
recording rules, into one Debian Prometheus; each alert expression is evaluated at the end and
must have held for its `for:`. The expected ranks come from the generator (which ranks it made
slow, how many iterations each shadowed, how many elements each made non-finite).

promtool and prometheus are required: a missing one fails the tests (CI installs Debian's
`prometheus`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Iterator

import numpy as np
import pytest

from tensorplay.telemetry.names import Metric

from .alert_firing import Alert, firing, notifications
from .alert_rules import alerts
from .backfill import aligned_start, backfilled_prometheus, evaluation_time
from .dashboard_queries import dashboard_paths, dashboard_queries, default_value, load_dashboard
from . import synthetic_job
from .prometheus_server import PrometheusServer
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
    for rule in alerts().values():
        for alert in firing(server, rule, at, SCRAPE_INTERVAL_S):
            by_job[alert.labels["job"]].append(alert)
    return jobs, by_job


def _ranks(alerts: list[Alert], name: str) -> set[int]:
    return {int(a.labels["rank"]) for a in alerts if a.labels["alertname"] == name}


def _scenario(jobs: dict[str, SyntheticJob], **match) -> SyntheticJob:
    (job,) = [j for j in jobs.values() if all(getattr(j.scenario, k) == v for k, v in match.items())]
    return job


def test_the_straggler_alert_names_exactly_the_slow_ranks(fired) -> None:
    jobs, by_job = fired
    for job in jobs.values():
        scenario: Scenario = job.scenario
        named = _ranks(by_job[scenario.job], "TensorplayStragglerRank")
        expected = set(scenario.slow_ranks) if scenario.slow_factor >= 1.5 else set()
        expected |= set(scenario.backward_ranks) if scenario.backward_factor >= 2 else set()
        assert named == expected, (scenario, sorted(named))
        for alert in by_job[scenario.job]:
            if alert.labels["alertname"] == "TensorplayStragglerRank":  # its value is its share of the step
                assert 0.2 <= alert.value < 1, alert
    node = _scenario(jobs, slow_factor=1.6, slow_ranks=tuple(range(RANKS_PER_NODE, 2 * RANKS_PER_NODE)))
    assert notifications(a for a in by_job[node.scenario.job] if a.labels["alertname"] == "TensorplayStragglerRank") == 1


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
    assert of_job("job:tensorplay_step_exposed_communication_seconds:min_mean5m") == exposed[str(straggler)]
    assert exposed[str(straggler)] == pytest.approx(synthetic_job._COLLECTIVE_S, rel=0.25)
    shares = per_rank("job_rank:tensorplay_step_exposed_communication:ratio5m")
    assert of_job("job:tensorplay_step_exposed_communication:ratio5m") == shares[str(straggler)] == min(shares.values())
    hidden = per_rank("job_rank:tensorplay_step_communication_hidden:ratio5m")
    assert of_job("job:tensorplay_step_communication_hidden:ratio5m") == hidden[str(straggler)]
    assert hidden[str(straggler)] == pytest.approx(1 - 1 / synthetic_job._BUCKETS_PER_STEP, abs=0.05)
