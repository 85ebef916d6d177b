"""End to end: a real Prometheus scrapes a real ``tensorplay demo`` run and the project's rules,
alerts and dashboards give the right answers on it.

Each test starts Prometheus from Debian's package (``tests/prometheus_server.py``: loopback, 1 s
scrape and rule evaluation, ``--enable-feature=exemplar-storage``, the rule files of
``deploy/prometheus/rules/``; a missing binary fails the test), then runs ``python -m tensorplay
demo`` as a user does, its ranks serving ``/metrics`` on free ports of 127.0.0.1 that are the
server's targets, under a ``job`` label of the test's own.

When to look. The runs are short, so every check is made at ONE instant ``at`` of the TSDB: the
first rule evaluation after Prometheus scraped the ranks' final values (every rank has written
its result file, which it does after training and flushing its telemetry) while the ranks still
serve them (``--linger-s``). Gauges -- and the rules and panels built on them -- end with the
scrape targets, so ``at`` must fall inside the linger; the tests poll for it with a bounded
timeout instead of sleeping, and then query with ``time=at`` so that how late the test gets
there does not matter.

The straggler alert fires once three disjoint 5-minute windows agree, which a run of seconds
never has: these runs check the rule's decision on the one window they have
(``job_rank:tensorplay_step_lateness:outlier_ratio5m``, the alert's expression on the current
window: ``_window_alerts``) and that the alert itself stays silent on so young a job.

Timing margins (measured here: a rank's own work per step is ~10-20 ms on this machine's CPU,
2 or 3 ranks sharing 2 cores): the sleeping straggler sleeps 100 ms per step, so its peers wait
for it most of every step (a share of ~0.8 against a 2-rank job's threshold of 28 %); the batch
straggler trains 16 times its peer's batch, extra forward and backward work that costs the job
over half of every step.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterator

import pytest

from tensorplay.analysis.straggler import CRITICAL_SHARE, MIN_LATENESS_S

from .alert_rules import alert_expr, alert_rules
from .dashboard_queries import DASHBOARD_DIR, dashboard_paths, dashboard_queries, selectors
from .demo_runs import DemoProcess, start_demo
from .ranks import free_base_port
from .prometheus_server import PrometheusServer, prometheus  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(150)

LINGER_S = 10.0  # ranks keep serving after training: the final scrape + rule evaluation fit well inside
STRAGGLER_DELAY_MS = 100.0
RUN_TIMEOUT_S = 90.0  # start-up of the ranks (torch imports on a loaded 2-core machine) + training
UNEVEN_THRESHOLD = 10  # TensorplayUnevenInputs: >= 10 shadowed iterations (deploy/README.md)


# -- helpers ----------------------------------------------------------------------------------------


@dataclass
class ScrapedRun:
    """A demo run scraped by ``server`` under ``job``; ``at`` is when to look (see the module doc)."""

    server: PrometheusServer
    job: str
    demo: DemoProcess
    started: float
    at: float

    @property
    def world_size(self) -> int:
        return self.demo.world_size

    @property
    def process(self) -> subprocess.Popen:
        return self.demo.process

    @property
    def ranks(self) -> list[str]:
        return [str(rank) for rank in range(self.world_size)]

    def query(self, expr: str) -> list[dict]:
        """``expr`` at ``at``; only this run's job (a server could hold several)."""
        return [s for s in self.server.query(expr, at=self.at) if s["metric"].get("job", self.job) == self.job]

    def values(self, expr: str) -> dict[str, float]:
        """``{rank: value}`` of ``expr`` at ``at``."""
        return {s["metric"].get("rank", ""): float(s["value"][1]) for s in self.query(expr)}

    def output(self) -> str:
        return self.demo.output()

    def finish(self) -> str:
        """Wait for the demo to exit (the linger ends it), assert it succeeded; return its stdout."""
        finished = self.demo.finish(timeout=LINGER_S + 30)
        assert finished.returncode == 0, self.output()
        return finished.stdout


def _unix(rfc3339: str) -> float:
    """Unix time of an RFC 3339 timestamp as Prometheus' API writes it (nanoseconds, Z or an offset)."""
    whole, fraction, zone = re.fullmatch(r"([^.Z+]+)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", rfc3339).groups()
    seconds = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return seconds + float(f"0.{fraction or 0}")


def start_scraped_demo(prometheus, tmp_path: Path, job: str, world_size: int, *flags: str,
                       linger_s: float = LINGER_S, **server_options) -> ScrapedRun:
    """Start Prometheus (``server_options`` go to PrometheusServer) and ``python -m tensorplay demo``
    with its ranks as the targets; ``at`` is 0."""
    port = free_base_port(world_size)
    server = prometheus([f"127.0.0.1:{port + rank}" for rank in range(world_size)], job=job, **server_options)
    started = time.time()
    demo = start_demo(tmp_path, world_size, *flags, linger_s=linger_s, port=port)
    return ScrapedRun(server, job, demo, started, 0.0)


def run_scraped_demo(prometheus, tmp_path: Path, job: str, world_size: int, *flags: str, **server_options):
    """Start Prometheus (``server_options`` go to PrometheusServer) and ``python -m tensorplay demo``;
    return a ScrapedRun once ``at`` is known.

    The caller checks, then calls ``finish()``; on a failed check it stops the demo (``run.demo.stop()``).
    """
    run = start_scraped_demo(prometheus, tmp_path, job, world_size, *flags, **server_options)
    server, demo = run.server, run.demo
    try:
        # 1. Training is over on every rank and its telemetry flushed: the served values are final.
        demo.wait_for("every rank's result file", demo.results_written, RUN_TIMEOUT_S)
        final = time.time()
        # 2. Prometheus has scraped every rank since then ...
        demo.wait_for("a scrape of every rank after training",
                      lambda: len(server.query(f'timestamp(tensorplay_last_step_timestamp_seconds{{job="{job}"}}) '
                                               f'>= {final:.3f}')) == world_size,
                      LINGER_S)
        scraped = time.time()
        # 3. ... and evaluated the recording rules on those scrapes (while the targets are up) --
        # every rule group, the dashboards' as well as the alerts' inputs: groups are evaluated
        # independently, each at its own offset within the interval.
        recorded = demo.wait_for(
            "a rule evaluation after the final scrape",
            lambda: (lambda r: r if len(r) == world_size else None)(server.query(
                f'timestamp(job_rank:tensorplay_last_step_timestamp_seconds:max{{job="{job}"}}) > {scraped:.3f}')),
            LINGER_S)
        first = min(float(s["value"][1]) for s in recorded)
        evaluated = demo.wait_for(
            "every rule group's evaluation after the final scrape",
            lambda: (lambda t: t if min(t) >= first else None)([_unix(g["lastEvaluation"]) for g in server.rule_groups()]),
            LINGER_S)
        run.at = max(evaluated)
    except BaseException:
        demo.stop()
        raise
    return run


# Panels that show problems these runs do not have: ranks waiting inside a collective, stalled or
# no longer scraped (a healthy run's training is over: its ranks linger in no collective, all
# scraped), overflowing compression, replicas apart, unreduced steps. Empty, as are the
# telemetry-error panels.
PANELS_EMPTY_AFTER_TRAINING = {
    "Longest and shortest wait inside a collective, by job",
    "Seconds waiting inside a collective now (top $topk ranks)",
    "Ranks TensorplayRankStalled names",
    "Ranks no longer scraped (last 30 min)",
    "Ranks no longer scraped, longest gone (top $topk)",
    "Most non-finite elements made in 5m (top $topk ranks)",
    "Ranks holding a minority fingerprint (top $topk)",
    "Most unreduced optimizer steps (top $topk ranks)",
}


WIN_BACK_PANEL = "Exposed communication a candidate compression could win back per step (job, estimate)"


def check_dashboards(run: ScrapedRun) -> dict[str, int]:
    """Run every dashboard query on the run's data as a user opening the dashboards runs it: the
    variables at their defaults (rank 0, the default top-k), over the run so far (both runs have
    uneven inputs, so Join's panels have data too). Each must execute, and answer unless it
    legitimately has nothing to show (above, and the telemetry-error panels: the run had no
    telemetry problem), which must then be empty. Returns ``{title: series}``."""
    titles = set()
    answered: dict[str, int] = {}
    missing, unexpected = [], []
    since_start = f"{math.ceil(run.at - run.started)}s"
    for path in dashboard_paths():
        for title, expr, _ in dashboard_queries(path, job=run.job, rate_interval="1m", time_range=since_start):
            titles.add(title)
            result = run.query(expr)  # raises PrometheusError on a query Prometheus rejects
            answered[title] = answered.get(title, 0) + len(result)
            empty_expected = title in PANELS_EMPTY_AFTER_TRAINING or any(
                s.metric == "tensorplay_telemetry_errors_total" for s in selectors(expr))
            if empty_expected and result:
                unexpected.append((path.name, title, expr, result))
            elif not empty_expected and not result:
                missing.append((path.name, title, expr))
    assert PANELS_EMPTY_AFTER_TRAINING <= titles, "a panel expected empty was renamed or removed: update this test"
    assert not missing, f"dashboard queries without data: {missing}"
    assert not unexpected, f"dashboard queries with data where none is expected: {unexpected}"
    return answered


def _by_candidate(run: ScrapedRun, expr: str) -> dict[str, float]:
    """``{candidate: value}`` of ``expr`` at ``at``."""
    return {s["metric"]["candidate"]: float(s["value"][1]) for s in run.query(expr)}


def _scraped_mid_training(run: ScrapedRun) -> dict[str, float]:
    """``{rank: scrapes that saw its step count change}``: every rate the lateness rules take
    needs at least one per rank (two samples of a counter, the later one higher)."""
    return run.values(f'changes(tensorplay_steps_total{{job="{run.job}"}}[10m])')


def _lateness(run: ScrapedRun) -> tuple[dict[str, float], dict[str, float]]:
    """``({rank: share of every step}, {rank: seconds per step})`` the job waits for each rank."""
    return (run.values(f'job_rank:tensorplay_step_lateness:ratio5m{{job="{run.job}"}}'),
            run.values(f'job_rank:tensorplay_step_lateness_seconds:mean5m{{job="{run.job}"}}'))


def _window_alerts(run: ScrapedRun) -> dict[str, tuple[float, set[str]]]:
    """``{rank: (share, severities)}``: what TensorplayStragglerRank's rules (one per severity) return
    on the current window alone -- their expressions with the straggler series (three windows
    agree) replaced by the window's decision. The alert itself needs a job older than 10 minutes."""
    named: dict[str, tuple[float, set[str]]] = {}
    for rule in alert_rules("TensorplayStragglerRank"):
        window = rule["expr"].replace("job_rank:tensorplay_step_lateness:straggler_ratio5m",
                                      f'job_rank:tensorplay_step_lateness:outlier_ratio5m{{job="{run.job}"}}')
        assert window != rule["expr"]
        for rank, share in run.values(window).items():
            named.setdefault(rank, (share, set()))[1].add(rule["labels"]["severity"])
    return named


def _spans(run: ScrapedRun) -> dict[str, dict]:
    """Every span the demo exported to its run directory, by trace id (hex, no 0x)."""
    spans = {}
    for rank in run.ranks:
        for line in run.demo.run_dir.spans(int(rank)).read_text().splitlines():
            span = json.loads(line)
            spans[span["context"]["trace_id"].removeprefix("0x")] = span
    return spans


# -- tests ------------------------------------------------------------------------------------------


def test_straggler_run_names_the_straggler_and_every_panel_answers(prometheus, tmp_path: Path) -> None:
    """2 ranks, rank 1 sleeps 100 ms a step, uneven inputs (36 / 45 batches: rank 0 shadows 9
    iterations, one below TensorplayUnevenInputs' threshold): the straggler rule names rank 1 and
    only rank 1 in the run's window, critical (the alert waits for three windows), the
    uneven-inputs expression nobody; the latency histogram's exemplars are the demo's own spans;
    every dashboard query answers."""
    job = "e2e-straggler"
    run = run_scraped_demo(prometheus, tmp_path, job, 2, "--steps", "36", "--uneven", "--straggler-rank", "1",
                           "--straggler-delay-ms", repr(STRAGGLER_DELAY_MS))
    try:
        shares, lateness = _lateness(run)
        print(f"\nstraggler run: share of every step per rank {shares}, seconds per step {lateness}")
        assert set(shares) == {"0", "1"}, shares  # both ranks have a share: rank 0's silence is a verdict

        named = _window_alerts(run)
        assert set(named) == {"1"}, (named, shares, lateness)
        assert named["1"] == (pytest.approx(shares["1"]), {"warning", "critical"})  # the value is the share
        assert run.values(alert_expr("TensorplayStragglerRank")) == {}  # one window of three
        assert lateness["1"] >= STRAGGLER_DELAY_MS / 1e3 * 0.8, lateness  # its peers wait for its sleep

        shadowed = run.values(f'tensorplay_join_shadow_iterations{{job="{job}"}}')
        assert shadowed == {"0": UNEVEN_THRESHOLD - 1, "1": 0.0}, shadowed
        assert run.values(alert_expr("TensorplayUnevenInputs")) == {}, shadowed
        assert run.values(alert_expr("TensorplayRankStalled")) == {}
        assert run.values(alert_expr("TensorplayJobHung")) == {}
        assert run.values(alert_expr("TensorplayRankMetricsMissing")) == {}
        assert run.values(alert_expr("TensorplayGradientOverflow")) == {}

        # Exemplars: the latency histogram carries the trace ids of the demo's own spans.
        series = run.server.query_exemplars(
            f'tensorplay_allreduce_latency_seconds_bucket{{job="{job}"}}', run.started - 10, run.at)
        spans = _spans(run)
        seen_ranks = set()
        for one in series:
            labels = one["seriesLabels"]
            for exemplar in one["exemplars"]:
                trace_id = exemplar["labels"]["trace_id"]
                assert trace_id in spans, f"exemplar {exemplar} has no span in {run.demo.run_dir.path}"
                attributes = spans[trace_id]["attributes"]
                assert str(attributes["tensorplay.rank"]) == labels["rank"]
                assert attributes["tensorplay.hook"] == labels["hook"]
                assert float(exemplar["value"]) == pytest.approx(attributes["tensorplay.allreduce.latency_ms"] / 1e3)
                assert float(exemplar["value"]) <= float(labels["le"])
                seen_ranks.add(labels["rank"])
        assert seen_ranks == {"0", "1"}, series
        print(f"exemplars: {sum(len(s['exemplars']) for s in series)} on {len(series)} bucket series, "
              f"{len(spans)} spans exported")

        answered = check_dashboards(run)
        print(f"dashboard series per panel: {answered}")

        # The advice (the demo takes it every 5th step): under fp16_compress_hook, fp16 and bf16 would send what
        # it sends (nothing to win back), PowerSGD a few hundredths: most of the job's exposed communication.
        (win_back,) = [q.expr for q in dashboard_queries(DASHBOARD_DIR / "communication.json", job=job)
                       if q.title == WIN_BACK_PANEL]
        wins = _by_candidate(run, win_back)
        exposed = run.values(f'job:tensorplay_step_exposed_communication_seconds:min_mean5m{{job="{job}"}}')[""]
        wire = _by_candidate(run, f'max by (candidate) (tensorplay_compression_candidate_wire_ratio{{job="{job}"}})')
        print(f"exposed per step {exposed:.4f} s; candidates' wire ratios {wire}; would win back {wins}")
        assert wins["fp16"] == pytest.approx(0, abs=1e-12) and wins["bf16"] == pytest.approx(0, abs=1e-12), wins
        for name in ("powersgd_rank1", "powersgd_rank2", "powersgd_rank4"):
            assert wins[name] == pytest.approx(exposed * (1 - wire[name] / 0.5)) and 0 < wins[name] < exposed, wins
    except BaseException:
        run.demo.stop()
        raise
    stdout = run.finish()
    assert "straggler: rank 1 " in stdout, stdout


def test_uneven_run_without_straggler(prometheus, tmp_path: Path) -> None:
    """3 ranks, no straggler, uniformly slow (every rank 4x the default batch), uneven inputs
    (160 / 200 / 240 batches: ranks 0 and 1 shadow 80 and 40 iterations): the straggler
    rule names nobody although every rank has a share (shadowing counts no wait, and the same
    extra work on every rank makes no rank late: none is above the job's noise in the run's
    window); TensorplayUnevenInputs' expression fires
    once for the job, naming rank 0, the one that shadowed the most (ranks 0 and 1 are >= 10);
    every dashboard query answers.

    The batch count is what keeps rank 0 -- whose compute observations end when it joins --
    stepping across several 1 s scrapes (~4 s here): a rate needs two scrapes that saw it step.
    """
    job = "e2e-uneven"
    run = run_scraped_demo(prometheus, tmp_path, job, 3, "--steps", "160", "--uneven", "--batch-size", "128")
    try:
        shares, lateness = _lateness(run)
        print(f"\nuneven run: share of every step per rank {shares}, seconds per step {lateness}")
        assert set(shares) == {"0", "1", "2"}, f"a rank has no share (too few scrapes saw it step?): {shares}"
        threshold = run.values(f'job:tensorplay_step_lateness:threshold_ratio5m{{job="{job}"}}')
        print(f"the job's threshold {threshold}")
        assert _window_alerts(run) == {} and run.values(alert_expr("TensorplayStragglerRank")) == {}, shares
        assert max(shares.values()) < min(threshold.values()), shares  # not merely under the 2 ms floor

        shadowed = run.values(f'tensorplay_join_shadow_iterations{{job="{job}"}}')
        print(f"shadowed iterations per rank {shadowed}")
        assert shadowed == {"0": 80.0, "1": 40.0, "2": 0.0}
        uneven = run.values(alert_expr("TensorplayUnevenInputs"))
        over = {rank: n for rank, n in shadowed.items() if n >= UNEVEN_THRESHOLD}
        worst = max(over, key=over.get)
        assert uneven == {worst: over[worst]} == {"0": 80.0}, over

        assert run.values(alert_expr("TensorplayRankStalled")) == {}
        assert run.values(alert_expr("TensorplayJobHung")) == {}
        assert run.values(alert_expr("TensorplayRankMetricsMissing")) == {}
        assert run.values(alert_expr("TensorplayGradientOverflow")) == {}

        answered = check_dashboards(run)
        print(f"dashboard series per panel: {answered}")
    except BaseException:
        run.demo.stop()
        raise
    stdout = run.finish()
    assert "straggler: none" in stdout, stdout



def test_a_bigger_batch_on_one_rank_is_named_by_its_share_of_the_step(prometheus, tmp_path: Path) -> None:
    """2 ranks, rank 1 trains 16 times rank 0's batch: its extra work is forward and backward --
    between the buckets, where its compute time sees only part of it. It arrives last at every
    step's end: the straggler rule names rank 1 alone in the run's window, its share of every step
    as the value, above the job's threshold (and 2 ms) and critical; the demo's report names it
    with the same share (from the spans, on the same steps); no other alert fires."""
    job = "e2e-batch-straggler"
    # Nothing paces this run (no sleep): at ~45 ms a step here, 30 steps ended within one or two
    # 1 s scrapes, and a rank whose counters were scraped only at their final value has no rate
    # -- no share, no alert (seen in CI-like runs). 60 steps under a 250 ms scrape interval give
    # every rank's counters several scrapes while it trains, on a machine 4 times faster too.
    run = run_scraped_demo(prometheus, tmp_path, job, 2, "--steps", "60", "--straggler-rank", "1",
                           "--straggler-kind", "batch", "--straggler-batch-factor", "16",
                           scrape_interval="250ms")
    try:
        scraped = _scraped_mid_training(run)
        assert len(scraped) == 2 and min(scraped.values()) >= 2, f"too few scrapes while training: {scraped}"
        shares, lateness = _lateness(run)
        print(f"\nbatch straggler run: share of every step per rank {shares}, seconds per step {lateness}")
        named = _window_alerts(run)
        threshold = run.values(f'job:tensorplay_step_lateness:threshold_ratio5m{{job="{job}"}}')[""]
        assert set(named) == {"1"}, (named, shares, lateness)
        share, severities = named["1"]
        assert share == pytest.approx(shares["1"]) and max(threshold, CRITICAL_SHARE) <= share < 1, (named, threshold)
        # The critical rule returns it (the warning rule too, until it reads the critical firing in ALERTS).
        assert "critical" in severities and lateness["1"] >= MIN_LATENESS_S, (named, lateness)
        for alert in ("TensorplayUnevenInputs", "TensorplayRankStalled", "TensorplayJobHung",
                      "TensorplayRankMetricsMissing", "TensorplayGradientOverflow"):
            assert run.values(alert_expr(alert)) == {}, alert
    except BaseException:
        run.demo.stop()
        raise
    stdout = run.finish()
    verdict = next(line for line in stdout.splitlines() if line.startswith("straggler: "))
    reported = re.match(r"straggler: rank 1 costs the job (\d+) % of every step", verdict)
    assert reported, stdout
    # The report weighs steps 1..59 from the spans; Prometheus the steps its scrapes saw.
    assert int(reported.group(1)) == pytest.approx(100 * share, abs=8), (verdict, named)
    assert "injected: rank 1 trains a 16x batch (512 samples against its peers' 32) (found)" in stdout


# -- hangs ------------------------------------------------------------------------------------------

HANG_THRESHOLD_S = 3  # the alerts' 120 s, lowered for a run of seconds (alert_expr substitutes it)
STALL_TIMEOUT_S = 25.0  # the demo's own hang report comes after Prometheus has seen the hang


def _hang_verdicts(prometheus, tmp_path: Path, job: str, *flags: str) -> tuple[ScrapedRun, str, str]:
    """Run a 3-rank demo that hangs; once Prometheus saw the hang past the threshold, evaluate both
    hang alerts at that instant; then let the demo's stall timeout end it (exit 3). Returns the
    run, the expression that fired first, and the demo's stdout."""
    run = start_scraped_demo(prometheus, tmp_path, job, 3, "--steps", "30", "--hang-rank", "1", "--hang-at-step", "4",
                             "--stall-timeout-s", repr(STALL_TIMEOUT_S), *flags)
    stalled = alert_expr("TensorplayRankStalled", {120: HANG_THRESHOLD_S})
    hung = alert_expr("TensorplayJobHung", {120: HANG_THRESHOLD_S})
    try:
        def fired() -> str | None:
            for name, expr in (("stalled", stalled), ("hung", hung)):
                result = [s for s in run.server.query(expr) if s["metric"].get("job") == job]
                if result:
                    run.at = float(result[0]["value"][0])
                    return name
            return None

        first = run.demo.wait_for("a hang alert expression to fire", fired, RUN_TIMEOUT_S)
        run.process.wait(timeout=STALL_TIMEOUT_S + 40)
    except BaseException:
        run.demo.stop()
        raise
    assert run.process.returncode == 3, run.output()
    return run, first, run.demo.stdout_path.read_text()


def test_a_rank_stuck_in_its_compute_is_named_live_and_by_the_demo(prometheus, tmp_path: Path) -> None:
    """Rank 1 stops for good at step 4, as a stuck data loader would; ranks 0 and 2 wait for it in
    the allreduce. While it hangs, TensorplayRankStalled's expression names rank 1 and only rank 1,
    TensorplayJobHung's nothing; the demo's hang report names rank 1 as the one that never arrived."""
    job = "e2e-hang"
    run, first, stdout = _hang_verdicts(prometheus, tmp_path, job)
    stalled = run.values(alert_expr("TensorplayRankStalled", {120: HANG_THRESHOLD_S}))
    assert first == "stalled" and set(stalled) == {"1"}, (first, stalled)
    assert stalled["1"] > HANG_THRESHOLD_S  # the value: how long the peers have waited
    assert run.values(alert_expr("TensorplayJobHung", {120: HANG_THRESHOLD_S})) == {}
    waiting = run.values(f'tensorplay_collective_waiting_since_timestamp_seconds{{job="{job}"}}')
    assert waiting["1"] == 0 and waiting["0"] > 0 and waiting["2"] > 0, waiting
    assert "rank 1: in no collective after 4 batches" in stdout and "it never arrived" in stdout, stdout
    assert "rank 0: waiting inside a collective since" in stdout and "step 4, bucket 0" in stdout, stdout
    assert "rank 2: waiting inside a collective since" in stdout, stdout
    assert "stuck on rank 1 (TensorplayRankStalled)" in stdout, stdout


def test_every_rank_waiting_is_a_hung_job_with_no_rank_to_blame(prometheus, tmp_path: Path) -> None:
    """Rank 1 blocks inside a traced collective that its peer never joins, the others wait for rank 1
    in the allreduce: every rank waits inside a collective. TensorplayJobHung's expression returns the
    job, TensorplayRankStalled's nothing, and the demo says there is no rank to blame."""
    job = "e2e-hung"
    run, first, stdout = _hang_verdicts(prometheus, tmp_path, job, "--hang-inside-collective")
    assert first == "hung"
    hung = run.query(alert_expr("TensorplayJobHung", {120: HANG_THRESHOLD_S}))
    assert [s["metric"]["job"] for s in hung] == [job], hung
    assert run.values(alert_expr("TensorplayRankStalled", {120: HANG_THRESHOLD_S})) == {}
    for rank in range(3):
        assert f"rank {rank}: waiting inside a collective since" in stdout, stdout
    assert "no rank to blame (TensorplayJobHung)" in stdout, stdout


def test_a_job_that_ends_right_after_its_join_leaves_its_final_figures(prometheus, tmp_path: Path) -> None:
    """No linger: the ranks exit right after training, yet Prometheus holds each rank's final Join
    figures, because a rank waits (bounded) for one more scrape before it exits."""
    job = "e2e-short"
    # A rank that Prometheus never scraped has nobody to wait for (wait_for_final_scrape returns
    # at once), and 40 plain steps can end inside the first 1 s scrape interval of a rank's
    # endpoint. Rank 0's 75 ms per step keeps the job up for about 3 s, several scrapes of each rank.
    run = start_scraped_demo(prometheus, tmp_path, job, 2, "--steps", "40", "--uneven",
                             "--straggler-rank", "0", "--straggler-delay-ms", "75", linger_s=0.0)
    try:
        run.process.wait(timeout=RUN_TIMEOUT_S)
    except BaseException:
        run.demo.stop()
        raise
    assert run.process.returncode == 0, run.output()
    joins = {s["metric"]["rank"]: float(s["value"][1])
             for s in run.server.query(f'last_over_time(tensorplay_joins_total{{job="{job}"}}[10m])')}
    shadowed = {s["metric"]["rank"]: float(s["value"][1])
                for s in run.server.query(f'last_over_time(tensorplay_join_shadow_iterations{{job="{job}"}}[10m])')}
    assert joins == {"0": 1.0, "1": 1.0}, joins
    assert shadowed == {"0": 10.0, "1": 0.0}, shadowed


# -- a frozen rank ----------------------------------------------------------------------------------

FROZEN_RANK = 1
FREEZE_AFTER_S = 5.0  # after every rank's first hook call: the job's first minute
SCRAPE_TIMEOUT = "500ms"  # a stopped process accepts the connection but never answers: the scrape times out


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def _rank_pid(demo: subprocess.Popen, rank: int) -> int | None:
    """The pid of the demo's rank ``rank``: the process torch's elastic launcher started with RANK=rank."""
    for pid in _descendants(demo.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"tensorplay.demo.train" in cmdline:
            return pid
    return None


def test_a_frozen_rank_is_named_missing_and_nothing_claims_no_rank_is_missing(prometheus, tmp_path: Path) -> None:
    """Rank 1 of 3 is SIGSTOPped 5 s after every rank made its first hook call -- in the job's first
    minute -- as a frozen node or a process stuck in the kernel would be: its port still accepts
    connections, but scrapes time out. Once every rank still scraped has waited inside a collective
    past the hang threshold, TensorplayRankMetricsMissing's expression names rank 1 and only rank 1
    (and the loaded rule is pending for it), TensorplayJobHung's returns nothing (a rank is missing:
    there is a rank to blame), TensorplayRankStalled's names nobody. SIGCONT: rank 1 is scraped again
    and no longer named. The freeze later in a job is covered by tests/rules/frozen_rank.test.yml."""
    job, selector = "e2e-frozen", '{job="e2e-frozen"}'
    missing = alert_expr("TensorplayRankMetricsMissing", {120: HANG_THRESHOLD_S})
    hung = alert_expr("TensorplayJobHung", {120: HANG_THRESHOLD_S})
    stalled = alert_expr("TensorplayRankStalled", {120: HANG_THRESHOLD_S})
    waits = f"time() - (job_rank:tensorplay_collective_waiting_since_timestamp_seconds:max{selector} > 0)"
    run = start_scraped_demo(prometheus, tmp_path, job, 3, "--steps", "5000", "--hook", "allreduce_hook",
                             "--stall-timeout-s", "300", scrape_timeout=SCRAPE_TIMEOUT)
    server, frozen, left = run.server, None, []
    instance = server.targets[job][FROZEN_RANK]
    try:
        run.demo.wait_for("every rank's first hook call, scraped",
                          lambda: len(server.query(f"tensorplay_last_step_timestamp_seconds{selector}")) == 3,
                          RUN_TIMEOUT_S)
        time.sleep(FREEZE_AFTER_S)
        frozen = run.demo.wait_for(f"rank {FROZEN_RANK}'s process", lambda: _rank_pid(run.process, FROZEN_RANK), 10)
        os.kill(frozen, signal.SIGSTOP)

        def frozen_past_threshold() -> float | None:
            # An instant where every rank still scraped has waited past the threshold (what
            # TensorplayJobHung's "every rank waits" sees) and rank 1 is no longer scraped.
            peers = server.query(waits)
            if ({s["metric"]["rank"] for s in peers} == {"0", "2"}
                    and min(float(s["value"][1]) for s in peers) > HANG_THRESHOLD_S + 1
                    and not server.query(f'tensorplay_collective_waiting_since_timestamp_seconds{{job="{job}",rank="1"}}')):
                return float(peers[0]["value"][0])
            return None

        run.at = run.demo.wait_for("the peers to wait past the threshold for the frozen rank", frozen_past_threshold, 30)
        named, hung_jobs, stalled_ranks = run.values(missing), run.query(hung), run.values(stalled)
        pending = run.values(f'ALERTS{{alertname="TensorplayRankMetricsMissing",alertstate="pending",job="{job}"}}')
        up = server.query_values(f'up{{job="{job}"}}', by="instance", at=run.at)
        target = next(t for t in server.targets_status() if t["labels"]["instance"] == instance)
        print(f"\nfrozen rank: named missing {named}, hung {hung_jobs}, stalled {stalled_ranks}, up {up}, "
              f"scrape error {target['lastError']!r}")
        assert set(named) == {"1"}, named
        assert 0 < named["1"] < run.at - run.started  # the value: seconds since its latest hook call
        assert hung_jobs == [], hung_jobs
        assert stalled_ranks == {}, stalled_ranks
        assert set(pending) == {"1"}, pending  # the loaded rule, with its own thresholds
        # Frozen, not gone: the connection is accepted, the scrape times out.
        assert "deadline exceeded" in target["lastError"], target
        assert up == {address: float(address != instance) for address in server.targets[job]}, up

        # Continued: it answers again, and is no longer named.
        os.kill(frozen, signal.SIGCONT)
        back = time.time()
        run.at = run.demo.wait_for("a rule evaluation that sees rank 1 scraped again",
                                   lambda: (lambda r: float(r[0]["value"][0]) if r else None)(server.query(
                                       f'timestamp(job_rank:tensorplay_collective_waiting_since_timestamp_seconds:max'
                                       f'{{job="{job}",rank="1"}}) > {back + 1:.3f}')),
                                   20)
        assert run.values(missing) == {}
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        ranks = _descendants(run.process.pid)
        run.demo.stop()
        left = [pid for pid in ranks if _is_demo_process(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the demo outlived it: {left}"


def _is_demo_process(pid: int) -> bool:
    """Whether ``pid`` is still a process of ``python -m tensorplay ...`` (not a pid reused since)."""
    try:
        return b"tensorplay" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# -- a job trained right, silent for minutes: its run overlaps the tests above ----------------------
#
# The replica rules compare fingerprints over 2 minutes and unreduced steps over 5: their silence on
# a healthy job means something only over minutes of scrapes. So the job and its own Prometheus
# start with the module's first test (when this check is selected) and run beside the others, and
# the last test of the module looks at all of it, waiting only for what the others' runtime did not
# cover. It is paced so that it takes little of the machine and so that each fingerprint is held
# for several scrapes (the rules compare the ranks at a step both were scraped at: fingerprints a
# fraction of a second apart would hardly ever be): rank 1 sleeps 50 ms per batch, as a slow data
# loader would, and the job steps at its pace; at a lower CPU priority besides (nice 10), so that
# the others' timing is not this job's.

SILENT_S = 150.0  # of scrapes of each rank and rule evaluations, every second
COMPARED_STEPS = 10  # fingerprint steps both ranks were scraped at, at least
TRAINED_RIGHT_JOB = "e2e-replicas"
TRAINED_RIGHT_TEST = "test_a_job_trained_right_stays_silent_for_minutes_of_scrapes"


@dataclass
class TrainedRight:
    """2 ranks accumulating gradients as they should, scraped by their own Prometheus since ``started``."""

    server: PrometheusServer
    demo: DemoProcess
    started: float


@pytest.fixture(scope="module")
def trained_right(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedRight]:
    """allreduce_hook, 4 batches of 8 per optimizer step, no_sync() around the forward and backward of
    the first 3, rank 1 sleeping 50 ms per batch; a fingerprint every 10 optimizer steps (the ranks
    inherit TENSORPLAY_FINGERPRINT_EVERY): about one in 2 s, held for 2 scrapes or more."""
    port = free_base_port(2)
    server = PrometheusServer([f"127.0.0.1:{port + rank}" for rank in range(2)], tmp_path_factory.mktemp("prometheus"),
                              job=TRAINED_RIGHT_JOB).start()
    started = time.time()
    try:
        with pytest.MonkeyPatch.context() as environment:
            environment.setenv("TENSORPLAY_FINGERPRINT_EVERY", "10")
            demo = start_demo(tmp_path_factory.mktemp("trained-right"), 2, "--steps", "10000000", "--hook",
                              "allreduce_hook", "--batch-size", "8", "--accumulation-steps", "4", "--straggler-rank",
                              "1", "--straggler-delay-ms", "50", "--stall-timeout-s", "600", port=port, niceness=10)
    except BaseException:
        server.stop()
        raise
    try:
        yield TrainedRight(server, demo, started)
    finally:
        demo.stop()
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def _trained_right_from_the_first_test(request: pytest.FixtureRequest) -> None:
    """Start :func:`trained_right` with the module's first test, if its check is among the tests run."""
    if any(item.name == TRAINED_RIGHT_TEST for item in request.session.items):
        request.getfixturevalue("trained_right")


def _replica_alerts_ever(server: PrometheusServer, job: str, start: float, end: float) -> list[dict]:
    """Every evaluation at which TensorplayReplicasDiverged or TensorplayGradientsNotReduced was pending or firing."""
    return server.query_range(
        f'ALERTS{{job="{job}", alertname=~"TensorplayReplicasDiverged|TensorplayGradientsNotReduced"}}', start, end, 1.0)


def _steps_both_ranks_served(server: PrometheusServer, job: str, start: float, end: float) -> dict[int, set[float]]:
    """``{fingerprint step: the fingerprints scraped at it}`` of the steps both ranks were scraped at,
    from the raw samples (what the rules compare)."""
    held: dict[tuple[str, int], float] = {}
    steps = {s["metric"]["rank"]: s["values"] for s in server.query_range(
        f'tensorplay_replica_fingerprint_step{{job="{job}"}}', start, end, 1.0)}
    fingerprints = {s["metric"]["rank"]: dict(s["values"]) for s in server.query_range(
        f'tensorplay_replica_fingerprint{{job="{job}"}}', start, end, 1.0)}
    for rank, values in steps.items():
        for at, step in values:
            held[(rank, int(float(step)))] = float(fingerprints[rank][at])
    by_step: dict[int, dict[str, float]] = {}
    for (rank, step), fingerprint in held.items():
        by_step.setdefault(step, {})[rank] = fingerprint
    return {step: set(ranks.values()) for step, ranks in by_step.items() if len(ranks) == 2}


@pytest.mark.timeout(SILENT_S + 200)
def test_a_job_trained_right_stays_silent_for_minutes_of_scrapes(trained_right: TrainedRight) -> None:
    """Keep this test the module's last. Scraped and evaluated every second for SILENT_S since both
    ranks' first fingerprint was scraped: the raw samples hold many steps both ranks were scraped at,
    with one fingerprint each; the rules counted one fingerprint per step at every evaluation, no
    unreduced step, one gradient reduction per optimizer step; TensorplayReplicasDiverged and
    TensorplayGradientsNotReduced were never even pending."""
    server, demo, job = trained_right.server, trained_right.demo, TRAINED_RIGHT_JOB
    first = demo.wait_for(
        "both ranks' first fingerprint scraped",
        lambda: (lambda r: r if len(r) == 2 else None)(server.query_range(
            f'tensorplay_replica_fingerprint{{job="{job}"}}', trained_right.started, time.time(), 1.0)),
        RUN_TIMEOUT_S)
    start = max(float(series["values"][0][0]) for series in first)
    time.sleep(max(0.0, start + SILENT_S - time.time()))  # what the tests before did not cover
    demo.wait_for(f"{COMPARED_STEPS} fingerprint steps both ranks were scraped at",
                  lambda: len(_steps_both_ranks_served(server, job, start, time.time())) >= COMPARED_STEPS, RUN_TIMEOUT_S)
    end = time.time()
    compared = _steps_both_ranks_served(server, job, start, end)
    print(f"\nsilent run: {len(compared)} fingerprint steps scraped on both ranks in {end - start:.0f} s")
    assert all(len(fingerprints) == 1 for fingerprints in compared.values()), compared
    distinct = server.query_range(f'max(job_step:tensorplay_replica_fingerprint:distinct2m{{job="{job}"}})',
                                  start, end, 1.0)
    assert distinct and {float(v) for _, v in distinct[0]["values"]} == {1.0}, distinct
    unreduced = server.query_range(f'sum(job_rank:tensorplay_unreduced_optimizer_steps:increase5m{{job="{job}"}})',
                                   start, end, 1.0)
    assert unreduced and {float(v) for _, v in unreduced[0]["values"]} == {0.0}, unreduced
    per_step = server.query(f'job_rank:tensorplay_gradient_reductions:per_optimizer_step5m{{job="{job}"}}')
    # A scrape may fall between a step's reduction (in its backward) and the step: 1 within that.
    assert [float(s["value"][1]) for s in per_step] == [pytest.approx(1.0, abs=0.01)] * 2, per_step
    assert _replica_alerts_ever(server, job, start, end) == []
