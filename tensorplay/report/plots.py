"""The report's figures, drawn with matplotlib from a :class:`~tensorplay.analysis.run.Run` (one model's).

Each function returns a :class:`matplotlib.figure.Figure` (or None when the run has nothing to
show there); artists that carry a rank's data have a ``gid`` naming it, so tests can read what
was drawn. Figures stay readable and small at any scale: lines for at most ``TOP_K`` ranks (the
highest mean compute) beside the median and 10-90% band of all ranks, heatmaps of at most
``HEATMAP_RANKS`` rows and ``HEATMAP_STEPS`` columns (steps averaged in bins beyond that), the
``JOIN_RANKS`` ranks that shadowed most in the Join panel, the ``COST_RANKS`` highest shares in
the cost panel, the ``TIMELINE_RANKS`` with the least exposed communication (the job's own first)
in the communication panel.
matplotlib's object API is used without pyplot: no global state, no display needed.
"""

from __future__ import annotations

import io

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import Normalize
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter
from matplotlib.figure import Figure

from tensorplay.analysis.communication import Communication
from tensorplay.analysis.communication_text import wire_ratio
from tensorplay.analysis.run import Run
from tensorplay.analysis.straggler import CRITICAL_SHARE, MIN_LATENESS_S, WINDOWS, Verdict
from tensorplay.analysis.summary import ModelSummary

__all__ = ["TOP_K", "HEATMAP_RANKS", "HEATMAP_STEPS", "JOIN_RANKS", "COST_RANKS", "TIMELINE_RANKS", "cost_figure",
           "compute_figure", "communication_figure", "advice_figure", "latency_figure", "bytes_figure",
           "compression_figure", "join_figure", "png"]

TOP_K = 8
HEATMAP_RANKS = 64
HEATMAP_STEPS = 1000
JOIN_RANKS = 16
COST_RANKS = 32
TIMELINE_RANKS = 16
_WIDTH_IN = 11.0
_DPI = 100
_STRAGGLER_COLOR = "#d62728"
_LATENCY_COLORS = colormaps["viridis"].with_extremes(bad="0.9")  # grey: no span there


def png(figure: Figure) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI)
    return buffer.getvalue()


def _top_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """Rows of the ``k`` highest scores (NaN lowest), in rank order; every row if there are few."""
    if len(scores) <= k:
        return np.arange(len(scores))
    return np.sort(np.argsort(np.nan_to_num(scores, nan=-np.inf), kind="stable")[-k:])


def _rank_colors(run: Run, rows: np.ndarray, verdict: Verdict) -> dict[int, str]:
    palette = [color for color in (f"C{i}" for i in range(10)) if color != "C3"]  # C3 is the straggler's red
    colors = {}
    for i, row in enumerate(rows):
        colors[int(row)] = _STRAGGLER_COLOR if run.ranks[row] == verdict.rank else palette[i % len(palette)]
    return colors


def _rank_label(run: Run, row: int, verdict: Verdict) -> str:
    rank = int(run.ranks[row])
    return f"rank {rank} (straggler)" if rank == verdict.rank else f"rank {rank}"


def _shadow_rows(run: Run) -> np.ndarray:
    """Rows of the shadowed-steps strip: every rank if few, else the top k that shadowed most."""
    counts = run.shadowed.sum(axis=1)
    if not counts.any():
        return np.arange(0)
    rows = _top_rows(counts.astype(float), TOP_K)
    return rows if len(run.ranks) <= TOP_K else rows[counts[rows] > 0]


def compute_figure(run: Run, verdict: Verdict) -> Figure | None:
    """Compute time before each step, one line per rank; shadowed steps in a strip below."""
    if not np.isfinite(run.compute_ms).any():
        return None
    rows = _top_rows(run.compute_ms_mean(), TOP_K)
    colors = _rank_colors(run, rows, verdict)
    strip_rows = _shadow_rows(run)
    figure = Figure(figsize=(_WIDTH_IN, 4.4 if len(strip_rows) else 3.6), layout="constrained")
    if len(strip_rows):
        axes, strip = figure.subplots(2, 1, sharex=True, height_ratios=[4, 1])
    else:
        axes, strip = figure.subplots(), None
    steps = np.arange(run.steps)
    if len(rows) < len(run.ranks):
        low, median, high = run.compute_ms_band()
        axes.fill_between(steps, low, high, color="0.85", label=f"all {len(run.ranks)} ranks, 10-90%")
        axes.plot(steps, median, color="0.4", linestyle="--", linewidth=1, label="median of all ranks")
    for row in rows:
        straggler = run.ranks[row] == verdict.rank
        axes.plot(steps, run.compute_ms[row], color=colors[int(row)], linewidth=2.4 if straggler else 1.2,
                  label=_rank_label(run, row, verdict), gid=f"compute-rank{run.ranks[row]}")
    axes.set_ylabel("compute before step (ms)")
    top = float(np.nanmax(run.compute_ms))  # the band's 90th percentile is below it too
    axes.set_ylim(0, top * 1.08)  # every point inside, its marker and line width too
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    if strip is None:
        axes.set_xlabel("step")
        return figure
    for position, row in enumerate(strip_rows):
        marked = steps[run.shadowed[row]]
        strip.scatter(marked, np.full(len(marked), position), marker="s", s=14, color=colors.get(int(row), "0.45"),
                      gid=f"shadowed-rank{run.ranks[row]}")
    strip.set_yticks(range(len(strip_rows)), [f"rank {run.ranks[row]}" for row in strip_rows], fontsize="x-small")
    strip.set_ylim(-0.7, len(strip_rows) - 0.3)
    strip.invert_yaxis()
    strip.set_title("shadowed inside Join (out of inputs: no compute)", fontsize="small", loc="left")
    strip.grid(axis="x", alpha=0.3)
    strip.set_xlabel("step")
    return figure


def cost_figure(summary: ModelSummary) -> Figure | None:
    """Per rank, the share of every step the job waits for it: over the run (bar) and at its median step
    (dot), against the job's threshold (what its own noise explains) and the critical share."""
    figures = [r for r in summary.ranks if r.lateness is not None]
    if not figures:
        return None
    shown = sorted(sorted(figures, key=lambda r: r.lateness.share, reverse=True)[:COST_RANKS], key=lambda r: r.rank)
    named = set(summary.verdict.ranks)
    figure = Figure(figsize=(_WIDTH_IN, min(1.4 + 0.3 * len(shown), 7.5)), layout="constrained")
    axes = figure.subplots()
    positions = np.arange(len(shown))
    shares = [100 * max(r.lateness.share, 0.0) for r in shown]
    medians = [100 * max(r.lateness.median_share, 0.0) for r in shown]
    bars = axes.barh(positions, shares, height=0.6, color=[_STRAGGLER_COLOR if r.rank in named else "C0" for r in shown])
    for patch, r in zip(bars.patches, shown):
        patch.set_gid(f"cost-rank{r.rank}")
    axes.scatter(medians, positions, color="k", s=16, zorder=3, label="median step", gid="cost-median")
    for position, r, share, median in zip(positions, shown, shares, medians):
        late = r.lateness
        axes.text(max(share, median), position, f" {share:.0f} %, {1e3 * max(late.per_step_s, 0.0):.1f} ms; above "
                  f"the job's noise in {late.outlier_blocks}/{WINDOWS} blocks", va="center", fontsize="small")
    threshold = 100 * summary.verdict.noise.threshold
    axes.axvline(threshold, color="0.3", linestyle="--", linewidth=1, gid="cost-threshold",
                 label=f"the job's noise: {threshold:.0f} % (a straggler passes it in each block, and {1e3 * MIN_LATENESS_S:g} ms)")
    axes.axvline(100 * CRITICAL_SHARE, color=_STRAGGLER_COLOR, linestyle=":", linewidth=1,
                 label=f"critical: {100 * CRITICAL_SHARE:.0f} %")
    axes.set_yticks(positions, [f"rank {r.rank}" + (" (straggler)" if r.rank in named else "") for r in shown],
                    fontsize="small")
    axes.invert_yaxis()
    axes.set_xlim(0, max(max(shares + medians), threshold, 100 * CRITICAL_SHARE) * 1.6)
    axes.set_xlabel("share of every step the job waits for the rank (%)")
    axes.legend(loc="lower right", fontsize="small", frameon=False)
    return figure


def _binned_steps(matrix: np.ndarray, columns: int) -> np.ndarray:
    """Average runs of consecutive steps so that at most ``columns`` remain (NaN-aware)."""
    steps = matrix.shape[1]
    if steps <= columns:
        return matrix
    edges = np.linspace(0, steps, columns + 1).astype(int)
    valid = ~np.isnan(matrix)
    sums = np.add.reduceat(np.where(valid, matrix, 0.0), edges[:-1], axis=1)
    counts = np.add.reduceat(valid, edges[:-1], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _heatmap(axes, values: np.ndarray, extent_x: float, norm: Normalize, gid: str):
    image = axes.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest",
                        cmap=_LATENCY_COLORS, norm=norm, extent=(0, extent_x, values.shape[0], 0))
    image.set_gid(gid)
    return image


def latency_figure(run: Run, verdict: Verdict) -> Figure | None:
    """Allreduce latency as heatmaps: ranks x steps, and ranks x buckets over the steps all trained."""
    by_step = run.latency_by_step()
    if not np.isfinite(by_step).any():
        return None
    rows = _top_rows(run.compute_ms_mean(), HEATMAP_RANKS)
    by_step, by_bucket = by_step[rows], run.latency_by_bucket()[rows]
    finite = by_step[np.isfinite(by_step)]
    low, high = np.percentile(finite, [1, 99])
    norm = Normalize(vmin=low, vmax=max(high, low + 1e-3))
    figure = Figure(figsize=(_WIDTH_IN, min(2.2 + 0.22 * len(rows), 7.5)), layout="constrained")
    steps_axes, bucket_axes = figure.subplots(1, 2, sharey=True, width_ratios=[5, 1])
    image = _heatmap(steps_axes, _binned_steps(by_step, HEATMAP_STEPS), run.steps, norm, "latency-by-step")
    _heatmap(bucket_axes, by_bucket, by_bucket.shape[1], norm, "latency-by-bucket")
    shadow_rows, shadow_steps = np.nonzero(run.shadowed[rows])
    if len(shadow_rows):  # a shadowing rank waits for its peers' work: bright, but not slow
        steps_axes.scatter(shadow_steps + 0.5, shadow_rows + 0.5, marker="x", s=18, linewidths=0.9, color="white",
                           gid="latency-shadowed")
    every = max(1, len(rows) // 32)
    ticked = [i for i, row in enumerate(rows) if i % every == 0 or run.ranks[row] == verdict.rank]
    labels = [f"{run.ranks[rows[i]]}{' (straggler)' if run.ranks[rows[i]] == verdict.rank else ''}" for i in ticked]
    steps_axes.set_yticks(np.array(ticked) + 0.5, labels, fontsize="x-small")
    steps_axes.set_ylabel("rank")
    steps_axes.set_xlabel("step")
    steps_axes.set_title("mean per bucket, each step", fontsize="small", loc="left")
    bucket_axes.set_xticks(np.arange(by_bucket.shape[1]) + 0.5, range(by_bucket.shape[1]), fontsize="x-small")
    bucket_axes.set_xlabel("bucket")
    bucket_axes.set_title("median, steps all trained", fontsize="small", loc="left")
    figure.colorbar(image, ax=[steps_axes, bucket_axes], label="allreduce latency (ms)", pad=0.01)
    return figure


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def bytes_figure(run: Run) -> Figure | None:
    """Bytes DDP handed each hook vs bytes the hook sent into collectives, over the run."""
    if not run.hook_bytes:
        return None
    figure = Figure(figsize=(_WIDTH_IN, 1.3 + 0.7 * len(run.hook_bytes)), layout="constrained")
    axes = figure.subplots()
    positions = np.arange(len(run.hook_bytes))
    handed = np.array([hook.handed_over for hook in run.hook_bytes], dtype=float)
    wire = np.array([hook.wire for hook in run.hook_bytes], dtype=float)
    axes.barh(positions - 0.2, handed, height=0.38, color="0.6", label="handed over by DDP", gid="bytes-handed")
    axes.barh(positions + 0.2, wire, height=0.38, color="C0", label="sent on the wire", gid="bytes-wire")
    for position, hook in zip(positions, run.hook_bytes):
        ratio = f"  (x{hook.wire / hook.handed_over:.2f})" if hook.handed_over else ""
        axes.text(hook.handed_over, position - 0.2, f" {_size(hook.handed_over)}", va="center", fontsize="small")
        axes.text(hook.wire, position + 0.2, f" {_size(hook.wire)}{ratio}", va="center", fontsize="small")
    axes.set_yticks(positions, [hook.hook for hook in run.hook_bytes])
    axes.invert_yaxis()
    axes.set_xlim(right=max(handed.max(), wire.max(), 1) * 1.25)
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _size(value)))
    axes.set_xlabel("bytes, all ranks, whole run")
    axes.legend(loc="lower right", fontsize="small", frameon=False)
    return figure


def compression_figure(run: Run) -> Figure | None:
    """Relative error of the sampled steps (median and range) over steps; non-finite counts below."""
    errors = run.errors
    nonfinite = run.nonfinite + run.bucket_nonfinite
    if not len(errors.steps) and not nonfinite.any():
        return None
    figure = Figure(figsize=(_WIDTH_IN, 4.2), layout="constrained")
    error_axes, count_axes = figure.subplots(2, 1, sharex=True, height_ratios=[3, 1.3])
    if len(errors.steps):
        error_axes.vlines(errors.steps, errors.low, errors.high, color="C0", alpha=0.35, linewidth=4,
                          label="min-max over ranks and buckets")
        error_axes.plot(errors.steps, errors.median, marker="o", markersize=5 if len(errors.steps) < 10 else 3,
                        color="C0", label="median", gid="relative-error")
        low, high = float(errors.low.min()), float(errors.high.max())
        if low > 0 and high / low > 10:  # over a decade: log (an exact bucket, error 0, would fall off it)
            error_axes.set_yscale("log")
            error_axes.yaxis.set_major_locator(LogLocator(numticks=6))
            error_axes.yaxis.set_minor_formatter(NullFormatter())
        else:
            error_axes.yaxis.set_major_locator(MaxNLocator(5))
            error_axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        error_axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    else:
        error_axes.text(0.5, 0.5, "no sampled step", transform=error_axes.transAxes, ha="center", va="center")
    error_axes.set_ylabel("||x - x^|| / ||x||")
    error_axes.grid(alpha=0.3)
    edges = np.arange(run.steps + 1) - 0.5
    count_axes.stairs(run.nonfinite, edges, fill=True, color="C3", label="made non-finite by compression",
                      gid="nonfinite")
    count_axes.stairs(run.nonfinite + run.bucket_nonfinite, edges, baseline=run.nonfinite, fill=True, color="C1",
                      label="non-finite on arrival", gid="bucket-nonfinite")
    if not nonfinite.any():
        count_axes.text(0.5, 0.5, "no non-finite element in any bucket", transform=count_axes.transAxes,
                        ha="center", va="center", fontsize="small")
    count_axes.set_ylabel("non-finite")
    count_axes.set_ylim(0, max(1, int(nonfinite.max())) * 1.15)
    count_axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    count_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    count_axes.set_xlabel("step")
    count_axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    return figure


def join_figure(run: Run) -> Figure | None:
    """Per rank: when it ran out of inputs and how long it waited; iterations it shadowed."""
    if not run.joins:
        return None
    shadow_by_rank = {rank: 0 for rank in run.ranks.tolist()}
    for join in run.joins:
        shadow_by_rank[join.rank] += join.shadow_iterations
    ranks = np.array(list(shadow_by_rank))
    rows = _top_rows(np.array(list(shadow_by_rank.values()), dtype=float), JOIN_RANKS)
    shown = set(ranks[rows].tolist())
    position = {rank: i for i, rank in enumerate(ranks[rows].tolist())}
    figure = Figure(figsize=(_WIDTH_IN, min(1.6 + 0.3 * len(rows), 7.5)), layout="constrained")
    time_axes, shadow_axes = figure.subplots(1, 2, sharey=True, width_ratios=[3, 1])
    joins = [join for join in run.joins if join.rank in shown]
    timeline_end_s: dict[int, float] = {}
    waits_ms: dict[int, float] = {}
    for join in joins:
        timeline_end_s[join.rank] = max(timeline_end_s.get(join.rank, 0.0), join.end_s - run.start_s)
        waits_ms[join.rank] = waits_ms.get(join.rank, 0.0) + join.wait_ms
    timelines = time_axes.barh([position[rank] for rank in timeline_end_s], list(timeline_end_s.values()),
                               color="C0", height=0.6)
    for patch, rank in zip(timelines.patches, timeline_end_s):
        patch.set_gid(f"training-rank{rank}")
    joined = time_axes.barh([position[join.rank] for join in joins], [join.end_s - join.start_s for join in joins],
                            left=[join.start_s - run.start_s for join in joins], color="C1", height=0.6)
    for patch, join in zip(joined.patches, joins):
        patch.set_gid(f"join-rank{join.rank}")
    time_axes.set_yticks(range(len(rows)), [f"rank {rank}" for rank in ranks[rows]], fontsize="small")
    time_axes.invert_yaxis()
    time_axes.set_xlabel("seconds since the first span (blue: own inputs, orange: joined, shadowing)")
    time_axes.margins(x=0.15)
    counts = [shadow_by_rank[rank] for rank in ranks[rows].tolist()]
    shadow_axes.barh(range(len(rows)), counts, color="C1", height=0.6, gid="shadow-iterations")
    for rank, end_s in timeline_end_s.items():
        time_axes.text(end_s, position[rank], f" wait {waits_ms[rank]:.0f} ms", va="center", fontsize="small")
    for y, count in enumerate(counts):
        shadow_axes.text(count, y, f" {count}", va="center", fontsize="small")
    shadow_axes.set_xlabel("iterations shadowed")
    shadow_axes.margins(x=0.25)
    return figure


_BUSY_COLOR, _EXPOSED_COLOR = "0.65", "C1"


def communication_figure(run: Run, figures: Communication) -> Figure | None:
    """Per rank, busy time and exposed communication per step (means); the job's rank step by step."""
    if figures.job is None:
        return None
    shown = sorted(sorted(figures.ranks, key=lambda r: (r.exposed_ms, r.rank))[:TIMELINE_RANKS], key=lambda r: r.rank)
    figure = Figure(figsize=(_WIDTH_IN, min(2.0 + 0.3 * len(shown), 7.5)), layout="constrained")
    rank_axes, step_axes = figure.subplots(1, 2, width_ratios=[3, 2])
    positions = np.arange(len(shown))
    busy = rank_axes.barh(positions, [r.busy_ms for r in shown], height=0.6, color=_BUSY_COLOR, label="busy")
    exposed = rank_axes.barh(positions, [r.exposed_ms for r in shown], left=[r.busy_ms for r in shown], height=0.6,
                             color=_EXPOSED_COLOR, label="exposed communication")
    for bar, r in zip(busy.patches, shown):
        bar.set_gid(f"busy-rank{r.rank}")
    for bar, r in zip(exposed.patches, shown):
        bar.set_gid(f"exposed-rank{r.rank}")
        hidden = "" if r.hidden_share is None else f", hides {100 * r.hidden_share:.0f} %"
        rank_axes.text(r.step_ms, bar.get_y() + bar.get_height() / 2,
                       f" {r.exposed_ms:.1f} ms ({100 * r.exposed_share:.0f} %){hidden}", va="center", fontsize="small")
    job = figures.job.rank
    rank_axes.set_yticks(positions, [f"rank {r.rank}" + (" (waited for)" if r.rank == job else "") for r in shown],
                         fontsize="small")
    rank_axes.invert_yaxis()
    rank_axes.set_xlim(0, max(r.step_ms for r in shown) * 1.6)
    rank_axes.set_xlabel("ms per step, mean over its counted steps")
    rank_axes.legend(loc="lower left", bbox_to_anchor=(0, 1), ncols=2, fontsize="small", frameon=False)
    row = run.row(job)
    busy_ms, exposed_ms = run.busy_ms[row], run.exposed_ms[row]  # NaN where not counted: a gap
    edges = np.arange(run.steps + 1) - 0.5
    step_axes.stairs(busy_ms, edges, fill=True, color=_BUSY_COLOR, gid="steps-busy")
    step_axes.stairs(busy_ms + exposed_ms, edges, baseline=busy_ms, fill=True, color=_EXPOSED_COLOR,
                     gid="steps-exposed")
    step_axes.set_ylim(0, float(np.nanmax(busy_ms + exposed_ms)) * 1.08)
    step_axes.set_title(f"rank {job}, the one the others wait for, each step", fontsize="small", loc="left")
    step_axes.set_xlabel("step")
    step_axes.set_ylabel("ms")
    step_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    step_axes.grid(axis="y", alpha=0.3)
    return figure


def advice_figure(figures: Communication) -> Figure | None:
    """Each candidate's error (log) against the bytes it would send per byte handed over (log)."""
    candidates = figures.candidates
    if not candidates:
        return None
    errors = [e for c in candidates for e in (c.error, c.worst_error) if e is not None and e > 0]
    # Off the log scale, each drawn where it says what it is: an exact candidate (error 0) below every
    # other, one without a finite error (fp16 overflow, NaN gradients) above every other.
    floor, ceiling = (min(errors) / 10, max(max(errors) * 10, 1.0)) if errors else (1e-8, 1.0)
    figure = Figure(figsize=(_WIDTH_IN, 4.0), layout="constrained")
    axes = figure.subplots()
    for index, candidate in enumerate(candidates):
        color = f"C{index}" if index != 3 else "C5"  # C3 is the straggler's red, kept for overflow
        error = candidate.error
        shown = ceiling if error is None else floor if error <= 0 else error
        words = ("no finite error" if error is None else "exact (0)" if error <= 0 else f"{error:.1e}")
        gain = "" if candidate.win_back_ms is None else f", wins back ~{candidate.win_back_ms:.1f} ms"
        overflow = f", overflow: {candidate.nonfinite}" if candidate.overflowed else ""
        axes.scatter([candidate.wire_ratio], [shown], s=60, color=color, marker="o" if error is not None else "x",
                     zorder=3, gid=f"advice-{candidate.candidate}",
                     label=f"{candidate.candidate}: {words}, {wire_ratio(candidate.wire_ratio)}{gain}{overflow}")
        if candidate.worst_error is not None and error is not None and candidate.worst_error > shown:
            axes.vlines(candidate.wire_ratio, shown, candidate.worst_error, color=color, linewidth=2, alpha=0.5)
        if candidate.overflowed:
            axes.scatter([candidate.wire_ratio], [shown], s=220, facecolors="none", edgecolors=_STRAGGLER_COLOR,
                         linewidths=1.5, zorder=4, gid=f"advice-overflow-{candidate.candidate}")
    if figures.wire_ratio is not None and figures.wire_ratio > 0:
        axes.axvline(figures.wire_ratio, color="0.3", linestyle=":", linewidth=1, gid="advice-running",
                     label=f"the running hook: {wire_ratio(figures.wire_ratio)}")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"x{value:g}"))
    axes.xaxis.set_minor_formatter(NullFormatter())
    ratios = [c.wire_ratio for c in candidates] + ([figures.wire_ratio] if figures.wire_ratio else [])
    axes.set_xlim(min(ratios) / 2, max(ratios) * 2)
    axes.set_xlabel("bytes on the wire per byte DDP handed over (log)")
    axes.set_ylabel("||x - x^|| / ||x|| (log)")
    axes.grid(alpha=0.3, which="major")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    return figure
