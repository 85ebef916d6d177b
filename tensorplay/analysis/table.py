"""The per-rank table as text cells: one wording of each figure for the terminal and the HTML page."""

from __future__ import annotations

from .summary import ModelSummary, RankSummary

__all__ = ["COLUMNS", "rank_rows"]

COLUMNS = ("rank", "steps", "shadowed", "allreduce p50", "wire sent", "handed over", "rel. error", "non-finite",
           "compute mean", "exposed comm", "hidden",
           "end wait", "costs the job", "latest on", "median late", "join wait", "last joiner")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _or_dash(value: float | int | None, form: str, unit: str = "") -> str:
    return "-" if value is None else format(value, form) + unit


def _row(r: RankSummary) -> tuple[str, ...]:
    late = r.lateness
    return (
        str(r.rank),
        str(r.steps),
        _or_dash(r.shadowed, "d"),
        _or_dash(r.latency_ms_p50, ".2f", " ms"),
        _size(r.wire_bytes),
        _size(r.bucket_bytes),
        _or_dash(r.relative_error, ".2e"),
        str(r.nonfinite),
        _or_dash(r.compute_ms_mean, ".1f", " ms"),
        _or_dash(r.exposed_ms, ".1f", " ms"),
        "-" if r.hidden_share is None else f"{100 * r.hidden_share:.0f} %",
        _or_dash(r.end_wait_ms, ".1f", " ms"),
        "-" if late is None else f"{100 * max(late.share, 0.0):.0f} %",
        "-" if late is None else f"{late.latest_steps}/{late.steps}",
        "-" if late is None else f"{1e3 * max(late.median_s, 0.0):.1f} ms",
        _or_dash(r.join_wait_ms, ".0f", " ms"),
        "-" if r.last_joiner is None else ("yes" if r.last_joiner else "no"),
    )


def rank_rows(summary: ModelSummary) -> list[tuple[str, ...]]:
    """One row of cells per rank, in the order of :data:`COLUMNS`."""
    return [_row(r) for r in summary.ranks]
