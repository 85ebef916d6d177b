"""The straggler rule in one place: tensorplay/analysis/straggler.py and the rule files agree.

The tie: random jobs (2 to 40 ranks, tight and loose, with late ranks in some windows and not
others, on long and on tiny steps) are given to ``promtool test rules`` as counters over three
disjoint 5-minute windows, with what the module computes of the same figures as the expected
answer: each window's multiplier, spread, threshold and outliers, and the stragglers once three
windows agree. The alert's severity split and the windows are read from the rule files; the
module's multiplier is checked against the normal quantile it approximates; the verdict's figure
and rule on per-step waits whose answer is known from the definition (docs/telemetry.md,
"Lateness").
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest
import yaml

from tensorplay.analysis.straggler import (
    CRITICAL_HOLD_SHARE,
    CRITICAL_SHARE,
    FALSE_ALARMS_PER_DAY,
    MAX_RANKS_PER_JOB,
    MIN_LATENESS_S,
    SPREAD_FLOOR,
    SMALL_JOB_SPREAD,
    WINDOW_S,
    WINDOWS,
    RankWait,
    evaluations_per_day,
    job_noise,
    lateness,
    noise_multiplier,
    outliers,
    shares_of,
    straggler_verdict,
)

from .alert_rules import RULE_FILES, alert_rules, rules

PROMETHEUS_YML = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "prometheus.yml"
TIE_SIZES = (2, 2, 3, 4, 5, 8, 13, 40)
TIE_STEP_S = {5: 0.01, 6: 0.02}  # job index -> step length (the others: 1 s): the 2 ms floor matters there
ALWAYS_LATE = {7: 12}  # job index -> ranks late in every window: more stragglers than the cap
# And a job on the 2 ms floor: 10 ms steps, rank 3 costs 2.05 ms (20.5 %), rank 2 1.95 ms (19.5 %).
FLOOR_JOB = (np.tile([0.5, 0.5, 0.5 - 0.195, 0.5 - 0.205], (WINDOWS, 1)), 0.01)
TOLERANCE = 1e-9


# -- the multiplier ---------------------------------------------------------------------------------


def test_the_multiplier_is_the_normal_quantile_of_the_documented_tail() -> None:
    normal = NormalDist()
    for ranks in (2, 3, 4, 8, 64, 512, 4096, 10_000, 100_000):
        lasting = normal.inv_cdf(1 - FALSE_ALARMS_PER_DAY / (2 * ranks))
        assert noise_multiplier(ranks) == pytest.approx(lasting, abs=4.5e-4)
        # One window: every evaluation is a new chance for the window's noise.
        single = normal.inv_cdf(1 - FALSE_ALARMS_PER_DAY / (2 * ranks * evaluations_per_day()))
        assert noise_multiplier(ranks, windows=1) == pytest.approx(single, abs=4.5e-4) and single > lasting + 1
    # With three windows the window noise needs no more than the lasting spread, at the shipped
    # evaluation intervals (compose 5 s, the PodMonitor's 15 s): the rule file writes z(F / 2N) alone.
    for interval_s in (5.0, 15.0):
        for ranks in range(1, 100_001, 97):
            assert noise_multiplier(ranks, interval_s=interval_s) == noise_multiplier(ranks, interval_s=1e9)


# -- the tie: promtool evaluates the rule files, the module computes the expected answer --------------


def _job(rng: np.random.Generator, ranks: int, always_late: int = 0) -> np.ndarray:
    """``[window, rank]`` fractions of their stepping time the ranks wait at the steps' ends: a job of
    its own spread (tight to loose), with some ranks late in some windows by some amount (and
    ``always_late`` ranks late in every window)."""
    spread = rng.choice([0.0, 0.002, 0.01, 0.03])
    base = 0.5 + rng.normal(0.0, spread, ranks)
    fractions = np.repeat(base[None, :], WINDOWS, axis=0)
    late_ranks = rng.choice(ranks, size=min(ranks, always_late or int(rng.integers(1, 11))), replace=False)
    for rank in late_ranks:
        late = rng.random(WINDOWS) < (1.0 if always_late else 0.8)
        amount = rng.uniform(0.3, 0.4) * rng.uniform(0.85, 1.0, WINDOWS) if always_late else \
            rng.uniform(0.0, 0.35) * rng.uniform(0.7, 1.0, WINDOWS)
        fractions[late, rank] -= amount[late]
    return np.clip(fractions, 0.001, 0.95)


def _expected(fractions: np.ndarray, step_s: float) -> tuple[list[tuple], list[np.ndarray], np.ndarray]:
    """Per window: (multiplier, spread, threshold) and the outliers; the stragglers at the end."""
    figures, outlying = [], []
    for window in fractions:
        shares = shares_of(window)
        noise = job_noise(shares)
        figures.append((noise.multiplier, noise.spread, noise.threshold, shares))
        outlying.append(outliers(shares, shares * step_s))
    agreed = np.logical_and.reduce(outlying)
    last = figures[-1][3]
    stragglers = np.zeros_like(agreed)
    stragglers[sorted(np.flatnonzero(agreed), key=lambda r: -last[r])[:MAX_RANKS_PER_JOB]] = True
    return figures, outlying, stragglers


def _clear_of_the_edges(fractions: np.ndarray, step_s: float) -> bool:
    """No share within rounding of its threshold or of the 2 ms floor, no two equal shares."""
    for window in fractions:
        shares = shares_of(window)
        threshold = job_noise(shares).threshold
        if np.min(np.abs(shares - threshold)) < 1e-6 or np.min(np.abs(shares * step_s - MIN_LATENESS_S)) < 1e-9:
            return False
        if len(np.unique(np.round(shares, 9))) < len(shares):
            return False
    return True


def _counter(per_minute: list[float]) -> str:
    values = np.concatenate([[0.0], np.cumsum(per_minute)])
    return " ".join(repr(round(float(v), 9)) for v in values)


def _tie_case(seed: int) -> tuple[dict, int]:
    """A promtool test case (and the number of its checks) for the jobs of ``seed``."""
    rng = np.random.default_rng(seed)
    minutes = int(WINDOW_S // 60)
    series, checks = [], []
    jobs = []
    for number, ranks in enumerate(TIE_SIZES):
        step_s = TIE_STEP_S.get(number, 1.0)
        fractions = _job(rng, ranks, ALWAYS_LATE.get(number, 0))
        while not _clear_of_the_edges(fractions, step_s):
            fractions = _job(rng, ranks, ALWAYS_LATE.get(number, 0))
        jobs.append((fractions, step_s))
    for number, (fractions, step_s) in enumerate([*jobs, FLOOR_JOB]):
        ranks = fractions.shape[1]
        job = f"job{number}"
        for rank in range(ranks):
            labels = f'job="{job}",instance="h:{9400 + rank}",rank="{rank}",hook="fp16_compress_hook"'
            waits = [60 * f for f in fractions[:, rank] for _ in range(minutes)]
            series += [
                {"series": f"tensorplay_step_wait_seconds_total{{{labels}}}", "values": _counter(waits)},
                {"series": f"tensorplay_step_seconds_total{{{labels}}}", "values": _counter([60.0] * len(waits))},
                {"series": f"tensorplay_steps_total{{{labels}}}", "values": _counter([60 / step_s] * len(waits))},
            ]
        figures, outlying, stragglers = _expected(fractions, step_s)
        for window, (multiplier, spread, threshold, _) in enumerate(figures):
            at = f"{(window + 1) * minutes}m"
            for name, value in (("noise_multiplier5m", multiplier), ("peers_spread_ratio5m", spread),
                                ("threshold_ratio5m", threshold)):
                checks.append({"expr": f'abs(job:tensorplay_step_lateness:{name}{{job="{job}"}} - {value!r}) '
                                       f"< bool {TOLERANCE}",
                               "eval_time": at, "exp_samples": [{"labels": f'{{job="{job}"}}', "value": 1}]})
            checks.append(_ranks_check("outlier_ratio5m", job, outlying[window], at))
        checks.append(_ranks_check("straggler_ratio5m", job, stragglers, f"{WINDOWS * minutes}m"))
    case = {"name": f"the module's rule on random jobs (seed {seed})", "interval": "1m",
            "input_series": series, "promql_expr_test": checks}
    return case, len(checks)


def _ranks_check(name: str, job: str, named: np.ndarray, at: str) -> dict:
    """A promtool check that ``job_rank:tensorplay_step_lateness:<name>`` holds exactly ``named`` ranks."""
    return {"expr": f'job_rank:tensorplay_step_lateness:{name}{{job="{job}"}} > bool 0', "eval_time": at,
            "exp_samples": [{"labels": f'{{job="{job}",rank="{rank}"}}', "value": 1} for rank in np.flatnonzero(named)]}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_rule_files_compute_what_the_module_computes(seed: int, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (apt-get install -y prometheus, as .ci/run does)"
    case, checks = _tie_case(seed)
    named = {c["expr"]: len(c["exp_samples"]) for c in case["promql_expr_test"] if "straggler_ratio5m" in c["expr"]}
    assert checks > 80 and sum(named.values()) > MAX_RANKS_PER_JOB  # the data names stragglers ...
    assert max(named.values()) == MAX_RANKS_PER_JOB and min(named.values()) == 0  # ... up to the cap, and none
    assert named['job_rank:tensorplay_step_lateness:straggler_ratio5m{job="job8"} > bool 0'] == 1  # the floor's
    test_file = tmp_path / "tie.test.yml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [str(path) for path in RULE_FILES], "evaluation_interval": "1m",
        "group_eval_order": ["tensorplay.rules", "tensorplay.dashboards", "tensorplay.alerts"],
        "tests": [case]}, width=4096))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


# -- what the rule files say beside the figures ---------------------------------------------------------


def _recorded(name: str) -> str:
    (rule,) = [r for r in rules() if r.get("record") == name]
    return rule["expr"]


def test_the_alerts_severity_is_critical_from_the_critical_share_and_it_reads_three_windows() -> None:
    written = {rule["labels"]["severity"]: " ".join(rule["expr"].split()) for rule in alert_rules("TensorplayStragglerRank")}
    series = "job_rank:tensorplay_step_lateness:straggler_ratio5m"
    firing = 'ALERTS{alertname="TensorplayStragglerRank", severity="critical", alertstate="firing"}'
    held = f"{series} >= {CRITICAL_HOLD_SHARE:g} and on (job, rank) {firing}"
    assert written == {"critical": f"{series} >= {CRITICAL_SHARE:g} or {held}",
                       "warning": f"{series} unless on (job, rank) ( {held} )"}
    critical, warning = alert_rules("TensorplayStragglerRank")  # the warning reads the critical's ALERTS of this evaluation
    assert (critical["labels"]["severity"], warning["labels"]["severity"]) == ("critical", "warning")
    assert critical["keep_firing_for"] == critical["for"] and "keep_firing_for" not in warning  # the hand-over
    offsets = sorted(int(m) for m in re.findall(r"\boffset (\d+)m\b", _recorded(series)))
    assert offsets == [int(WINDOW_S // 60) * i for i in range(1, WINDOWS)]
    assert re.search(r"topk by \(job\) \((\d+),", _recorded(series)).group(1) == str(MAX_RANKS_PER_JOB)
    floor = re.search(r"clamp_min\(job:tensorplay_step_lateness:peers_spread_ratio5m, ([\d.]+)\)",
                      _recorded("job:tensorplay_step_lateness:threshold_ratio5m"))
    assert float(floor.group(1)) == SPREAD_FLOOR
    # The windows are the recording rules' own.
    assert "[5m]" in _recorded("job_rank:tensorplay_step_wait_seconds:ratio5m") and WINDOW_S == 300


# -- the figure and the verdict ----------------------------------------------------------------------


def _steady(rank: int, wait_s: float, steps: int, step_s: float) -> RankWait:
    """A rank that waits ``wait_s`` at the end of each of ``steps`` steps of ``step_s``."""
    return RankWait(rank, (wait_s,) * steps, (step_s,) * steps)


def test_the_share_is_the_peers_wait_minus_the_ranks_own_over_the_step() -> None:
    # 100 steps of 0.2 s: ranks 0-2 wait 0.1 s at each step's end, rank 3 arrives 0.05 s later
    # and waits 0.05 s; rank 4 0.09 s.
    waits = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.05, 4: 0.09}
    figures = {f.rank: f for f in lateness([_steady(r, w, 100, 0.2) for r, w in waits.items()])}
    assert figures[3].share == pytest.approx(0.25)  # (0.1 - 0.05) / 0.2
    assert figures[3].per_step_s == pytest.approx(0.05)
    assert figures[3].peers_wait_s_per_step == pytest.approx(0.1) and figures[3].wait_s_per_step == pytest.approx(0.05)
    assert figures[4].share == pytest.approx(0.05) and figures[0].share == pytest.approx(0.0)
    assert figures[3].block_shares == pytest.approx((0.25,) * 3) and figures[3].outlier_blocks == 3
    # The peers' shares 0, 0, 0, 0.05: spread 1.4826 x 0 -> the floor; 5 ranks: k = 3.09.
    verdict = straggler_verdict([_steady(r, w, 100, 0.2) for r, w in waits.items()])
    assert verdict.ranks == (3,) and verdict.share == pytest.approx(0.25) and verdict.severity == "critical"
    assert verdict.noise.threshold == pytest.approx(noise_multiplier(5) * SPREAD_FLOOR)
    assert verdict.evidence.startswith("rank 3 costs the job 25 % of every step (50.0 ms, critical); its peers spread "
                                       "±0.0 %, so the job's noise explains up to 7 % (3.7 x ±2.0 %, the floor); "
                                       "above it in 3 of 3 blocks of ~33 steps (25 %, 25 %, 25 %)")


def test_a_rank_late_in_two_blocks_of_three_is_not_named_and_in_three_is() -> None:
    # 4 ranks, 30 steps of 0.1 s; ranks 0-2 wait 0.05 s. Rank 3 is 30 ms late (30 %) on steps
    # 0-19 and on time on 20-29: blocks of 10 steps, late in two.
    steady = [_steady(r, 0.05, 30, 0.1) for r in range(3)]
    burst = RankWait(3, (0.02,) * 20 + (0.05,) * 10, (0.1,) * 30)
    (figure,) = [f for f in lateness([*steady, burst]) if f.rank == 3]
    assert figure.block_shares == pytest.approx((0.3, 0.3, 0.0)) and figure.outlier_blocks == 2
    assert figure.share == pytest.approx(0.2) and not figure.passes()  # the mean passes; the blocks do not agree
    verdict = straggler_verdict([*steady, burst])
    assert verdict.ranks == () and verdict.evidence.startswith("none (highest: rank 3 costs the job 20 % of every "
                                                              "step, 20.0 ms;")
    assert "above it in 2 of 3 blocks of ~10 steps (30 %, 30 %, 0 %)" in verdict.evidence
    # Late by a third as much, but on every step: 10 %, over 3.66 x 2 % = 7.3 % in every block.
    small = RankWait(3, (0.04,) * 30, (0.1,) * 30)
    verdict = straggler_verdict([*steady, small])
    assert verdict.ranks == (3,) and verdict.severity == "warning", verdict.evidence


def test_the_threshold_follows_the_peers_spread() -> None:
    # 8 ranks of 1 s steps. Tight: 7 ranks wait 0.5 s; loose: they wait 0.47-0.53 s (shares
    # -3..+3 %, spread 1.4826 x 2 %). Rank 7 is 90 ms late in both: named in the tight job only.
    def job(waits: list[float]) -> list[RankWait]:
        return [_steady(r, w, 60, 1.0) for r, w in enumerate(waits)]

    tight = job([0.5] * 7 + [0.41])
    loose = job([0.50, 0.47, 0.53, 0.50, 0.52, 0.48, 0.51, 0.41])
    assert straggler_verdict(tight).ranks == (7,)
    verdict = straggler_verdict(loose)
    assert verdict.ranks == () and verdict.noise.spread == pytest.approx(1.4826 * 0.02) and not verdict.noise.floored
    assert verdict.noise.threshold == pytest.approx(noise_multiplier(8) * 1.4826 * 0.02)
    assert "its peers spread ±3.0 %, so the job's noise explains up to 11 % (3.8 x ±3.0 %, their spread)" in verdict.evidence
    assert straggler_verdict(job([0.50, 0.47, 0.53, 0.50, 0.52, 0.48, 0.51, 0.35])).ranks == (7,)


def test_jobs_of_two_and_three_ranks_are_taken_to_spread_as_a_loaded_host_does() -> None:
    # One peer: its share is 0 and nothing spreads; the threshold is k(2) x 8 % = 28 %.
    assert job_noise([0.0, 0.3]).spread == 0.0 and job_noise([0.0, 0.3]).threshold == pytest.approx(
        noise_multiplier(2) * SMALL_JOB_SPREAD)
    verdict = straggler_verdict([_steady(0, 0.5, 30, 1.0), _steady(1, 0.21, 30, 1.0)])  # 29 %
    assert verdict.ranks == (1,) and verdict.severity == "critical"
    assert ("one peer, too few to measure a spread by: the job's noise is taken to explain up to 28 % (3.5 x ±8 %, "
            "a 2-rank job's)") in verdict.evidence
    assert straggler_verdict([_steady(0, 0.5, 30, 1.0), _steady(1, 0.23, 30, 1.0)]).ranks == ()  # 27 %
    # Two peers: half their difference, at least 8 %: 3.59 x 8 % = 29 %.
    def three(late: float, other: float = 0.5) -> list[RankWait]:
        return [_steady(0, 0.5, 30, 1.0), _steady(1, other, 30, 1.0), _steady(2, 0.5 - late, 30, 1.0)]

    assert straggler_verdict(three(0.30)).ranks == (2,) and straggler_verdict(three(0.27)).ranks == ()
    # Two peers 30 % apart measure more than the floor: 1.4826 x 15 % x 3.59 = 80 %.
    assert job_noise(shares_of([0.5, 0.2, 0.0])).spread == pytest.approx(1.4826 * 0.15)
    assert straggler_verdict(three(0.5, other=0.2)).ranks == ()
    # Four ranks: three peers, the floor is 2 %.
    assert job_noise([0.0, 0.0, 0.0, 0.3]).threshold == pytest.approx(noise_multiplier(4) * SPREAD_FLOOR)


def test_the_verdict_keeps_to_the_cost_floor_the_cap_and_enough_steps() -> None:
    tiny = [_steady(0, 0.004, 100, 0.005), _steady(1, 0.0025, 100, 0.005)]  # 1.5 ms of a 5 ms step: 30 %
    assert straggler_verdict(tiny).ranks == () and straggler_verdict(tiny).evidence.startswith("none (highest: rank 1")
    assert outliers([0.0, 0.3], [0.0, 0.0015]).tolist() == [False, False]
    assert outliers([0.0, 0.3], [0.0, 0.002]).tolist() == [False, True]
    # 10 late ranks of 31: the 8 latest are named, the latest first.
    job = [_steady(r, 0.5, 30, 1.0) for r in range(21)]
    job += [_steady(21 + i, 0.5 - (0.3 + 0.01 * i), 30, 1.0) for i in range(10)]
    assert straggler_verdict(job).ranks == tuple(range(30, 22, -1))
    assert straggler_verdict(job[:1]).ranks == () and straggler_verdict(job[:1]).evidence.startswith("n/a")
    # Two steps compared make two blocks, not three: no verdict can agree over three windows.
    short = [_steady(0, 0.5, 2, 1.0), _steady(1, 0.1, 2, 1.0), _steady(2, 0.5, 2, 1.0)]
    assert straggler_verdict(short).ranks == ()
    assert "above it in 2 of 2 blocks" in straggler_verdict(short).evidence


def test_a_few_bad_steps_make_no_straggler() -> None:
    # 39 steps of 0.1 s; rank 2 is on time but for 2 bad steps of 2 s in the first block: half of
    # the run's time is spent waiting for it, yet it is late in one block of three.
    peers = [RankWait(r, (0.05,) * 2 + (1.95,) * 2 + (0.05,) * 35, (0.1,) * 2 + (2.0,) * 2 + (0.1,) * 35) for r in (0, 1)]
    bursty = RankWait(2, (0.05,) * 2 + (0.0,) * 2 + (0.05,) * 35, (0.1,) * 2 + (2.0,) * 2 + (0.1,) * 35)
    (figure,) = [f for f in lateness([*peers, bursty]) if f.rank == 2]
    assert figure.share > 0.5 and figure.latest_steps == 2 and figure.median_s == pytest.approx(0.0)
    assert figure.outlier_blocks == 1 and straggler_verdict([*peers, bursty]).ranks == ()
