"""The end-of-run report: one row per rank from its result file and exported spans, and a verdict.

Figures come from what tensorplay exported, not from the demo's own clocks: allreduce latency,
bytes, compression error, non-finite counts and the end-of-step waits from the
``tensorplay.comm_hook`` spans, join timing from the ``tensorplay.join`` span, compute time from
the rank's ``tensorplay_step_compute_seconds`` metric.

The straggler verdict is :func:`tensorplay.analysis.straggler.straggler_verdict`, the rule of
the ``TensorplayStragglerRank`` alert: how much of every step the job waits for each rank at the
step's last collective. It is weighed over the steps every rank trained (after the first), so a
rank's extra batches under uneven inputs (when the others only shadow) do not blur it.

Each rank summarizes its own files (:func:`summarize_rank`) and rank 0 gathers the rows over the
process group, so the report needs no filesystem shared between nodes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tensorplay.analysis.straggler import RankWait, Verdict, lateness
from tensorplay.telemetry import DEFAULT_ERROR_EVERY
from tensorplay.telemetry.names import HOOK_SPAN_NAME, JOIN_SPAN_NAME, Attr

from .rundir import RunDir

__all__ = ["RankSummary", "summarize_rank", "render"]


@dataclass
class RankSummary:
    """What one rank did and what tensorplay measured of it."""

    rank: int
    batches: int
    latency_ms_p50: float | None
    """Median allreduce latency per bucket, over the steps every rank trained."""
    wire_bytes: int
    bucket_bytes: int
    relative_error: float | None
    """Mean compression error of the sampled buckets; None for hooks that do not compress."""
    nonfinite: int
    compute_ms_mean: float | None
    shadowed: int | None
    join_wait_ms: float | None
    last_joiner: bool | None
    end_wait: RankWait
    """Its end-of-step waits over the steps every rank trained, after the first."""
    injected: str | None
    """The straggler the demo made of it, in words (None: none)."""
    metrics_url: str | None


def _spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def summarize_rank(result: dict[str, Any], spans_path: Path, common_steps: int) -> RankSummary:
    """One rank's row, from its result and its own span file.

    ``common_steps`` is the fewest batches any rank trained: latency is compared over those steps.
    """
    spans = _spans(spans_path)
    hooks = [span["attributes"] for span in spans if span["name"] == HOOK_SPAN_NAME]
    joins = [span["attributes"] for span in spans if span["name"] == JOIN_SPAN_NAME]
    latencies = [a[Attr.ALLREDUCE_LATENCY_MS] for a in hooks if a[Attr.STEP] < common_steps]
    errors = [a[Attr.COMPRESSION_RELATIVE_ERROR] for a in hooks if Attr.COMPRESSION_RELATIVE_ERROR in a]
    count = result["compute_seconds_count"]
    join = joins[-1] if joins else None
    compared = [span for span in spans if span["name"] == HOOK_SPAN_NAME
                and 0 <= span["attributes"][Attr.STEP] < common_steps]
    return RankSummary(
        rank=result["rank"],
        batches=result["batches"],
        latency_ms_p50=statistics.median(latencies) if latencies else None,
        wire_bytes=sum(a[Attr.BUCKET_WIRE_BYTES] for a in hooks),
        bucket_bytes=sum(a[Attr.BUCKET_BYTES] for a in hooks),
        relative_error=statistics.fmean(errors) if errors else None,
        nonfinite=sum(a[Attr.COMPRESSION_NONFINITE] for a in hooks),
        compute_ms_mean=1e3 * result["compute_seconds_sum"] / count if count else None,
        shadowed=join[Attr.JOIN_SHADOW_ITERATIONS] if join else None,
        join_wait_ms=join[Attr.JOIN_WAIT_MS] if join else None,
        last_joiner=join[Attr.JOIN_LAST_JOINER] if join else None,
        end_wait=_end_wait(result["rank"], compared),
        injected=result["straggler"],
        metrics_url=result["metrics_url"],
    )


def _end_wait(rank: int, spans: list[dict[str, Any]]) -> RankWait:
    """Sum of each step's last-bucket wait (step 0 excepted: DDP rebuilds its buckets there), and the
    time from step 0's end to the last step's end on this rank's clock."""
    last: dict[int, dict[str, Any]] = {}
    for span in spans:
        step = span["attributes"][Attr.STEP]
        if step not in last or span["attributes"][Attr.BUCKET_INDEX] > last[step]["attributes"][Attr.BUCKET_INDEX]:
            last[step] = span
    if 0 not in last or len(last) < 2:
        return RankWait(rank, 0.0, 0, 0.0)
    ends = {step: datetime.fromisoformat(span["end_time"]).timestamp() for step, span in last.items()}
    counted = [step for step in last if step > 0]
    return RankWait(
        rank=rank,
        wait_s=sum(last[step]["attributes"][Attr.ALLREDUCE_LATENCY_MS] for step in counted) / 1e3,
        steps=len(counted),
        seconds=ends[max(counted)] - ends[0],
    )


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _or_dash(value: Any, form: str) -> str:
    return "-" if value is None else format(value, form)


_COLUMNS = ("rank", "steps", "shadowed", "allreduce p50", "wire sent", "handed over", "rel. error",
            "non-finite", "compute mean", "end wait", "costs the job", "join wait", "last joiner")


def _row(r: RankSummary, share: float | None) -> tuple[str, ...]:
    wait = r.end_wait
    return (
        str(r.rank),
        str(r.batches),
        _or_dash(r.shadowed, "d"),
        _or_dash(r.latency_ms_p50, ".2f") + " ms",
        _size(r.wire_bytes),
        _size(r.bucket_bytes),
        _or_dash(r.relative_error, ".2e"),
        str(r.nonfinite),
        _or_dash(r.compute_ms_mean, ".1f") + " ms",
        "-" if not wait.steps else f"{1e3 * wait.wait_s / wait.steps:.1f} ms",
        "-" if share is None else f"{100 * max(share, 0.0):.0f} %",
        "-" if r.join_wait_ms is None else f"{r.join_wait_ms:.0f} ms",
        "-" if r.last_joiner is None else ("yes" if r.last_joiner else "no"),
    )


def render(ranks: list[RankSummary], verdict: Verdict, hook: str, run_dir: RunDir, nodes: int = 1) -> str:
    """The report as text: the per-rank table, the straggler verdict and what explains it.

    ``run_dir`` is rank 0's; on several ``nodes`` each node's run dir holds its own ranks' files.
    """
    shares = {f.rank: f.share for f in lateness([r.end_wait for r in ranks])}
    rows = [_COLUMNS, *(_row(r, shares.get(r.rank)) for r in ranks)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    table = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    on_nodes = f" on {nodes} nodes" if nodes > 1 else ""
    lines = [f"tensorplay demo: {len(ranks)} ranks{on_nodes}, hook traced({hook})", "", *table, "",
             f"straggler: {verdict.evidence}"]
    for r in ranks:
        if r.injected:
            found = "found" if r.rank in verdict.ranks else "NOT found"
            lines.append(f"injected: rank {r.rank} {r.injected} ({found})")
    shadowing = [r for r in ranks if r.shadowed]
    if shadowing:
        lines.append("uneven inputs: " + ", ".join(f"rank {r.rank} shadowed {r.shadowed}" for r in shadowing)
                     + " iterations inside Join (uneven inputs, not stragglers: shadowing is not compute)")
    urls = [r.metrics_url for r in ranks if r.metrics_url]
    common_steps = min(r.batches for r in ranks)
    lines += ["",
              f"allreduce p50: median per bucket over the {common_steps} steps every rank trained;  "
              "wire sent / handed over: every hook call, shadowed iterations included",
              f"rel. error: mean ||x - x^|| / ||x|| of the sampled buckets (every {DEFAULT_ERROR_EVERY}th step by default);  "
              "compute mean: tensorplay_step_compute_seconds, this rank's own work per iteration",
              "end wait: mean wait in each step's last collective (tensorplay_step_wait_seconds_total);  "
              "costs the job: the share of every step its peers wait for it there (what the straggler verdict "
              "and TensorplayStragglerRank weigh)",
              f"spans: {run_dir.path}/spans-rank*.jsonl"
              + (" on each node, its own ranks' (copy them into one directory for tensorplay report)" if nodes > 1 else ""),
              "metrics were served at " + (", ".join(urls) if urls else "no port (see the rank logs)")
              + " (--linger-s keeps them up after training)"]
    return "\n".join(lines)
