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
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorplay.report
from tensorplay.analysis.straggler import SHARE_THRESHOLD
from tensorplay.cli import main
from tensorplay.report import build_report
from tensorplay.report.cli import demo_report_line
from tensorplay.telemetry import DEFAULT_ERROR_EVERY
from tensorplay.telemetry.names import HOOK_SPAN_NAME, Attr

from .chromium import chromium_path, visit
from .demo_runs import Demo

pytestmark = pytest.mark.timeout(180)


def _results(demo: Demo) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(demo.run_dir.glob("result-rank*.json"))]


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
    means = _compute_means(report.figures["compute"], [0, 1])
    assert means[1] == max(means.values()) and means[1] > 1.5 * means[0], means
    assert _artist(report.figures["compute"], "compute-rank1").get_label() == "rank 1 (straggler)"
    # The same rule as the demo's text report, on the same end-of-step waits: the same words.
    assert report.verdict.rank == 1 and demo.verdict() == f"straggler: {report.verdict.evidence}"
    assert report.verdict.share >= SHARE_THRESHOLD
    assert f"<strong>straggler:</strong> {html.escape(report.verdict.evidence)}" in page
    # The metric the demo reads and the span-derived compute agree.
    for result, timing in zip(_results(demo), report.run.compute_ms_mean()):
        metric_ms = 1e3 * result["compute_seconds_sum"] / result["compute_seconds_count"]
        assert abs(timing - metric_ms) < max(3.0, 0.15 * metric_ms), (timing, metric_ms)
    # It waits least in every allreduce: its heatmap row is the darkest.
    cells = _artist(report.figures["latency"], "latency-by-step").get_array()
    assert cells[1].mean() < cells[0].mean()
    # allreduce_hook sends what it is handed; nothing to say about compression; no Join.
    handed = _artist(report.figures["bytes"], "bytes-handed").get_width()
    wire = _artist(report.figures["bytes"], "bytes-wire").get_width()
    assert handed == wire > 0
    assert report.figures["compression"] is None and report.figures["join"] is None
    assert "no sampled compression error" in page and "No Join in this run" in page


def test_uneven_straggler_shadowed_steps_are_marked(three_ranks_uneven_straggler: Demo) -> None:
    demo = three_ranks_uneven_straggler
    report = build_report(demo.run_dir)
    batches = [result["batches"] for result in _results(demo)]
    figure = report.figures["compute"]
    for rank, trained in enumerate(batches):
        assert _shadowed_steps(figure, rank) == list(range(trained, max(batches))), rank
        drawn = _artist(figure, f"compute-rank{rank}").get_ydata()
        assert np.isnan(drawn[trained:]).all()  # shadowed: no compute drawn
    means = _compute_means(figure, [0, 1, 2])
    assert means[2] == max(means.values()), means
    assert report.verdict.rank == 2 and demo.verdict() == f"straggler: {report.verdict.evidence}"
    shadow_bars = [bar.get_width() for bar in _artists(report.figures["join"], "shadow-iterations")]
    assert shadow_bars == [float(row["shadowed"]) for row in demo.table()]


def test_uneven_inputs_marked_and_no_straggler(three_ranks_uneven: Demo) -> None:
    demo = three_ranks_uneven
    page = _demo_page(demo).read_text()
    report = build_report(demo.run_dir)
    batches = [result["batches"] for result in _results(demo)]
    for rank, trained in enumerate(batches):
        assert _shadowed_steps(report.figures["compute"], rank) == list(range(trained, max(batches)))
    assert report.verdict.rank is None and demo.verdict() == f"straggler: {report.verdict.evidence}"
    assert demo.verdict().startswith("straggler: none")
    assert 'class="verdict none"' in page and "(straggler)" not in page
    for rank in range(3):  # each rank's time line ends when all had joined
        training = _artist(report.figures["join"], f"training-rank{rank}")
        joined = _artist(report.figures["join"], f"join-rank{rank}")
        assert 0 < joined.get_x() < training.get_width()  # ran out of inputs after its own steps
        assert joined.get_x() + joined.get_width() == pytest.approx(training.get_width())  # then waited, to the end
    ends = [_artist(report.figures["join"], f"join-rank{rank}") for rank in range(3)]
    assert max(e.get_x() + e.get_width() for e in ends) - min(e.get_x() + e.get_width() for e in ends) < 0.5


def test_fp16_error_at_sampled_steps_and_half_the_bytes(two_ranks: Demo) -> None:
    demo = two_ranks
    _demo_page(demo)
    report = build_report(demo.run_dir)
    error = _artist(report.figures["compression"], "relative-error")
    assert list(error.get_xdata()) == list(range(0, 12, DEFAULT_ERROR_EVERY))
    # fp16 rounds twice (cast, then divide): at most 2 x 2^-11 relative error, and never exact.
    assert all(0 < value <= 2**-10 for value in error.get_ydata())
    counts, edges, _ = _artist(report.figures["compression"], "nonfinite").get_data()
    assert len(counts) == 12 and not counts.any()
    handed = _artist(report.figures["bytes"], "bytes-handed").get_width()
    wire = _artist(report.figures["bytes"], "bytes-wire").get_width()
    assert wire == handed / 2


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
    for source in two_ranks_straggler.run_dir.glob("spans-rank*.jsonl"):
        shutil.copy(source, tmp_path)
    rank0, rank1 = tmp_path / "spans-rank0.jsonl", tmp_path / "spans-rank1.jsonl"
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
    assert f"spans-rank1.jsonl: line {len(content.splitlines())}: the last line is truncated" in err
    assert "spans-rank0.jsonl: 2 lines: spans of an unknown version, the first line 6" in err
    assert f"without an integer in {Attr.STEP}" in err
    assert out.strip() == f"report: {tmp_path / 'page.html'}"
    page = (tmp_path / "page.html").read_text()
    assert "Input that could not be read" in page and "the last line is truncated" in page
    assert page.count("<img ") == 3  # compute, latency, bytes: all the run has, still drawn
    assert "straggler:</strong> rank 1 " in page


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
    assert len(seen.images) == 5
    for image in seen.images:
        assert image["complete"] and image["width"] > 0 and image["height"] > 0 and image["shown"] > 0, image
    (tmp_path / "report.png").write_bytes(seen.screenshot)
    screenshot = Image.open(io.BytesIO(seen.screenshot)).convert("RGB")
    pixels = np.asarray(screenshot).astype(int)
    assert screenshot.width == 1200 and screenshot.height > 1500  # the whole page, every figure
    drawn = (pixels < 245).any(axis=2).mean()
    colourful = (pixels.max(axis=2) - pixels.min(axis=2) > 80).mean()
    assert drawn > 0.05 and colourful > 0.02, (drawn, colourful)
