"""The straggler rule in one place: tensorplay/analysis/straggler.py and the alert agree.

The alert's thresholds are read from the rule file's expression (parsed, not matched as text) and
compared with the module's constants, its ``for:`` with the persistence the verdict asks of a
rank (late on two steps in three); the module's figure is checked on per-step waits whose answer is
known from the definition (docs/telemetry.md, "Lateness").
"""

from __future__ import annotations

import pytest

from tensorplay.analysis.straggler import (
    ALERT_FOR_WINDOWS,
    MAX_RANKS_PER_JOB,
    MIN_LATENESS_S,
    SHARE_THRESHOLD,
    RankWait,
    lateness,
    straggler_verdict,
)

from .alert_rules import alerts
from .promql import Aggregate, Binary, Literal, Vector, parse, walk


def _compared(name: str) -> float:
    """The number the alert compares the recorded series ``name`` with (``name >= number``)."""
    tree = parse(alerts()["TensorplayStragglerRank"]["expr"])
    (found,) = [node for node in walk(tree) if isinstance(node, Binary) and node.op == ">="
                and isinstance(node.lhs, Vector) and node.lhs.selector.metric == name]
    assert isinstance(found.rhs, Literal)
    return float(found.rhs.text)


def test_the_alert_and_the_module_share_the_thresholds() -> None:
    assert _compared("job_rank:tensorplay_step_lateness:ratio5m") == SHARE_THRESHOLD
    assert _compared("job_rank:tensorplay_step_lateness_seconds:mean5m") == MIN_LATENESS_S
    tree = parse(alerts()["TensorplayStragglerRank"]["expr"])
    (cap,) = [node for node in walk(tree) if isinstance(node, Aggregate) and node.op == "topk"]
    assert cap.grouping == ("job",) and isinstance(cap.param, Literal) and int(cap.param.text) == MAX_RANKS_PER_JOB
    assert isinstance(cap.expr, Vector) and cap.expr.selector.metric == "job_rank:tensorplay_step_lateness:ratio5m"


def _steady(rank: int, wait_s: float, steps: int, step_s: float) -> RankWait:
    """A rank that waits ``wait_s`` at the end of each of ``steps`` steps of ``step_s``."""
    return RankWait(rank, (wait_s,) * steps, (step_s,) * steps)


def test_the_alert_holds_longer_than_one_window_as_the_verdict_asks_most_steps() -> None:
    alert = alerts()["TensorplayStragglerRank"]
    minutes = {"m": 1, "h": 60}
    held = int(alert["for"][:-1]) * minutes[alert["for"][-1]]
    assert held >= ALERT_FOR_WINDOWS * 5 and "ratio5m" in alert["expr"]


def test_a_few_bad_steps_make_no_straggler_and_most_steps_do() -> None:
    # 40 steps of 0.1 s; ranks 0 and 1 wait 0.05 s at each step's end.
    steady = [_steady(0, 0.05, 40, 0.1), _steady(1, 0.05, 40, 0.1)]
    # Rank 2 is on time but for 2 bad steps of 2 s, at which it arrives 1.95 s after its peers:
    # half of the run's time is spent waiting for it, yet on 38 of 40 steps it costs nothing.
    bursty = RankWait(2, (0.05,) * 38 + (0.0, 0.0), (0.1,) * 38 + (2.0, 2.0))
    peers_at_burst = [RankWait(r, (0.05,) * 38 + (1.95, 1.95), (0.1,) * 38 + (2.0, 2.0)) for r in (0, 1)]
    (figure,) = [f for f in lateness([*peers_at_burst, bursty]) if f.rank == 2]
    assert figure.share == pytest.approx(0.5) and figure.per_step_s == pytest.approx(0.0975)  # the mean passes
    assert figure.latest_steps == figure.late_steps == 2 and figure.median_s == pytest.approx(0.0)
    assert not figure.passes()
    verdict = straggler_verdict([*peers_at_burst, bursty])
    assert verdict.ranks == ()
    assert verdict.evidence.startswith("none (highest: rank 2 costs the job 50 % of every step, late on 2 and the "
                                       "latest on 2 of 40 steps, median 0.0 ms late (mean 97.5 ms)")
    # Rank 2 late by 30 ms on 30 of the 40 steps (on time on the others) is named, and the words say how sure.
    late = RankWait(2, (0.02,) * 30 + (0.05,) * 10, (0.1,) * 40)
    verdict = straggler_verdict([*steady, late])
    assert verdict.ranks == (2,)
    assert verdict.evidence.endswith("late on 30 and the latest on 30 of 40 steps, median 30.0 ms late (mean 22.5 ms))")
    # Late on 26 of 40 (under two steps in three) with the same mean and median: not named.
    sometimes = RankWait(2, (0.05 - 0.03 * 30 / 26,) * 26 + (0.05,) * 14, (0.1,) * 40)
    (figure,) = [f for f in lateness([*steady, sometimes]) if f.rank == 2]
    assert figure.late_steps == 26 and figure.per_step_s == pytest.approx(0.0225) and figure.median_s > 0.01
    assert straggler_verdict([*steady, sometimes]).ranks == ()


def test_the_share_is_the_peers_wait_minus_the_ranks_own_over_the_step() -> None:
    # 100 steps of 0.2 s: ranks 0-2 wait 0.1 s at each step's end, rank 3 arrives 0.05 s later
    # and waits 0.05 s; rank 4 0.09 s.
    waits = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.05, 4: 0.09}
    figures = {f.rank: f for f in lateness([_steady(r, w, 100, 0.2) for r, w in waits.items()])}
    assert figures[3].share == pytest.approx(0.25)  # (0.1 - 0.05) / 0.2
    assert figures[3].per_step_s == pytest.approx(0.05)
    assert figures[3].peers_wait_s_per_step == pytest.approx(0.1) and figures[3].wait_s_per_step == pytest.approx(0.05)
    assert figures[4].share == pytest.approx(0.05) and figures[0].share == pytest.approx(0.0)
    verdict = straggler_verdict([_steady(r, w, 100, 0.2) for r, w in waits.items()])
    assert verdict.ranks == (3,) and verdict.share == pytest.approx(0.25)
    assert verdict.evidence.startswith("rank 3 costs the job 25 % of every step (50.0 ms:")


def test_the_verdict_keeps_to_the_thresholds_and_the_cap() -> None:
    # Just under the share, and a share over the threshold on steps too short for the floor.
    under = [_steady(0, 0.5, 100, 1.0), _steady(1, 0.5, 100, 1.0), _steady(2, 0.5 - 0.199, 100, 1.0)]
    assert straggler_verdict(under).ranks == ()
    tiny = [_steady(0, 0.004, 100, 0.005), _steady(1, 0.001, 100, 0.005)]  # 3 ms of a 5 ms step: 60 %
    assert straggler_verdict(tiny).ranks == () and straggler_verdict(tiny).evidence.startswith("none (highest: rank 1")
    # 10 late ranks of 31: the 8 latest are named, the latest first.
    job = [_steady(r, 0.5, 100, 1.0) for r in range(21)]
    job += [_steady(21 + i, 0.5 - (0.3 + 0.01 * i), 100, 1.0) for i in range(10)]
    assert straggler_verdict(job).ranks == tuple(range(30, 22, -1))
    assert straggler_verdict(job[:1]).ranks == () and straggler_verdict(job[:1]).evidence.startswith("n/a")
