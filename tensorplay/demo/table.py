"""The demo's end-of-run text: the per-rank table, the straggler verdict and what explains it.

Every figure is :func:`tensorplay.analysis.summary.summarize`'s, from the spans tensorplay
exported (the same derivation ``tensorplay report`` draws): allreduce latency, bytes,
compression error, non-finite counts, compute per step, the end-of-step waits and the straggler
verdict (the rule of the ``TensorplayStragglerRank`` alert), the Join figures, the ranks whose
spans are missing, which the verdict cannot judge, and what communication costs the step with the
compression advice (:mod:`tensorplay.analysis.communication_text` words it). This module only lays
them out, with what the demo itself knows: what it injected and where the metrics were.

Each rank reads its own span file and rank 0 gathers them over the process group
(:mod:`tensorplay.demo.train`), so the table needs no filesystem shared between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorplay.analysis.communication_text import CANDIDATE_COLUMNS, advice_notes, candidate_rows, job_sentence
from tensorplay.analysis.replicas import ReplicaSync
from tensorplay.analysis.summary import ModelSummary
from tensorplay.analysis.table import COLUMNS, rank_rows
from tensorplay.telemetry import DEFAULT_ERROR_EVERY

from .rundir import RunDir

__all__ = ["RankFacts", "render"]


@dataclass(frozen=True)
class RankFacts:
    """What the demo did to one rank, which no span says."""

    rank: int
    injected: str | None
    """The straggler the demo made of it, in words (None: none)."""
    metrics_url: str | None


def render(summary: ModelSummary, facts: list[RankFacts], hook: str, run_dir: RunDir, nodes: int = 1,
           sync: ReplicaSync | None = None, no_sync_bug: str | None = None) -> str:
    """The report as text: the per-rank table, the straggler verdict and what explains it, then
    whether every optimizer step's gradients were reduced once and the replicas stayed equal.

    ``run_dir`` is rank 0's; on several ``nodes`` each node's run dir holds its own ranks' files.
    ``no_sync_bug``: the no_sync() mistake the demo made, in words (None: none).
    """
    verdict = summary.verdict
    missing = summary.world.missing if summary.world is not None else ()
    table = _aligned([COLUMNS, *rank_rows(summary)])
    on_nodes = f" on {nodes} nodes" if nodes > 1 else ""
    lines = [f"tensorplay demo: {len(facts)} ranks{on_nodes}, hook traced({hook})", "", *table, "",
             f"straggler: {verdict.evidence}"]
    lines += [f"spans: {problem}" for problem in (summary.world.problems() if summary.world is not None else [])]
    injected = [f for f in facts if f.injected]
    for f in injected:
        found = ("found" if f.rank in verdict.ranks else
                 "cannot be judged: no spans of it" if f.rank in missing else "NOT found")
        lines.append(f"injected: rank {f.rank} {f.injected} ({found})")
    if not injected:
        lines.append("injected: none")
    shadowing = [r for r in summary.ranks if r.shadowed]
    if shadowing:
        lines.append("uneven inputs: " + ", ".join(f"rank {r.rank} shadowed {r.shadowed}" for r in shadowing)
                     + " iterations inside Join (uneven inputs, not stragglers: shadowing is not compute)")
    figures = summary.communication
    candidates = candidate_rows(figures)
    lines += [job_sentence(figures), *([""] + _aligned([CANDIDATE_COLUMNS, *candidates], left=1) if candidates else [])]
    if sync is not None:
        lines += ["", *sync.lines(), f"injected: {no_sync_bug}" if no_sync_bug else "injected: no no_sync() mistake"]
    urls = [f.metrics_url for f in facts if f.metrics_url]
    lines += ["",
              "allreduce p50: median per bucket over the steps every rank trained;  "
              "wire sent / handed over: every hook call, shadowed iterations included",
              f"rel. error: mean ||x - x^|| / ||x|| of the sampled buckets (every {DEFAULT_ERROR_EVERY}th step by default);  "
              "compute mean: as tensorplay_step_compute_seconds, this rank's own work per iteration",
              "end wait: mean wait in each step's last collective (tensorplay_step_wait_seconds_total);  "
              "costs the job: the share of every step its peers wait for it there (what the straggler verdict "
              "and TensorplayStragglerRank weigh);  latest on: steps at which it arrived last;  "
              "median late: its lateness at the median step;  the verdict names a rank that costs more than the job's "
              "own noise explains (k x the spread of the other ranks' shares) in each third of the steps",
              "gradient reductions, unreduced steps, replica fingerprints: from the optimizer step counts on each "
              "reduced iteration's last hook span and the tensorplay.optimizer_step span of each unreduced step (the "
              "steps shown: up to each rank's last iteration, later ones only when unreduced; a fingerprint every "
              "TENSORPLAY_FINGERPRINT_EVERY optimizer steps, the demo's default 5), what TensorplayGradientsNotReduced "
              "and TensorplayReplicasDiverged weigh",
              "exposed comm: mean per step of the time from the rank's last hook call to its last hook future done "
              "(tensorplay_step_exposed_communication_seconds_total; on a rank that waits for a peer, that wait too);  "
              "hidden: the share of its communication (time with a collective in flight) the backward hid",
              *advice_notes(figures),
              f"spans: {run_dir.path}/spans-rank*.jsonl"
              + (" on each node, its own ranks' (copy them into one directory for tensorplay report)" if nodes > 1 else ""),
              "metrics were served at " + (", ".join(urls) if urls else "no port (see the rank logs)")
              + " (--linger-s keeps them up after training)"]
    return "\n".join(lines)


def _aligned(rows: list[tuple[str, ...]], left: int = 0) -> list[str]:
    """Rows of cells as lines, each column aligned to its widest cell: the first ``left`` columns
    (names) to the left, the others (figures) to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) if i < left else cell.rjust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in rows]
