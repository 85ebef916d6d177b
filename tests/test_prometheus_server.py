"""The Prometheus fixture works: a real server scrapes tensorplay-named series, evaluates the
project's rules on them and keeps exemplars.

Each "rank" here is a fresh CollectorRegistry served in-process by prometheus_client, with the
contract's names and labels; the end-to-end test against ``tensorplay demo`` is elsewhere.
"""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .alert_rules import alert_expr
from .dashboard_queries import dashboard_paths, dashboard_queries
from .prometheus_server import PrometheusError, PrometheusServer, prometheus  # noqa: F401 (fixture)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
STEP_S = 0.05


class FakeRank:
    """A rank's exposition: a fresh registry with a few tensorplay series, served on 127.0.0.1."""

    def __init__(self, rank: int, compute_seconds: float, end_wait_seconds: float = 0.0) -> None:
        self.rank = str(rank)
        self.compute_seconds = compute_seconds
        self.end_wait_seconds = end_wait_seconds
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "tensorplay_allreduce_latency_seconds", "latency", ("rank", "hook"),
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.compute = Histogram(
            "tensorplay_step_compute_seconds", "compute", ("rank",), buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.end_wait, self.step_time, self.steps = (
            Counter(name, name, ("rank", "hook"), registry=self.registry)
            for name in ("tensorplay_step_wait_seconds", "tensorplay_step_seconds", "tensorplay_steps"))
        self.last_step = Gauge("tensorplay_last_step_timestamp_seconds", "last", ("rank",), registry=self.registry)
        self.waiting_since = Gauge(
            "tensorplay_collective_waiting_since_timestamp_seconds", "waiting", ("rank",), registry=self.registry
        )
        self.httpd, _thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.target = f"127.0.0.1:{self.httpd.server_port}"

    def step(self, period_s: float = STEP_S) -> None:
        self.compute.labels(rank=self.rank).observe(self.compute_seconds)
        hook = {"rank": self.rank, "hook": "fp16_compress_hook"}
        self.end_wait.labels(**hook).inc(self.end_wait_seconds)
        self.step_time.labels(**hook).inc(period_s)
        self.steps.labels(**hook).inc()
        self.latency.labels(rank=self.rank, hook="fp16_compress_hook").observe(0.004, {"trace_id": TRACE_ID})
        self.last_step.labels(rank=self.rank).set(time.time())
        self.waiting_since.labels(rank=self.rank).set(0)  # sampled between collectives

    def hang(self, waiting_since: float, last_step: float) -> None:
        """Freeze as a hung rank: in a collective since ``waiting_since`` (0: in none)."""
        self.last_step.labels(rank=self.rank).set(last_step)
        self.waiting_since.labels(rank=self.rank).set(waiting_since)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def two_ranks():
    """Job "fixture": both ranks step every 50 ms; rank 1 (a straggler) arrives last at every step's
    end: rank 0 waits 40 ms there for it, rank 1 5 ms -- 70 % of every step is waiting for rank 1.
    Rank 1 also computes 80 ms a step to rank 0's 20 (for the compute panels)."""
    ranks = [FakeRank(0, 0.02, end_wait_seconds=0.04), FakeRank(1, 0.08, end_wait_seconds=0.005)]
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for rank in ranks:
                rank.step()
            stop.wait(STEP_S)

    for rank in ranks:
        rank.step()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield ranks
    stop.set()
    thread.join(5)
    for rank in ranks:
        rank.close()


@pytest.fixture(scope="module")
def hung_jobs():
    """Two frozen jobs whose collectives began 5 s ago: in "stuck", ranks 0 and 1 wait in one for
    rank 2, which is in none (its latest hook call half a second before); in "hung", every rank
    waits."""
    began = time.time() - 5
    jobs = {"stuck": [FakeRank(rank, 0.01) for rank in range(3)], "hung": [FakeRank(rank, 0.01) for rank in range(2)]}
    for rank in jobs["stuck"][:2] + jobs["hung"]:
        rank.hang(waiting_since=began, last_step=began)
    jobs["stuck"][2].hang(waiting_since=0, last_step=began - 0.5)
    yield jobs
    for ranks in jobs.values():
        for rank in ranks:
            rank.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, two_ranks, hung_jobs):
    """One Prometheus for the module (its first scrape takes ~5 s): it scrapes all three jobs."""
    targets = {"fixture": [rank.target for rank in two_ranks]}
    targets.update({job: [rank.target for rank in ranks] for job, ranks in hung_jobs.items()})
    with PrometheusServer(targets, tmp_path_factory.mktemp("prometheus")) as server:
        yield server


def test_scrapes_evaluates_rules_and_keeps_exemplars(server, two_ranks):
    started = time.time()
    targets = server.wait_for_targets_up(7)
    assert {t["scrapeUrl"] for t in targets if t["labels"]["job"] == "fixture"} == {
        f"http://{rank.target}/metrics" for rank in two_ranks
    }

    samples = server.wait_for('tensorplay_last_step_timestamp_seconds{job="fixture"}', count=2)
    assert {s["metric"]["rank"] for s in samples} == {"0", "1"}
    assert {s["metric"]["instance"] for s in samples} == {rank.target for rank in two_ranks}

    # The project's rule files are loaded and evaluated every second.
    names = {group["name"] for group in server.rule_groups()}
    assert {"tensorplay.rules", "tensorplay.alerts"} <= names
    server.wait_for('job_rank:tensorplay_collective_waiting_since_timestamp_seconds:max{job="fixture"}', count=2)

    # The straggler rule's window decision names rank 1 and only rank 1; the alert, which waits for
    # three disjoint 5-minute windows to agree, names nobody in a job this young.
    expr = 'job_rank:tensorplay_step_lateness:outlier_ratio5m{job="fixture"}'
    server.wait_until(lambda: set(server.query_values(expr)) == {"1"}, 30, f"{expr} to name rank 1")
    assert server.query(alert_expr("TensorplayStragglerRank")) == []

    # Exemplars came through OpenMetrics and were stored with their trace_id.
    def exemplars():
        found = server.query_exemplars(
            'tensorplay_allreduce_latency_seconds_bucket{job="fixture"}', started - 60, time.time() + 60
        )
        return [e for series in found for e in series["exemplars"]]

    stored = server.wait_until(exemplars, 30, "exemplars")
    assert {e["labels"]["trace_id"] for e in stored} == {TRACE_ID}

    # Every dashboard query runs on the real server; those over the series served here answer.
    answered = {}
    for path in dashboard_paths():
        for title, query, _ in dashboard_queries(path, job="fixture", rank=["0", "1"], rate_interval="1m"):
            answered[title] = answered.get(title, False) or bool(server.query(query))
    for title in ("Allreduce latency p99 by rank and hook", "Allreduce latency distribution of the picked ranks",
                  "Share of every step the job waits for, by rank (5m)",
                  "Straggler share of every step: highest $topk ranks (5m)", "Ranks in no collective"):
        assert answered[title], title


def test_hang_expressions_and_panels_on_hung_jobs(server):
    """With the 120 s threshold replaced by 1 s (the waits began 5 s ago), the hang expressions
    name rank 2 of "stuck" and the job "hung" -- and the healthy "fixture" job not at all; with
    the real threshold, nothing. The hang panels show both jobs."""
    server.wait_for('job_rank:tensorplay_collective_waiting_since_timestamp_seconds:max{job=~"stuck|hung"}', count=5)
    stalled = alert_expr("TensorplayRankStalled", {120: 1})
    job_hung = alert_expr("TensorplayJobHung", {120: 1})
    assert {(s["metric"]["job"], s["metric"]["rank"]) for s in server.query(stalled)} == {("stuck", "2")}
    assert [s["metric"] for s in server.query(job_hung)] == [{"job": "hung"}]
    assert server.query(alert_expr("TensorplayRankStalled")) == []
    assert server.query(alert_expr("TensorplayJobHung")) == []

    answered: dict[str, set] = {}
    counted: dict[str, dict[str, float]] = {}
    path = next(p for p in dashboard_paths() if p.name == "stragglers-join.json")
    for title, query, _ in dashboard_queries(path, job=["stuck", "hung"], rate_interval="1m"):
        result = server.query(query)
        answered.setdefault(title, set()).update(s["metric"].get("job") for s in result)
        counted[title] = {s["metric"].get("job"): float(s["value"][1]) for s in result}
    assert answered["Longest and shortest wait inside a collective, by job"] == {"stuck", "hung"}
    assert answered["Seconds waiting inside a collective now (top $topk ranks)"] == {"stuck", "hung"}
    assert answered["Ranks in no collective, longest since their latest hook call (top $topk)"] == {"stuck"}
    assert counted["Ranks waiting inside a collective"] == {"stuck": 2, "hung": 2}
    assert counted["Ranks in no collective"] == {"stuck": 1, "hung": 0}


def test_bad_query_raises(prometheus):
    server = prometheus([])
    with pytest.raises(PrometheusError, match="bad_data"):
        server.query("rate(tensorplay_wire_bytes_total)")
    assert server.query("1 + 1")[0]["value"][1] == "2"


def test_missing_binary_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORPLAY_PROMETHEUS_BIN", str(tmp_path / "no-such-prometheus"))
    with pytest.raises(PrometheusError, match="not installed"):
        PrometheusServer([], tmp_path).start()
