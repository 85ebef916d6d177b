"""The straggler rule in one place: tensorplay/analysis/straggler.py and the alert agree.

The alert's thresholds are read from the rule file's expression (parsed, not matched as text) and
compared with the module's constants; the module's figure is checked on totals whose answer is
known from the definition (docs/telemetry.md, "Lateness").
"""

from __future__ import annotations

import pytest

from tensorplay.analysis.straggler import (
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


def test_the_share_is_the_peers_wait_minus_the_ranks_own_over_the_step() -> None:
    # 100 steps of 0.2 s: ranks 0-2 wait 0.1 s at each step's end, rank 3 arrives 0.05 s later
    # and waits 0.05 s; rank 4 0.09 s.
    waits = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.05, 4: 0.09}
    figures = {f.rank: f for f in lateness([RankWait(r, 100 * w, 100, 20.0) for r, w in waits.items()])}
    assert figures[3].share == pytest.approx(0.25)  # (0.1 - 0.05) / 0.2
    assert figures[3].per_step_s == pytest.approx(0.05)
    assert figures[3].peers_wait_s_per_step == pytest.approx(0.1) and figures[3].wait_s_per_step == pytest.approx(0.05)
    assert figures[4].share == pytest.approx(0.05) and figures[0].share == pytest.approx(0.0)
    verdict = straggler_verdict([RankWait(r, 100 * w, 100, 20.0) for r, w in waits.items()])
    assert verdict.ranks == (3,) and verdict.share == pytest.approx(0.25)
    assert verdict.evidence.startswith("rank 3 costs the job 25 % of every step (50.0 ms:")


def test_the_verdict_keeps_to_the_thresholds_and_the_cap() -> None:
    # Just under the share, and a share over the threshold on steps too short for the floor.
    under = [RankWait(0, 50.0, 100, 100.0), RankWait(1, 50.0, 100, 100.0), RankWait(2, 50.0 - 100 * 0.199, 100, 100.0)]
    assert straggler_verdict(under).ranks == ()
    tiny = [RankWait(0, 0.4, 100, 0.5), RankWait(1, 0.1, 100, 0.5)]  # 3 ms of a 5 ms step: 60 %
    assert straggler_verdict(tiny).ranks == () and straggler_verdict(tiny).evidence.startswith("none (highest: rank 1")
    # 10 late ranks of 31: the 8 latest are named, the latest first.
    job = [RankWait(r, 50.0, 100, 100.0) for r in range(21)]
    job += [RankWait(21 + i, 50.0 - 100 * (0.3 + 0.01 * i), 100, 100.0) for i in range(10)]
    assert straggler_verdict(job).ranks == tuple(range(30, 22, -1))
    assert straggler_verdict(job[:1]).ranks == () and straggler_verdict(job[:1]).evidence.startswith("n/a")
