"""``tensorplay report``: the HTML page built from real demo runs, checked by what its figures draw.

The demo runs are the session fixtures ``test_demo.py`` checks too (``demo_runs.py``). Each
test reads back the matplotlib artists of the report built from a run's spans — the lines, the
shadowed-step marks, the heatmap cells, the bars — and compares them with what the run did: its
injected straggler, its per-rank batch counts (``result-rank*.json``), its text report. Bad input
(missing or empty directory, truncated last line, spans of an unknown version, no matplotlib) is
run through the command line itself. The page is opened in headless Chromium.
"""

from __future__ import annotations

import html
import io
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import tensorplay.report
from tensorplay.analysis.communication_text import (
    CANDIDATE_COLUMNS, NOT_ADVISED, NOT_MEASURED, advice_notes, candidate_rows, job_sentence,
)
from tensorplay.analysis.span_reader import read_spans
from tensorplay.analysis.summary import ModelSummary, summarize
from tensorplay.cli import main
from tensorplay.demo.rundir import RunDir
from tensorplay.demo.table import RankFacts, render
from tensorplay.report import build_report
from tensorplay.report.build import ModelReport, Report
from tensorplay.report.cli import demo_report_line
from tensorplay.telemetry import DEFAULT_ERROR_EVERY
from tensorplay.telemetry.names import ADVICE_SPAN_NAME, HOOK_SPAN_NAME, OPTIMIZER_STEP_SPAN_NAME, Attr, Candidate

from .chromium import chromium_path, visit
from .demo_runs import Demo
from .ranks import run_ranks

pytestmark = pytest.mark.timeout(180)


def _results(demo: Demo, world_size: int) -> list[dict]:
    """Each rank's result file, in rank order."""
    return [json.loads(RunDir(demo.run_dir).result(rank).read_text()) for rank in range(world_size)]


def _only_model(report: Report) -> ModelReport:
    """The report's one model (the demo trains one)."""
    assert [part.summary.model for part in report.models] == [0]
    return report.models[0]


def _artists(figure, gid: str) -> list:
    """The artists drawn with ``gid`` (one per bar for a bar chart)."""
    return figure.findobj(lambda artist: artist.get_gid() == gid)


def _artist(figure, gid: str):
    found = _artists(figure, gid)
    assert len(found) == 1, f"{gid}: {len(found)} artists"
    return found[0]


def _compute_means(figure, ranks) -> dict[int, float]:
    """Mean of each rank's drawn compute line."""
    return {rank: float(np.nanmean(_artist(figure, f"compute-rank{rank}").get_ydata())) for rank in ranks}


def _shadowed_steps(figure, rank: int) -> list[int]:
    return sorted(int(x) for x, _ in _artist(figure, f"shadowed-rank{rank}").get_offsets())


def _demo_page(demo: Demo) -> Path:
    """The page the demo wrote, found from the line it printed."""
    assert demo.returncode == 0, demo.stderr
    line = demo.stdout.strip().splitlines()[-1]
    assert line == f"HTML report: {demo.run_dir / 'report.html'}", demo.stdout
    return demo.run_dir / "report.html"


def test_straggler_line_is_highest_and_verdict_is_the_demos(two_ranks_straggler: Demo) -> None:
    demo = two_ranks_straggler
    page = _demo_page(demo).read_text()
    report = build_report(demo.run_dir)
    part = _only_model(report)
    means = _compute_means(part.figures["compute"], [0, 1])
    assert means[1] == max(means.values()) and means[1] > 1.5 * means[0], means
    assert _artist(part.figures["compute"], "compute-rank1").get_label() == "rank 1 (straggler)"
    # The same rule as the demo's text report, on the same end-of-step waits: the same words.
    assert part.verdict.rank == 1 and demo.verdict() == f"straggler: {part.verdict.evidence}"
    assert part.verdict.share >= part.verdict.noise.threshold
    assert f"<strong>straggler:</strong> {html.escape(part.verdict.evidence)}" in page
    # The metric the demo reads and the span-derived compute agree.
    for result, timing in zip(_results(demo, 2), part.run.compute_ms_mean(), strict=True):
        metric_ms = 1e3 * result["compute_seconds_sum"] / result["compute_seconds_count"]
        assert abs(timing - metric_ms) < max(3.0, 0.15 * metric_ms), (timing, metric_ms)
    # It waits least in every allreduce: its heatmap row is the darkest.
    cells = _artist(part.figures["latency"], "latency-by-step").get_array()
    assert cells[1].mean() < cells[0].mean()
    # allreduce_hook sends what it is handed; nothing to say about compression; no Join.
    handed = _artist(part.figures["bytes"], "bytes-handed").get_width()
    wire = _artist(part.figures["bytes"], "bytes-wire").get_width()
    assert handed == wire > 0
    assert part.figures["compression"] is None and part.figures["join"] is None
    assert "no sampled compression error" in page and "No Join in this run" in page


def test_uneven_straggler_shadowed_steps_are_marked(three_ranks_uneven_straggler: Demo) -> None:
    demo = three_ranks_uneven_straggler
    report = build_report(demo.run_dir)
    part = _only_model(report)
    batches = [result["batches"] for result in _results(demo, 3)]
    figure = part.figures["compute"]
    for rank, trained in enumerate(batches):
        assert _shadowed_steps(figure, rank) == list(range(trained, max(batches))), rank
        drawn = _artist(figure, f"compute-rank{rank}").get_ydata()
        assert np.isnan(drawn[trained:]).all()  # shadowed: no compute drawn
    means = _compute_means(figure, [0, 1, 2])
    assert means[2] == max(means.values()), means
    # Every point of every line lies inside the axes: none clipped at the top.
    drawn = np.concatenate([_artist(figure, f"compute-rank{rank}").get_ydata() for rank in range(3)])
    assert np.nanmax(drawn) < figure.axes[0].get_ylim()[1]
    # The heatmap marks each step a rank shadowed (its latency is its peers' work, not its slowness).
    marks = _artist(part.figures["latency"], "latency-shadowed").get_offsets()
    assert sorted((int(y), int(x)) for x, y in marks) == [
        (rank, step) for rank, trained in enumerate(batches) for step in range(trained, max(batches))]
    assert part.verdict.rank == 2 and demo.verdict() == f"straggler: {part.verdict.evidence}"
    shadow_bars = [bar.get_width() for bar in _artists(part.figures["join"], "shadow-iterations")]
    assert shadow_bars == [float(row["shadowed"]) for row in demo.table()]


def test_uneven_inputs_marked_and_no_straggler(three_ranks_uneven: Demo) -> None:
    demo = three_ranks_uneven
    page = _demo_page(demo).read_text()
    report = build_report(demo.run_dir)
    part = _only_model(report)
    batches = [result["batches"] for result in _results(demo, 3)]
    for rank, trained in enumerate(batches):
        assert _shadowed_steps(part.figures["compute"], rank) == list(range(trained, max(batches)))
    assert part.verdict.rank is None and demo.verdict() == f"straggler: {part.verdict.evidence}"
    assert demo.verdict().startswith("straggler: none")
    assert 'class="verdict none"' in page and "(straggler)" not in page
    for rank in range(3):  # each rank's time line ends when all had joined
        training = _artist(part.figures["join"], f"training-rank{rank}")
        joined = _artist(part.figures["join"], f"join-rank{rank}")
        assert 0 < joined.get_x() < training.get_width()  # ran out of inputs after its own steps
        assert joined.get_x() + joined.get_width() == pytest.approx(training.get_width())  # then waited, to the end
    ends = [_artist(part.figures["join"], f"join-rank{rank}") for rank in range(3)]
    assert max(e.get_x() + e.get_width() for e in ends) - min(e.get_x() + e.get_width() for e in ends) < 0.5


def test_fp16_error_at_sampled_steps_and_half_the_bytes(two_ranks: Demo) -> None:
    demo = two_ranks
    _demo_page(demo)
    report = build_report(demo.run_dir)
    part = _only_model(report)
    error = _artist(part.figures["compression"], "relative-error")
    assert list(error.get_xdata()) == list(range(0, 12, DEFAULT_ERROR_EVERY))
    # fp16 rounds twice (cast, then divide): at most 2 x 2^-11 relative error, and never exact.
    assert all(0 < value <= 2**-10 for value in error.get_ydata())
    # A handful of distinct, labelled ticks inside the view (not nine crowded log ticks on a narrow range).
    axes = part.figures["compression"].axes[0]
    low, high = axes.get_ylim()
    ticks = [tick for tick in axes.get_yticks() if low <= tick <= high]
    part.figures["compression"].canvas.draw()
    labels = [label.get_text() for label in axes.get_yticklabels() if low <= label.get_position()[1] <= high]
    assert 2 <= len(ticks) <= 6 and len(set(labels)) == len(labels) and all(labels), (ticks, labels)
    counts, edges, _ = _artist(part.figures["compression"], "nonfinite").get_data()
    assert len(counts) == 12 and not counts.any()
    handed = _artist(part.figures["bytes"], "bytes-handed").get_width()
    wire = _artist(part.figures["bytes"], "bytes-wire").get_width()
    assert wire == handed / 2


def test_exposed_communication_and_the_advice_are_the_analysis_figures(two_ranks: Demo) -> None:
    """The demo (advice every 5 steps by default: steps 4 and 9 of 12), its page and its figures say
    what communication costs the step and what each candidate would give, from the one derivation."""
    demo = two_ranks
    page = _demo_page(demo).read_text()
    part = _only_model(build_report(demo.run_dir))
    figures = part.summary.communication
    assert len(figures.ranks) == 2 and all(r.steps == 11 for r in figures.ranks)  # every step after the first
    assert figures.job.exposed_ms == min(r.exposed_ms for r in figures.ranks)
    sentence = job_sentence(figures)
    assert demo.communication() == sentence and f"<p class=\"says\">{html.escape(sentence)}</p>" in page
    # Per rank, the figure's bars are its mean busy time and exposed communication, end to end.
    drawing = part.figures["communication"]
    for r in figures.ranks:
        busy, exposed = _artist(drawing, f"busy-rank{r.rank}"), _artist(drawing, f"exposed-rank{r.rank}")
        assert (busy.get_x(), busy.get_width()) == (0, pytest.approx(r.busy_ms))
        assert (exposed.get_x(), exposed.get_width()) == (pytest.approx(r.busy_ms), pytest.approx(r.exposed_ms))
    row = part.run.row(figures.job.rank)
    drawn, _, _ = _artist(drawing, "steps-exposed").get_data()
    np.testing.assert_allclose(drawn, part.run.busy_ms[row] + part.run.exposed_ms[row])  # the job's rank, each step
    # The advice: every candidate, of both ranks' advised steps; fp16 halves float32 buckets, which the
    # running hook (fp16_compress_hook) already does: nothing to win back there.
    # An iteration whose turn comes while the previous advice is still computed is skipped: the first never is.
    assert figures.advised_ranks == 2 and figures.advised_steps[0] == 4 and set(figures.advised_steps) <= {4, 9}
    by_name = {c.candidate: c for c in figures.candidates}
    assert figures.wire_ratio == by_name["fp16"].wire_ratio == by_name["bf16"].wire_ratio == 0.5
    assert by_name["fp16"].win_back_ms == 0 and by_name["fp16"].nonfinite == 0
    for name in ("powersgd_rank1", "powersgd_rank2", "powersgd_rank4"):
        gain = by_name[name].win_back_ms
        assert by_name[name].wire_ratio < 0.5 and 0 < gain < figures.job.exposed_ms, (name, gain)
    for candidate in figures.candidates:
        (point,) = _artist(part.figures["advice"], f"advice-{candidate.candidate}").get_offsets()
        assert tuple(point) == (pytest.approx(candidate.wire_ratio), pytest.approx(candidate.error))
    assert part.figures["advice"].axes[0].get_yscale() == "log"
    # The demo's table and the page's are the analysis' cells.
    assert [tuple(row.values()) for row in demo.candidates()] == candidate_rows(figures)
    assert [list(row.keys()) for row in demo.candidates()] == [list(CANDIDATE_COLUMNS)] * len(Candidate.ALL)
    table = re.search(r'<table class="figures" id="advice-table">(.*?)</table>', page).group(1)
    assert re.findall(r"<tr>(.*?)</tr>", table)[1:] == [
        "".join(f"<td>{html.escape(cell)}</td>" for cell in row) for row in candidate_rows(figures)]
    for note in advice_notes(figures):
        assert note in demo.stdout and html.escape(note) in page


def test_the_advice_figure_draws_an_overflow_above_every_error_and_rings_it() -> None:
    """A candidate without a finite error (fp16 overflowed on every advised iteration) is drawn above
    the others, ringed red, never where a small error would be; an exact one (error 0) below them."""
    from tensorplay.report import plots

    from .test_communication_analysis import TWO_RANKS, _advice, _spans

    overflow, exact = {Candidate.FP16: (float("nan"), 0.5, 9)}, {Candidate.BF16: (0.0, 0.5, 0)}
    (summary,) = summarize(_spans(TWO_RANKS, advice=[_advice(0, 4, **overflow, **exact), _advice(1, 4, **overflow, **exact)]))
    figure = plots.advice_figure(summary.communication)
    heights = {name: _artist(figure, f"advice-{name}").get_offsets()[0][1] for name in Candidate.ALL}
    others = [heights[name] for name in Candidate.ALL if name not in (Candidate.FP16, Candidate.BF16)]
    assert heights[Candidate.FP16] > max(others) and heights[Candidate.BF16] < min(others), heights
    assert _artist(figure, "advice-overflow-fp16").get_offsets()[0][1] == heights[Candidate.FP16]
    assert not _artists(figure, "advice-overflow-bf16")
    assert _artist(figure, "advice-running").get_xdata()[0] == summary.communication.wire_ratio


def test_spans_of_a_run_without_the_step_timeline_or_advice_say_not_measured(
        two_ranks: Demo, tmp_path: Path, capsys) -> None:
    """Span files of a tensorplay before issue 36 (no step figures, no advice spans): the page is drawn
    and says what was not measured, and how to get the advice."""
    copy = _copy_spans(two_ranks, tmp_path, [0, 1])
    for rank in (0, 1):
        spans = [json.loads(line) for line in copy.spans(rank).read_text().splitlines()]
        for span in spans:
            for name in (Attr.STEP_BUSY_MS, Attr.STEP_EXPOSED_COMMUNICATION_MS, Attr.STEP_COMMUNICATION_MS):
                span["attributes"].pop(name, None)
        copy.spans(rank).write_text("".join(json.dumps(span) + "\n" for span in spans if span["name"] != ADVICE_SPAN_NAME))
    code, out, err = _run_report(capsys, str(tmp_path), "--out", str(tmp_path / "page.html"))
    assert code == 0 and err == "", err
    assert out.splitlines()[1] == f"communication: {NOT_MEASURED}"
    page = (tmp_path / "page.html").read_text()
    assert html.escape(f"Communication {NOT_MEASURED}.") in page and html.escape(f"{NOT_ADVISED}.") in page
    assert page.count("<img ") == 5  # cost, compute, latency, bytes, compression: neither of the new two
    assert [row["exposed comm"] for row in _page_table(page)] == ["-", "-"]


def _cells(text: str) -> float:
    """The number a table cell shows ("12.34 ms", "21 %", "7")."""
    return float(text.split()[0])


def _page_table(page: str) -> list[dict[str, str]]:
    """The page's per-rank table, by column name."""
    table = re.search(r'<table class="ranks"[^>]*>(.*?)</table>', page).group(1)
    rows = [[html.unescape(cell) for cell in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", table)]
    return [dict(zip(rows[0], row)) for row in rows[1:]]


def _assert_shows(rows: list[dict[str, str]], summary: ModelSummary) -> None:
    """Each rendered figure is the analysis' figure, to the digits shown."""
    assert [int(row["rank"]) for row in rows] == [r.rank for r in summary.ranks]
    for row, r in zip(rows, summary.ranks):
        late = r.lateness
        assert int(row["steps"]) == r.steps and row["shadowed"] == ("-" if r.shadowed is None else str(r.shadowed))
        assert _cells(row["allreduce p50"]) == pytest.approx(r.latency_ms_p50, abs=0.0051)
        assert _cells(row["compute mean"]) == pytest.approx(r.compute_ms_mean, abs=0.051)
        assert _cells(row["end wait"]) == pytest.approx(r.end_wait_ms, abs=0.051)
        assert _cells(row["costs the job"]) == pytest.approx(100 * max(late.share, 0.0), abs=0.51)
        assert row["latest on"] == f"{late.latest_steps}/{late.steps}"
        assert _cells(row["median late"]) == pytest.approx(1e3 * max(late.median_s, 0.0), abs=0.051)
        assert _cells(row["join wait"]) == pytest.approx(r.join_wait_ms, abs=0.51)
        assert row["last joiner"] == ("yes" if r.last_joiner else "no")


def test_the_demo_table_and_the_page_show_the_analysis_figure_for_figure(
        three_ranks_uneven_straggler: Demo, tmp_path: Path, capsys) -> None:
    demo = three_ranks_uneven_straggler
    (summary,) = summarize(read_spans(demo.run_dir))  # the one derivation, straight from the run's files
    assert summary.verdict.rank == 2 and all(r.shadowed is not None for r in summary.ranks)
    page = _demo_page(demo).read_text()
    _assert_shows(demo.table(), summary)
    _assert_shows(_page_table(page), summary)
    assert demo.verdict() == f"straggler: {summary.verdict.evidence}"
    assert f"<strong>straggler:</strong> {html.escape(summary.verdict.evidence)}" in page
    # The Join figures of the page are the same numbers again.
    shadow_bars = [bar.get_width() for bar in _artists(build_report(demo.run_dir).models[0].figures["join"],
                                                       "shadow-iterations")]
    assert shadow_bars == [float(r.shadowed) for r in summary.ranks]


def test_the_command_prints_the_verdict_line(two_ranks_straggler: Demo, tmp_path: Path, capsys) -> None:
    code, out, _ = _run_report(capsys, str(two_ranks_straggler.run_dir), "--out", str(tmp_path / "page.html"))
    assert code == 0
    lines = out.splitlines()
    assert [lines[0], lines[1], lines[-1]] == [two_ranks_straggler.verdict(), two_ranks_straggler.communication(),
                                          f"report: {tmp_path / 'page.html'}"]
    # 10 optimizer steps per rank, fingerprinted after steps 5 and 10 (the demo's interval): the
    # spans show the 9 steps a later iteration followed, and step 5's fingerprint, which rode on the
    # iteration after it (step 10's had none after it).
    assert lines[2:-1] == [
        "gradient reductions: 1 per optimizer step on every rank (9 steps each): as it should be, each step's "
        "gradients reduced once",
        "unreduced optimizer steps: none (every step followed a reduction of the models it updated)",
        "replica fingerprints: equal on every rank at the 1 step compared (5): the replicas are the same model",
    ]
    assert {json.loads(line)["name"] for line in RunDir(two_ranks_straggler.run_dir).spans(0).read_text().splitlines()} \
        == {HOOK_SPAN_NAME, ADVICE_SPAN_NAME}  # no optimizer step span: none went unreduced


def test_unreduced_steps_after_the_last_hook_call_are_named_from_their_own_spans(
        two_ranks_never_synced: Demo, tmp_path: Path, capsys) -> None:
    """no_sync() entered after the first step and never left: no hook call follows, each unreduced
    step's span says so; a damaged one is skipped and named, the rest still counted."""
    code, out, _ = _run_report(capsys, str(two_ranks_never_synced.run_dir), "--out", str(tmp_path / "page.html"))
    assert code == 0
    lines = out.splitlines()
    demo_lines = two_ranks_never_synced.stdout.splitlines()
    assert lines[2:5] == [line for line in demo_lines if line.startswith(("gradient reductions:", "unreduced optimizer",
                                                                          "replica fingerprints:"))]
    assert lines[3].startswith("unreduced optimizer steps: rank 0: 9 of 10, rank 1: 9 of 10, the first at step 2:")
    assert '<section class="verdict" id="sync">' in (tmp_path / "page.html").read_text()

    copy = _copy_spans(two_ranks_never_synced, tmp_path, [0, 1])
    unreduced = [number for number, line in enumerate(copy.spans(0).read_text().splitlines())
                 if json.loads(line)["name"] == OPTIMIZER_STEP_SPAN_NAME]
    assert len(unreduced) == 9
    _rewrite(copy.spans(0), {
        unreduced[-1]: lambda span: span["attributes"].update({Attr.OPTIMIZER_STEPS: 10**9}),  # step 10's
        unreduced[0]: lambda span: span["attributes"].pop(Attr.OPTIMIZER_MODEL),  # step 2's
    })
    code, out, err = _run_report(capsys, str(copy.path), "--out", str(tmp_path / "page.html"))
    assert code == 2
    assert (f"spans-rank0.jsonl: line {unreduced[-1] + 1}: implausible values (a damaged line?): "
            f"{Attr.OPTIMIZER_STEPS} = 1000000000") in err
    assert f"spans-rank0.jsonl: line {unreduced[0] + 1}: spans of an unknown version: " \
           f"{OPTIMIZER_STEP_SPAN_NAME} without an integer in {Attr.OPTIMIZER_MODEL}" in err
    # Rank 0's steps 3 to 9 are still read: step 2's number is implied by the count of step 3's.
    assert "unreduced optimizer steps: rank 0: 8 of 9, rank 1: 9 of 10, the first at step 2:" in out


def test_the_cost_share_is_drawn_per_rank(two_ranks_straggler: Demo) -> None:
    part = _only_model(build_report(two_ranks_straggler.run_dir))
    figure = part.figures["cost"]
    for r in part.summary.ranks:
        bar = _artist(figure, f"cost-rank{r.rank}")
        assert bar.get_width() == pytest.approx(100 * max(r.lateness.share, 0.0))
        assert (bar.get_facecolor()[0] > 0.8) == (r.rank == part.verdict.rank)  # the straggler's bar is red
    medians = sorted(x for x, _ in _artist(figure, "cost-median").get_offsets())
    assert medians == pytest.approx(sorted(100 * max(r.lateness.median_share, 0.0) for r in part.summary.ranks))
    # The dashed line is the job's threshold, the verdict's: what its own noise explains.
    assert _artist(figure, "cost-threshold").get_xdata()[0] == pytest.approx(100 * part.verdict.noise.threshold)


GAN_STEPS = 4


def _gan(rank: int, world_size: int, span_dir: str) -> None:
    """One traced hook on a GAN's two DDP models, one step of each per iteration, spans to a file."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tensorplay import traced
    from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
    from tensorplay.telemetry import configure_tracing, flush

    provider = configure_tracing(span_file=str(RunDir(span_dir).spans(rank)), otlp=False)
    torch.manual_seed(0)
    generator = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)))
    discriminator = DDP(nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.Linear(512, 1)))
    hook = traced(default_hooks.allreduce_hook)
    generator.register_comm_hook(None, hook)
    discriminator.register_comm_hook(None, hook)
    for _ in range(GAN_STEPS):
        generator(torch.randn(4, 8)).square().mean().backward()
        discriminator(torch.randn(4, 16)).square().mean().backward()
    flush(30)
    provider.force_flush()


def test_one_hook_on_two_models_is_reported_per_model(tmp_path: Path, capsys) -> None:
    run_ranks(_gan, 2, str(tmp_path))
    code, out, err = _run_report(capsys, str(tmp_path), "--out", str(tmp_path / "page.html"))
    assert code == 0 and "more than one run" not in err, err
    assert [line.split(":")[0] for line in out.splitlines()] == [
        "straggler (model 0)", "straggler (model 1)", "communication (model 0)", "communication (model 1)",
        "gradient synchronisation", "report"]  # no optimizer here
    spans = read_spans(tmp_path)
    report = build_report(tmp_path)
    assert [part.summary.model for part in report.models] == [0, 1] and not report.problems
    for part in report.models:
        run = part.run
        assert run.steps == GAN_STEPS and run.duplicates == 0 and list(run.trained_steps()) == [GAN_STEPS] * 2
        for row, rank in enumerate(run.ranks):  # each model's p50 is of its own spans only
            mine = (spans.hooks.model == part.summary.model) & (spans.hooks.rank == rank)
            assert part.summary.ranks[row].latency_ms_p50 == pytest.approx(np.median(spans.hooks.latency_ms[mine]))
            assert part.summary.ranks[row].bucket_bytes == spans.hooks.bucket_bytes[mine].sum()
    # The discriminator's buckets are the bigger ones: the models' bytes were not merged.
    assert report.models[1].summary.ranks[0].bucket_bytes > 10 * report.models[0].summary.ranks[0].bucket_bytes
    page = (tmp_path / "page.html").read_text()
    assert 'id="model0-verdict"' in page and 'id="model1-verdict"' in page and page.count('class="ranks"') == 2


def _run_report(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["report", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_missing_and_empty_run_dir(tmp_path: Path, capsys) -> None:
    code, _, err = _run_report(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, _, err = _run_report(capsys, str(tmp_path / "empty"))
    assert code == 2 and "no span files (*.jsonl)" in err
    assert not list(tmp_path.rglob("*.html"))


def test_truncated_and_unknown_spans_are_named_and_the_rest_drawn(
        two_ranks_straggler: Demo, tmp_path: Path, capsys) -> None:
    source, copy = RunDir(two_ranks_straggler.run_dir), RunDir(tmp_path)
    for rank in range(2):
        shutil.copy(source.spans(rank), copy.spans(rank))
    rank0, rank1 = copy.spans(0), copy.spans(1)
    content = rank1.read_bytes()
    last = content.splitlines()[-1]
    rank1.write_bytes(content[:len(content) - 1 - len(last) // 2])  # the job died in the middle of a line
    lines = rank0.read_text().splitlines()
    newer = json.loads(lines[5])
    del newer["attributes"][Attr.STEP]  # a shape this version does not know
    renamed = dict(json.loads(lines[6]), name=HOOK_SPAN_NAME + "_v2")
    application = dict(json.loads(lines[7]), name="my.own.span", attributes={"user": 1})
    lines[5:7] = [json.dumps(newer), json.dumps(renamed), json.dumps(application)]
    rank0.write_text("\n".join(lines) + "\n")

    code, out, err = _run_report(capsys, str(tmp_path), "--out", str(tmp_path / "page.html"))
    assert code == 2
    assert f"{rank1.name}: line {len(content.splitlines())}: the last line is truncated" in err
    assert f"{rank0.name}: 2 lines: spans of an unknown version, the first line 6" in err
    assert f"without an integer in {Attr.STEP}" in err
    assert out.strip().splitlines()[-1] == f"report: {tmp_path / 'page.html'}"
    page = (tmp_path / "page.html").read_text()
    assert "Input that could not be read" in page and "the last line is truncated" in page
    assert page.count("<img ") == 6  # cost, compute, communication, latency, bytes, advice: all the run has, still drawn
    assert "straggler:</strong> rank 1 " in page


def _copy_spans(demo: Demo, to: Path, ranks: list[int]) -> RunDir:
    """A run directory in ``to`` holding the span files of ``ranks`` of the demo's run."""
    source, copy = RunDir(demo.run_dir), RunDir(to)
    for rank in ranks:
        shutil.copy(source.spans(rank), copy.spans(rank))
    return copy


def _rewrite(path: Path, change: dict[int, Callable[[dict], None]]) -> None:
    """Rewrite span file ``path``, applying ``change[i]`` to the span on line i (0-based)."""
    lines = path.read_text().splitlines()
    for index, apply in change.items():
        span = json.loads(lines[index])
        apply(span)
        lines[index] = json.dumps(span)
    path.write_text("\n".join(lines) + "\n")


def test_a_rank_without_spans_is_named_and_the_verdict_says_it_cannot_judge_it(
        three_ranks_uneven_straggler: Demo, tmp_path: Path, capsys) -> None:
    """The straggler's file is missing (a rank killed before its last export, a node's file not
    copied): the report used to say `straggler: none` for "2 ranks", exit 0."""
    demo = three_ranks_uneven_straggler
    copy = _copy_spans(demo, tmp_path, [0, 1])
    code, out, err = _run_report(capsys, str(tmp_path), "--out", str(tmp_path / "page.html"))
    missing = ("no spans of rank 2 of the 3 the spans say (tensorplay.world_size): killed before it exported, or a "
               "file not copied here? Missing from the figures, and the straggler verdict cannot judge it")
    assert code == 2 and err == f"tensorplay report: {missing}\n", err
    verdict = out.splitlines()[0]
    assert verdict.startswith("straggler: rank 2 of 3 cannot be judged (no spans of it were read); of the other 2: "), out
    page = (tmp_path / "page.html").read_text()
    assert html.escape(missing) in page and " · 2 of 3 ranks · " in page
    assert f'<section class="verdict unjudged" id="verdict"><strong>straggler:</strong> {html.escape(verdict[11:])}' in page
    assert page.count("<img ") == 8  # every figure, of the two ranks read
    # The demo's table says it too: the same derivation, rendered with what the demo injected.
    (summary,) = summarize(read_spans(tmp_path))
    facts = [RankFacts(rank, "sleeps 40 ms per step" if rank == 2 else None, None) for rank in range(3)]
    text = render(summary, facts, "fp16_compress_hook", RunDir(tmp_path)).splitlines()
    assert f"straggler: {summary.verdict.evidence}" == verdict and f"spans: {missing}" in text
    assert "injected: rank 2 sleeps 40 ms per step (cannot be judged: no spans of it)" in text

    # Spans that disagree on the world size (a few lines of rank 1 say 4) are named, file by file.
    def says_four(span: dict) -> None:
        span["attributes"][Attr.WORLD_SIZE] = span["resource"]["attributes"][Attr.WORLD_SIZE] = 4

    _rewrite(copy.spans(1), {index: says_four for index in (3, 4, 5)})
    lines = [sum(json.loads(line)["name"] != ADVICE_SPAN_NAME for line in copy.spans(rank).read_text().splitlines())
             for rank in (0, 1)]  # the world size each hook span says (advice spans are not counted)
    code, _, err = _run_report(capsys, str(tmp_path), "--out", str(tmp_path / "page.html"))
    assert code == 2 and err.splitlines() == [
        f"tensorplay report: {missing}",
        f"tensorplay report: the spans disagree on the job's world size: 3 (spans-rank0.jsonl, spans-rank1.jsonl: "
        f"{sum(lines) - 3} spans), 4 (spans-rank1.jsonl: 3 spans): files of more than one job, or a damaged line? "
        f"Ranks are judged against 3, which most spans say"], err


def test_a_damaged_line_is_skipped_and_counted_never_allocated_by(
        two_ranks_straggler: Demo, tmp_path: Path, capsys) -> None:
    """A step of 10^9 on one line had the report lay out 10^9 steps (tens of GiB, then killed).
    The reading is checked first, so the old code fails here before it allocates anything."""
    copy = _copy_spans(two_ranks_straggler, tmp_path, [0, 1])
    steps = read_spans(tmp_path).hooks.step.max()

    def setting(name: str, value: int) -> Callable[[dict], None]:
        return lambda span: span["attributes"].__setitem__(name, value)

    # Four hook calls' spans from the 11th on (an advice span, which ends when its advice is done, may lie between).
    hook_lines = [index for index, line in enumerate(copy.spans(1).read_text().splitlines())
                  if json.loads(line)["name"] == HOOK_SPAN_NAME][10:14]
    _rewrite(copy.spans(1), dict(zip(hook_lines, (setting(Attr.STEP, 10**9), setting(Attr.BUCKET_INDEX, 10**9),
                                                  setting(Attr.BUCKET_BYTES, -5), setting(Attr.RANK, 5)))))
    spans = read_spans(tmp_path)
    (problem,) = spans.problems
    assert re.fullmatch(r"spans-rank1\.jsonl: 4 lines: implausible values \(a damaged line\?\), the first line "
                        f"{hook_lines[0] + 1}: "
                        r"tensorplay\.step = 1000000000, where the run's median is [\d.]+ \(more than 4 x [\d.]+ \+ 100 "
                        r"is taken for damage\); skipped", problem), problem
    assert spans.hooks.step.max() == steps and spans.hooks.bucket.max() < 100
    assert set(spans.hooks.rank.tolist()) == {0, 1} and spans.hooks.bucket_bytes.min() > 0
    code, out, err = _run_report(capsys, str(tmp_path), "--out", str(tmp_path / "page.html"))
    assert code == 2 and err == f"tensorplay report: {problem}\n"
    assert out.splitlines()[0].startswith("straggler: rank 1 costs the job")
    assert html.escape(problem) in (tmp_path / "page.html").read_text()
    # Only these lines: a rank's resource says the job's size, so a rank beyond it is damage.
    _rewrite(copy.spans(1), {hook_lines[3]: setting(Attr.RANK, 1)})
    (problem,) = read_spans(tmp_path).problems
    assert problem.startswith("spans-rank1.jsonl: 3 lines: implausible values")


def test_without_matplotlib_the_command_says_how_and_the_demo_goes_on(
        two_ranks: Demo, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.delitem(sys.modules, "tensorplay.report.plots", raising=False)
    monkeypatch.delattr(tensorplay.report, "plots", raising=False)  # as if never imported
    code, _, err = _run_report(capsys, str(two_ranks.run_dir), "--out", str(tmp_path / "page.html"))
    assert code == 1 and "pip install 'tensorplay[report]'" in err
    assert demo_report_line(two_ranks.run_dir) == (
        f"HTML report: pip install 'tensorplay[report]', then tensorplay report {two_ranks.run_dir}")
    assert not (tmp_path / "page.html").exists()


def test_page_renders_in_headless_chromium(three_ranks_uneven_straggler: Demo, tmp_path: Path) -> None:
    if chromium_path() is None:
        pytest.fail("Debian's chromium is needed (apt-get install chromium; .ci/run installs it)")
    from PIL import Image

    page = _demo_page(three_ranks_uneven_straggler)
    seen = visit(page, width=1200)
    assert seen.errors == []
    assert seen.requests[0] == page.as_uri()
    assert all(url.startswith("data:image/png;base64,") for url in seen.requests[1:])  # self-contained
    assert len(seen.images) == 8
    assert {"Busy time and exposed communication per step, per rank",
            "What another hook would give: the compression advice"} <= {image["alt"] for image in seen.images}
    for image in seen.images:
        assert image["complete"] and image["width"] > 0 and image["height"] > 0 and image["shown"] > 0, image
    (tmp_path / "report.png").write_bytes(seen.screenshot)
    screenshot = Image.open(io.BytesIO(seen.screenshot)).convert("RGB")
    pixels = np.asarray(screenshot).astype(int)
    assert screenshot.width == 1200 and screenshot.height > 1500  # the whole page, every figure
    drawn = (pixels < 245).any(axis=2).mean()
    colourful = (pixels.max(axis=2) - pixels.min(axis=2) > 80).mean()
    assert drawn > 0.05 and colourful > 0.02, (drawn, colourful)
