"""Build the report of one run: read its spans, aggregate, judge, draw, and write the HTML page."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tensorplay.analysis.straggler import Verdict
from tensorplay.telemetry import DEFAULT_ERROR_EVERY

from .aggregate import Run, aggregate
from .page import Picture, Section, html_page
from .spans import Spans, read_spans
from .verdict import run_verdict

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Report", "ReportUnavailable", "INSTALL_HINT", "build_report", "report_from_spans", "render_html",
           "write_report", "default_output"]

INSTALL_HINT = "pip install 'tensorplay[report]'"
REPORT_FILE = "report.html"


class ReportUnavailable(Exception):
    """The plotting library (matplotlib, the ``report`` extra) is not installed."""


@dataclass
class Report:
    """A built report: what was read, the aggregated run, the verdict and each section's figure."""

    source: Path
    spans: Spans
    run: Run
    verdict: Verdict
    figures: dict[str, Figure | None]

    @property
    def problems(self) -> list[str]:
        """What could not be read or trusted; the rest is drawn."""
        problems = list(self.spans.problems)
        if self.run.duplicates:
            problems.append(f"{self.run.duplicates} hook spans repeat a (rank, step, bucket) already read: do the "
                            "files hold more than one run? The figures mix them")
        return problems


def _plots():
    """The plotting module, or :class:`ReportUnavailable` if matplotlib is missing."""
    try:
        from . import plots
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "matplotlib":
            raise
        raise ReportUnavailable(f"the HTML report draws with matplotlib, which is not installed: {INSTALL_HINT}") \
            from error
    return plots


def build_report(source: Path) -> Report:
    """Read the spans under ``source`` (a run directory or a span file) and draw every figure.

    Raises :class:`~tensorplay.report.spans.NoSpans` if there is nothing to draw and
    :class:`ReportUnavailable` without matplotlib (before reading anything).
    """
    _plots()
    return report_from_spans(source, read_spans(source))


def report_from_spans(source: Path, spans: Spans) -> Report:
    """Aggregate ``spans`` (read from ``source``), judge the run and draw every figure."""
    plots = _plots()
    run = aggregate(spans)
    verdict = run_verdict(run)
    figures = {
        "compute": plots.compute_figure(run, verdict),
        "latency": plots.latency_figure(run, verdict),
        "bytes": plots.bytes_figure(run),
        "compression": plots.compression_figure(run),
        "join": plots.join_figure(run),
    }
    return Report(source, spans, run, verdict, figures)


def _subset(ranks: int, shown: int, which: str) -> str:
    """A caption's note that only some ranks are drawn, or nothing when all are."""
    return f" ({shown} of {ranks} ranks: {which})" if ranks > shown else ""


def _captions(report: Report, plots) -> list[tuple[str, str, str, str]]:
    """(key, title, how to read it, note when not drawn) of each section, in page order."""
    run = report.run
    ranks = len(run.ranks)
    hooks = ", ".join(hook.hook for hook in run.hook_bytes) or "none"
    return [
        ("compute", "Compute time per step, per rank",
         "Each line is a rank's own work before a step (end of its previous step's last collective to its next "
         "hook call, as tensorplay_step_compute_seconds): a rank slow before its first bucket (data, forward) runs "
         "above the others; one slow between its buckets (backward) need not -- the verdict weighs who the job "
         "waits for at each step's end"
         + (f"; the {plots.TOP_K} ranks with the highest mean are drawn over all ranks' median and 10-90% band, "
            f"and the strip shows the {plots.TOP_K} that shadowed most" if ranks > plots.TOP_K else "")
         + ". Squares below mark steps a rank shadowed inside Join, which are not its compute.",
         "No compute time: a rank needs spans of two consecutive steps it trained itself."),
        ("latency", "Allreduce latency, ranks x steps and ranks x buckets",
         "Dark is short, bright is long. The rank everyone waits for arrives last and waits least, so a dark row is "
         "a straggler; a bright column is a step slow for all; on the right, a bucket that is bright on every row "
         "is always the slow one. Grey: no span"
         + _subset(ranks, plots.HEATMAP_RANKS, "the highest mean compute") + ".",
         "No hook spans, so no latency."),
        ("bytes", "Wire bytes vs bytes handed over, per hook",
         "Grey is what DDP handed the hook, blue what it sent into collectives (every call, shadowed ones "
         "included): compression shows as a shorter blue bar, x0.50 for fp16/bf16.",
         "No hook spans, so no bytes."),
        ("compression", "Compression error over steps, and non-finite elements",
         f"Relative error ||x - x^|| / ||x|| of the sampled steps (every {DEFAULT_ERROR_EVERY}th by default, "
         "TENSORPLAY_ERROR_EVERY; shadowed iterations, which compress zeros, left out): a rising median is drift. "
         "Below, per step, elements compression made non-finite (fp16 overflow) and elements that arrived "
         "non-finite.",
         f"Nothing to show: no sampled compression error and no non-finite element (hooks: {hooks})."),
        ("join", "Join: uneven inputs",
         "Per rank, blue until it ran out of inputs, orange while it shadowed its peers' collectives until all had "
         "joined (its wait); on the right, the iterations it shadowed. Uneven inputs, not stragglers"
         + _subset(ranks, plots.JOIN_RANKS, "those that shadowed most") + ".",
         "No Join in this run (a rank that trains inside Join([ddp_model]) and runs out of inputs writes a "
         "tensorplay.join span)."),
    ]


def _picture(figure: Figure, plots) -> Picture:
    width, height = figure.get_size_inches() * figure.dpi
    return Picture(plots.png(figure), int(round(width)), int(round(height)))


def render_html(report: Report) -> str:
    """The report as a self-contained HTML page."""
    plots = _plots()
    sections = [Section(key, title, caption, None if report.figures[key] is None
                        else _picture(report.figures[key], plots), note)
                for key, title, caption, note in _captions(report, plots)]
    run = report.run
    files = report.spans.files
    run_line = (f"{report.source} · {len(run.ranks)} ranks · {run.steps} steps · "
                f"hook {', '.join(hook.hook for hook in run.hook_bytes) or 'none'} · "
                f"{len(report.spans.hooks) + len(report.spans.joins)} spans from {len(files)} "
                f"file{'s' if len(files) != 1 else ''}")
    return html_page("tensorplay report", run_line, report.verdict.evidence, report.verdict.rank is not None,
                     report.problems, sections)


def default_output(source: Path) -> Path:
    """Where the report goes by default: ``report.html`` in the run directory (beside a span file)."""
    return (source if source.is_dir() else source.parent) / REPORT_FILE


def write_report(source: Path, out: Path | None = None) -> tuple[Report, Path]:
    """Build the report of ``source`` and write it to ``out`` (default :func:`default_output`)."""
    report = build_report(source)
    out = out if out is not None else default_output(source)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(render_html(report), encoding="utf-8")
    os.replace(partial, out)
    return report, out
