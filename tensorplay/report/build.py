"""Build the report of one run: read its spans, take each model's figures from the analysis, draw, write the page.

Every number shown (the verdict, the per-rank table, what the figures draw) comes from
:func:`tensorplay.analysis.summary.summarize`, the derivation the demo's table renders too.
A traced hook shared by several models gets one set of sections per model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tensorplay.analysis.communication import NO_PAYOFF_SHARE
from tensorplay.analysis.communication_text import (
    CANDIDATE_COLUMNS, NOT_ADVISED, NOT_MEASURED, advice_notes, candidate_rows, job_sentence,
)
from tensorplay.analysis.replicas import ReplicaSync, replica_sync
from tensorplay.analysis.run import Run
from tensorplay.analysis.span_reader import Spans, read_spans
from tensorplay.analysis.straggler import CRITICAL_SHARE, MIN_LATENESS_S, WINDOWS, Verdict
from tensorplay.analysis.summary import ModelSummary, summarize
from tensorplay.analysis.table import COLUMNS, rank_rows
from tensorplay.analysis.world import World
from tensorplay.telemetry import DEFAULT_ERROR_EVERY

from .page import Findings, ModelPart, Picture, Section, html_page

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Report", "ModelReport", "ReportUnavailable", "INSTALL_HINT", "build_report", "report_from_spans", "render_html",
           "write_report", "default_output"]

INSTALL_HINT = "pip install 'tensorplay[report]'"
REPORT_FILE = "report.html"


class ReportUnavailable(Exception):
    """The plotting library (matplotlib, the ``report`` extra) is not installed."""


@dataclass
class ModelReport:
    """One model's figures from the analysis, and each section's drawing."""

    summary: ModelSummary
    figures: dict[str, Figure | None]

    @property
    def run(self) -> Run:
        return self.summary.run

    @property
    def verdict(self) -> Verdict:
        return self.summary.verdict


@dataclass
class Report:
    """A built report: what was read, and each model's figures, verdict and drawings."""

    source: Path
    spans: Spans
    models: list[ModelReport]
    sync: ReplicaSync
    """Gradient reductions per optimizer step, unreduced steps, replica fingerprints: for the whole run."""

    @property
    def world(self) -> World | None:
        """The world size the spans say and the ranks they lack (the same for every model)."""
        return self.models[0].summary.world if self.models else None

    @property
    def problems(self) -> list[str]:
        """What could not be read or trusted, or is missing; the rest is drawn."""
        problems = list(self.spans.problems)
        if self.world is not None:
            problems += self.world.problems()
        duplicates = sum(part.run.duplicates for part in self.models)
        if duplicates:
            problems.append(f"{duplicates} hook spans repeat a (rank, model, step, bucket) already read: do the "
                            "files hold more than one run? The figures mix them")
        return problems

    def verdict_lines(self) -> list[str]:
        """The straggler verdict of each model, as ``tensorplay report`` prints it."""
        return [f"straggler{_model_label(self, part)}: {part.verdict.evidence}" for part in self.models]

    def communication_lines(self) -> list[str]:
        """What communication costs each model's step, the demo's sentence, as ``tensorplay report`` prints it."""
        return [job_sentence(part.summary.communication, _model_label(self, part)) for part in self.models]


def _model_label(report: Report, part: ModelReport) -> str:
    return f" (model {part.summary.model})" if len(report.models) > 1 else ""


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

    Raises :class:`~tensorplay.analysis.span_reader.NoSpans` if there is nothing to draw and
    :class:`ReportUnavailable` without matplotlib (before reading anything).
    """
    _plots()
    return report_from_spans(source, read_spans(source))


def report_from_spans(source: Path, spans: Spans) -> Report:
    """Take each model's figures of ``spans`` (read from ``source``) from the analysis and draw them."""
    plots = _plots()
    parts = []
    for summary in summarize(spans):
        run, verdict = summary.run, summary.verdict
        parts.append(ModelReport(summary, {
            "cost": plots.cost_figure(summary),
            "compute": plots.compute_figure(run, verdict),
            "communication": plots.communication_figure(run, summary.communication),
            "advice": plots.advice_figure(summary.communication),
            "latency": plots.latency_figure(run, verdict),
            "bytes": plots.bytes_figure(run),
            "compression": plots.compression_figure(run),
            "join": plots.join_figure(run),
        }))
    return Report(source, spans, parts, replica_sync(spans.optimizer_steps))


def _subset(ranks: int, shown: int, which: str) -> str:
    """A caption's note that only some ranks are drawn, or nothing when all are."""
    return f" ({shown} of {ranks} ranks: {which})" if ranks > shown else ""


def _captions(run: Run, plots) -> list[tuple[str, str, str, str]]:
    """(key, title, how to read it, note when not drawn) of each section, in page order."""
    ranks = len(run.ranks)
    shown_ranks = _subset(ranks, plots.TIMELINE_RANKS, "the least exposed communication, the job's first")
    hooks = ", ".join(hook.hook for hook in run.hook_bytes) or "none"
    return [
        ("cost", "What each rank costs the job",
         "Per rank, the share of every step its peers wait for it at the step's last collective (the bar: over the "
         "steps every rank trained; the dot: its median step). The dashed line is what the job's own noise "
         f"explains (k x the spread of the other ranks' shares); a straggler passed it, and cost at least "
         f"{1e3 * MIN_LATENESS_S:g} ms per step, in each of {WINDOWS} blocks of the steps, as the verdict and "
         f"TensorplayStragglerRank weigh it; the dotted line is the critical share ({100 * CRITICAL_SHARE:.0f} %)"
         + _subset(ranks, plots.COST_RANKS, "the highest shares") + ".",
         "No share: it needs two or more ranks with steps every rank trained after the first."),
        ("compute", "Compute time per step, per rank",
         "Each line is a rank's own work before a step (end of its previous step's last collective to its next "
         "hook call, as tensorplay_step_compute_seconds): a rank slow before its first bucket (data, forward) runs "
         "above the others; one slow between its buckets (backward) need not -- the verdict weighs who the job "
         "waits for at each step's end"
         + (f"; the {plots.TOP_K} ranks with the highest mean are drawn over all ranks' median and 10-90% band, "
            f"and the strip shows the {plots.TOP_K} that shadowed most" if ranks > plots.TOP_K else "")
         + ". Squares below mark steps a rank shadowed inside Join, which are not its compute.",
         "No compute time: a rank needs spans of two consecutive steps it trained itself."),
        ("communication", "Busy time and exposed communication per step, per rank",
         "Per rank, its mean step: grey its busy time (its own work: data, forward and the backward up to its last "
         "bucket), orange its exposed communication (from its last hook call until its last hook future was done: "
         "what the backward could not hide), with the share of its communication the backward hid. The rank with "
         "the least exposed communication is the one the others wait for: theirs also holds their wait for it, its "
         "own is the job's, and the most a compression hook or another bucket size can win back. On the right, "
         "that rank step by step. Below "
         f"{100 * NO_PAYOFF_SHARE:.0f} % of the step, no compression will pay" + shown_ranks + ".",
         f"Communication {NOT_MEASURED}."),
        ("latency", "Allreduce latency, ranks x steps and ranks x buckets",
         "Dark is short, bright is long. The rank everyone waits for arrives last and waits least, so a dark row is "
         "a straggler; a bright column is a step slow for all; on the right, a bucket that is bright on every row "
         "is always the slow one. Grey: no span; a cross: a step the rank shadowed inside Join (out of inputs, "
         "not slow)"
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
        ("advice", "What another hook would give: the compression advice",
         "Each candidate compression at the bytes it would send per byte DDP handed over (left: fewer bytes) and the "
         "error it would have made of the advised iterations' gradients (down: more exact), both on log scales: the "
         "dot is the median over the advised iterations of every rank, the bar reaches the worst; a red ring marks "
         "a candidate that would have made elements non-finite (fp16 overflow); the dotted line is what the running "
         "hook sends. The table says what each would win back per step: an estimate, by the model written beneath it.",
         f"{NOT_ADVISED}."),
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


def _words(part: ModelReport) -> dict[str, dict]:
    """What the communication sections say above their pictures: the job's sentence; the candidates' table and notes."""
    figures = part.summary.communication
    advice = {"paragraphs": tuple(advice_notes(figures)), "table": (CANDIDATE_COLUMNS, candidate_rows(figures))}
    return {"communication": {"paragraphs": (job_sentence(figures),)} if figures.job is not None else {},
            "advice": advice if figures.candidates else {}}


def _model_part(report: Report, part: ModelReport, plots) -> ModelPart:
    words = _words(part)
    sections = [Section(key, title, caption, None if part.figures[key] is None
                        else _picture(part.figures[key], plots), note, **words.get(key, {}))
                for key, title, caption, note in _captions(part.run, plots)]
    run = part.run
    heading = (f"model {part.summary.model}: {len(run.ranks)} ranks, {run.steps} steps"
               if len(report.models) > 1 else "")
    return ModelPart(heading, part.verdict.evidence, part.verdict.rank is not None, COLUMNS,
                     rank_rows(part.summary), sections, unjudged=bool(report.world and report.world.missing))


def render_html(report: Report) -> str:
    """The report as a self-contained HTML page."""
    plots = _plots()
    files = report.spans.files
    ranks = sorted({int(rank) for part in report.models for rank in part.run.ranks})
    steps = ", ".join(str(part.run.steps) for part in report.models)
    hooks = sorted({hook.hook for part in report.models for hook in part.run.hook_bytes})
    models = f" · {len(report.models)} models" if len(report.models) > 1 else ""
    world = report.world
    of_size = f" of {world.size}" if world is not None and world.missing else ""
    spans = report.spans
    span_count = len(spans.hooks) + len(spans.joins) + len(spans.optimizer_steps) + len(spans.advice)
    run_line = (f"{report.source} · {len(ranks)}{of_size} ranks{models} · {steps} steps · "
                f"hook {', '.join(hooks) or 'none'} · "
                f"{span_count} spans from {len(files)} "
                f"file{'s' if len(files) != 1 else ''}")
    return html_page("tensorplay report", run_line, report.problems,
                     [_model_part(report, part, plots) for part in report.models],
                     Findings(report.sync.lines(), report.sync.problem))


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
