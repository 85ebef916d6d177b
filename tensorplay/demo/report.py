"""The end-of-run report: one row per rank from its result file and exported spans, and a verdict.

Figures come from what tensorplay exported, not from the demo's own clocks: allreduce latency,
bytes, compression error and non-finite counts from the ``tensorplay.comm_hook`` spans, join
timing from the ``tensorplay.join`` span, compute time from the rank's
``tensorplay_step_compute_seconds`` metric.

The straggler verdict follows the contract's ``TensorplayStragglerRank`` reasoning: a straggler's
own work per iteration is well above its peers' (mean compute at least ``STRAGGLER_RATIO`` times
the median of the other ranks' and ``STRAGGLER_MIN_EXCESS_MS`` more), and because everyone else
waits for it inside the allreduce, its own allreduce latency is the lowest. Latency is compared
over the steps every rank trained, so a rank's extra batches under uneven inputs (when the
others only shadow) do not blur it; iterations a rank shadows inside ``Join`` are not compute.

Each rank summarizes its own files (:func:`summarize_rank`) and rank 0 gathers the rows over the
process group, so the report needs no filesystem shared between nodes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from tensorplay.telemetry import DEFAULT_ERROR_EVERY
from tensorplay.telemetry.names import HOOK_SPAN_NAME, JOIN_SPAN_NAME, Attr

from .rundir import RunDir

__all__ = ["RankSummary", "RankTiming", "Verdict", "summarize_rank", "straggler_verdict", "render",
           "STRAGGLER_RATIO", "STRAGGLER_MIN_EXCESS_MS"]

STRAGGLER_RATIO = 1.5
STRAGGLER_MIN_EXCESS_MS = 10.0


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
    injected_delay_ms: float
    metrics_url: str | None


class RankTiming(Protocol):
    """What the straggler verdict weighs of a rank (a :class:`RankSummary`, or the HTML report's)."""

    rank: int
    compute_ms_mean: float | None
    latency_ms_p50: float | None


@dataclass
class Verdict:
    """Which rank (if any) straggles, and the evidence in words."""

    rank: int | None
    evidence: str


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
        injected_delay_ms=result["straggler_delay_ms"],
        metrics_url=result["metrics_url"],
    )


def straggler_verdict(ranks: Sequence[RankTiming]) -> Verdict:
    """Name the rank whose compute is well above its peers' while its allreduce latency is lowest."""
    measured = [r for r in ranks if r.compute_ms_mean is not None and r.latency_ms_p50 is not None]
    if len(measured) < 2:
        return Verdict(None, "n/a (needs two or more ranks with compute time and allreduce latency measured)")
    slowest = max(measured, key=lambda r: r.compute_ms_mean)
    peers = [r for r in measured if r is not slowest]
    peer_compute = statistics.median(r.compute_ms_mean for r in peers)
    peer_latency = statistics.median(r.latency_ms_p50 for r in peers)
    ratio = slowest.compute_ms_mean / peer_compute if peer_compute > 0 else float("inf")
    compute = (f"mean compute {slowest.compute_ms_mean:.1f} ms is {ratio:.1f}x its peers' median "
               f"of {peer_compute:.1f} ms")
    if ratio < STRAGGLER_RATIO or slowest.compute_ms_mean - peer_compute < STRAGGLER_MIN_EXCESS_MS:
        return Verdict(None, f"none (highest: rank {slowest.rank}, whose {compute}; a straggler's is at least "
                             f"{STRAGGLER_RATIO:g}x and {STRAGGLER_MIN_EXCESS_MS:g} ms above)")
    if slowest.latency_ms_p50 > min(r.latency_ms_p50 for r in peers):
        return Verdict(None, f"none (rank {slowest.rank}'s {compute}, but its allreduce p50 of "
                             f"{slowest.latency_ms_p50:.1f} ms is not the lowest: the others do not wait for it)")
    return Verdict(slowest.rank, f"rank {slowest.rank} (its {compute}, and its allreduce p50 is the lowest: "
                                 f"{slowest.latency_ms_p50:.1f} ms vs the peers' {peer_latency:.1f} ms, "
                                 "as the others wait for it in every allreduce)")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _or_dash(value: Any, form: str) -> str:
    return "-" if value is None else format(value, form)


_COLUMNS = ("rank", "steps", "shadowed", "allreduce p50", "wire sent", "handed over", "rel. error",
            "non-finite", "compute mean", "join wait", "last joiner")


def _row(r: RankSummary) -> tuple[str, ...]:
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
        "-" if r.join_wait_ms is None else f"{r.join_wait_ms:.0f} ms",
        "-" if r.last_joiner is None else ("yes" if r.last_joiner else "no"),
    )


def render(ranks: list[RankSummary], verdict: Verdict, hook: str, run_dir: RunDir, nodes: int = 1) -> str:
    """The report as text: the per-rank table, the straggler verdict and what explains it.

    ``run_dir`` is rank 0's; on several ``nodes`` each node's run dir holds its own ranks' files.
    """
    rows = [_COLUMNS, *(_row(r) for r in ranks)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    table = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    on_nodes = f" on {nodes} nodes" if nodes > 1 else ""
    lines = [f"tensorplay demo: {len(ranks)} ranks{on_nodes}, hook traced({hook})", "", *table, "",
             f"straggler: {verdict.evidence}"]
    for r in ranks:
        if r.injected_delay_ms:
            found = "found" if verdict.rank == r.rank else "NOT found"
            lines.append(f"injected: rank {r.rank} sleeps {r.injected_delay_ms:g} ms per step ({found})")
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
              f"spans: {run_dir.path}/spans-rank*.jsonl"
              + (" on each node, its own ranks' (copy them into one directory for tensorplay report)" if nodes > 1 else ""),
              "metrics were served at " + (", ".join(urls) if urls else "no port (see the rank logs)")
              + " (--linger-s keeps them up after training)"]
    return "\n".join(lines)
