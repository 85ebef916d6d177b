"""What communication costs the step, and what another hook would give, from the spans
(tensorplay/analysis/communication.py, its wording in communication_text.py): on spans made here,
whose figures are known from the definition (docs/telemetry.md, "Busy time and exposed
communication"; contract section 6), without ranks.

Each job is a few ranks x steps of one bucket; the span that closes a counted step carries its
busy time, exposed communication and communication (step 0, the first, carries none), and the
advice spans what each candidate would have made of an advised iteration.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tensorplay.analysis.communication import NO_PAYOFF_SHARE, communication, win_back_ms
from tensorplay.analysis.communication_text import (
    CANDIDATE_COLUMNS, NOT_ADVISED, NOT_MEASURED, advice_notes, candidate_rows, job_sentence,
)
from tensorplay.analysis.run import aggregate
from tensorplay.analysis.span_reader import AdviceSpan, HookSpans, Spans
from tensorplay.analysis.summary import summarize
from tensorplay.analysis.table import COLUMNS, rank_rows
from tensorplay.telemetry.names import Candidate

BUCKET_BYTES = 1_000_000
NAN = float("nan")


def _spans(timeline: dict[int, list[tuple[float, float, float] | None]], wire_ratio: float = 1.0,
           advice: list[AdviceSpan] = ()) -> Spans:
    """Spans of one bucket per rank and step; ``timeline[rank][step]`` is (busy, exposed, communication)
    in ms, or None for a step not counted (no figures on its span)."""
    rows = [(rank, step, figures) for rank, steps in timeline.items() for step, figures in enumerate(steps)]
    n = len(rows)
    figures = np.array([row[2] if row[2] is not None else (NAN, NAN, NAN) for row in rows], dtype=float)
    ints = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    hooks = HookSpans(
        rank=ints([row[0] for row in rows]), model=ints([0] * n), step=ints([row[1] for row in rows]),
        bucket=ints([0] * n), start_s=np.array([row[1] * 0.1 for row in rows]),
        end_s=np.array([row[1] * 0.1 + 0.05 for row in rows]), latency_ms=np.full(n, 5.0),
        bucket_bytes=ints([BUCKET_BYTES] * n), wire_bytes=ints([int(BUCKET_BYTES * wire_ratio)] * n),
        relative_error=np.full(n, NAN), nonfinite=ints([0] * n), bucket_nonfinite=ints([0] * n),
        busy_ms=figures[:, 0], exposed_communication_ms=figures[:, 1], communication_ms=figures[:, 2],
        hook=ints([0] * n), hook_names=["allreduce_hook"])
    return Spans(hooks, [], [Path("spans-rank0.jsonl")], advice=list(advice))


def _advice(rank: int, step: int, **errors: tuple[float, float, int]) -> AdviceSpan:
    """An advice span; each candidate (error, wire ratio, non-finite), fp16 and bf16 by default exact halves."""
    candidates = {name: (1e-4, 0.5 if name in (Candidate.FP16, Candidate.BF16) else 0.02, 0) for name in Candidate.ALL}
    candidates.update(errors)
    return AdviceSpan(rank, 0, step, "allreduce_hook", 0.0, 0.01, BUCKET_BYTES, candidates)


# Rank 0 waits for rank 1 (its exposed time holds that wait): rank 1's is the job's.
TWO_RANKS = {
    0: [None, (30.0, 20.0, 24.0), (34.0, 22.0, 26.0), (32.0, 24.0, 28.0)],
    1: [None, (44.0, 6.0, 18.0), (46.0, 4.0, 17.0), (48.0, 8.0, 22.0)],
}


def test_per_rank_means_over_the_counted_steps_and_the_job_is_the_rank_waited_for() -> None:
    figures = communication(aggregate(_spans(TWO_RANKS)))
    assert [r.rank for r in figures.ranks] == [0, 1]
    for r in figures.ranks:
        counted = [step for step in TWO_RANKS[r.rank] if step is not None]
        busy, exposed, comm = (float(np.mean([step[i] for step in counted])) for i in range(3))
        assert (r.steps, r.busy_ms, r.exposed_ms, r.communication_ms) == (len(counted), busy, exposed, comm)
        assert r.step_ms == busy + exposed and r.exposed_share == pytest.approx(exposed / (busy + exposed))
        assert r.hidden_share == pytest.approx(1 - exposed / comm)
    assert figures.job is figures.ranks[1]  # the least exposed: the one the others wait for
    assert figures.wire_ratio == 1.0 and figures.pays and figures.candidates == () and figures.advised == 0


def test_the_sentence_says_the_jobs_figures_and_the_most_compression_can_win_back() -> None:
    figures = communication(aggregate(_spans(TWO_RANKS)))
    job = figures.job
    assert job_sentence(figures) == (
        f"communication: {job.exposed_ms:.1f} ms of every {job.step_ms:.1f} ms step is exposed "
        f"({100 * job.exposed_share:.0f} %), on rank 1, the one the others wait for; the backward hides "
        f"{100 * job.hidden_share:.0f} % of it; a compression hook can win back at most {job.exposed_ms:.1f} ms per step")
    assert job_sentence(figures, " (model 1)").startswith("communication (model 1): 6.0 ms of every 52.0 ms step")
    assert advice_notes(figures) == [NOT_ADVISED] and candidate_rows(figures) == []


def test_under_the_threshold_no_compression_will_pay() -> None:
    # 1 ms of a 40 ms step (2.5 %) exposed, then 2.5 ms (6.25 %): the line is NO_PAYOFF_SHARE, 5 %.
    for exposed, pays in ((1.0, False), (2.5, True)):
        busy = 40.0 - exposed
        figures = communication(aggregate(_spans({0: [None, (busy, exposed, 10.0), (busy, exposed, 10.0)]})))
        assert figures.pays is pays and (figures.job.exposed_share < NO_PAYOFF_SHARE) is not pays
        sentence = job_sentence(figures)
        assert ("no compression will pay" in sentence) is not pays, sentence
        assert "the one the others wait for" not in sentence  # one rank: nobody waits for it
    assert sentence.endswith("a compression hook can win back at most 2.5 ms per step")
    quiet = job_sentence(communication(aggregate(_spans({0: [None, (39.0, 1.0, 10.0)]}))))
    assert quiet.endswith("; under 5 % of the step: no compression will pay (it could win back at most 1.0 ms per step)")


def test_win_back_scales_the_exposed_time_by_the_bytes_it_would_not_send() -> None:
    assert win_back_ms(10.0, 0.5, 1.0) == 5.0  # fp16 under allreduce_hook: half the bytes
    assert win_back_ms(10.0, 0.5, 0.5) == 0.0  # fp16 under fp16_compress_hook: nothing more to save
    assert win_back_ms(10.0, 0.02, 0.5) == pytest.approx(10.0 * (1 - 0.04))
    assert win_back_ms(10.0, 1.0, 0.5) == 0.0  # it would send more: never below 0
    assert win_back_ms(10.0, 0.0, 1.0) == 10.0  # never above the exposed time
    assert win_back_ms(10.0, 0.5, 0.0) == 0.0  # the running hook sends nothing (noop_hook)


def test_the_candidates_of_the_advice_and_what_each_would_win_back() -> None:
    overflow = {Candidate.FP16: (NAN, 0.5, 7)}  # the reader's NaN: an infinite error (fp16 overflow)
    advice = [_advice(0, 4), _advice(1, 4, **overflow), _advice(0, 9, powersgd_rank1=(0.3, 0.02, 0)),
              _advice(1, 9, powersgd_rank1=(0.5, 0.02, 0))]
    figures = communication(aggregate(_spans(TWO_RANKS, wire_ratio=0.5, advice=advice)))
    assert (figures.advised, figures.advised_ranks, figures.advised_steps) == (4, 2, (4, 9))
    by_name = {c.candidate: c for c in figures.candidates}
    assert list(by_name) == list(Candidate.ALL)
    fp16 = by_name[Candidate.FP16]
    assert (fp16.error, fp16.worst_error, fp16.nonfinite, fp16.overflowed) == (1e-4, 1e-4, 7, 1)  # finite ones only
    assert fp16.win_back_ms == 0.0  # the running hook already sends half
    rank1 = by_name[Candidate.POWERSGD_RANK1]
    assert (rank1.error, rank1.worst_error) == (pytest.approx(np.median([1e-4, 1e-4, 0.3, 0.5])), 0.5)
    assert rank1.win_back_ms == pytest.approx(figures.job.exposed_ms * (1 - 0.02 / 0.5))
    rows = {row[0]: dict(zip(CANDIDATE_COLUMNS, row)) for row in candidate_rows(figures)}
    assert rows["fp16"]["overflow"] == "7 (1 of 4)" and rows["fp16"]["on the wire"] == "x0.50"
    assert rows["powersgd_rank1"]["on the wire"] == "x0.020" and rows["powersgd_rank1"]["error (worst)"] == "5.00e-01"
    gain = rank1.win_back_ms
    assert rows["powersgd_rank1"]["wins back (estimate)"] == f"{gain:.1f} ms ({100 * gain / figures.job.step_ms:.0f} % of the step)"
    notes = advice_notes(figures)
    assert notes[0].startswith("compression advice: 4 advised iterations of 2 ranks (steps 4, 9): ")
    assert "(the running hook sent x0.50)" in notes[0]
    assert notes[1].startswith(f"wins back: an estimate, if the exposed communication scales with the bytes on the wire: "
                               f"{figures.job.exposed_ms:.1f} ms x (1 - on the wire / 0.50)")
    # A candidate without a single finite error says so rather than a number.
    never = communication(aggregate(_spans(TWO_RANKS, advice=[_advice(0, 4, **overflow)])))
    (fp16_row, *_) = candidate_rows(never)
    assert fp16_row[1:3] == ("-", "-")


def test_spans_without_the_step_figures_are_not_measured_and_say_so() -> None:
    """Spans of a tensorplay before the step timeline (or a run of one step): no figures, no failure."""
    old = _spans({0: [None, None, None], 1: [None, None, None]}, advice=[_advice(0, 1)])
    (summary,) = summarize(old)
    figures = summary.communication
    assert figures.ranks == () and figures.job is None and figures.pays is None
    assert job_sentence(figures) == f"communication: {NOT_MEASURED}"
    assert {row[0]: row[-1] for row in candidate_rows(figures)}["fp16"] == "-"  # no exposed time to win back from
    assert advice_notes(figures)[1] == "wins back: not estimated, the exposed communication was not measured"
    cells = [dict(zip(COLUMNS, row)) for row in rank_rows(summary)]
    assert [(row["exposed comm"], row["hidden"]) for row in cells] == [("-", "-")] * 2


def test_the_per_rank_table_shows_each_ranks_exposed_communication_and_hidden_share() -> None:
    (summary,) = summarize(_spans(TWO_RANKS))
    cells = [dict(zip(COLUMNS, row)) for row in rank_rows(summary)]
    for row, r in zip(cells, summary.communication.ranks):
        assert row["exposed comm"] == f"{r.exposed_ms:.1f} ms" and row["hidden"] == f"{100 * r.hidden_share:.0f} %"
    # A hook that launched no collective (noop_hook): nothing was in flight, nothing hidden.
    (noop,) = summarize(_spans({0: [None, (20.0, 0.1, 0.0)]}, wire_ratio=0.0))
    assert noop.communication.job.hidden_share is None and rank_rows(noop)[0][COLUMNS.index("hidden")] == "-"
    assert "no collective was in flight" in job_sentence(noop.communication)
    assert math.isclose(noop.communication.wire_ratio, 0.0)
