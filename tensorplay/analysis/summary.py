"""Every per-rank figure of a run, derived once: what the demo's table and ``tensorplay report`` show.

For each model of the run (:func:`~tensorplay.analysis.run.models`), one :class:`RankSummary` per
rank and the straggler verdict, all from the same :class:`~tensorplay.analysis.run.Run`: the
allreduce p50 and the end-of-step waits over the steps every rank trained, compute per step as
``tensorplay_step_compute_seconds`` defines it, bytes, compression error, and the Join figures;
and which ranks of the job's world size the spans lack (:mod:`.world`), which the verdict says it
cannot judge; and what communication costs the step, with the compression advice
(:mod:`.communication`). Renderers format these numbers; none of them derives one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .communication import Communication, communication
from .run import Run, aggregate, models
from .span_reader import Spans
from .straggler import Lateness, Verdict, lateness, straggler_verdict
from .world import World, world

__all__ = ["RankSummary", "ModelSummary", "summarize", "summarize_run"]


@dataclass(frozen=True)
class RankSummary:
    """What one rank did in one model, and what tensorplay measured of it."""

    rank: int
    steps: int
    """Steps it trained itself (not shadowed inside Join)."""
    shadowed: int | None
    """Iterations it shadowed inside Join (its ``tensorplay.join`` spans); None without a Join span."""
    latency_ms_p50: float | None
    """Median allreduce latency per bucket, over the steps every rank trained."""
    wire_bytes: int
    bucket_bytes: int
    relative_error: float | None
    """Mean compression error of its sampled buckets (its own steps); None when nothing was sampled."""
    nonfinite: int
    compute_ms_mean: float | None
    """Mean compute before a step, over the steps it trained (as tensorplay_step_compute_seconds)."""
    end_wait_ms: float | None
    """Mean wait in each step's last collective, over the steps every rank trained after the first."""
    lateness: Lateness | None
    """How much of every step the job waits for it (None: fewer than two ranks measured)."""
    join_wait_ms: float | None
    last_joiner: bool | None
    exposed_ms: float | None
    """Mean exposed communication per counted iteration (None: not measured)."""
    hidden_share: float | None
    """The share of its communication the backward hid (None: not measured, or no collective in flight)."""


@dataclass(frozen=True)
class ModelSummary:
    """One model's per-rank figures and straggler verdict, and the arrays they come from."""

    run: Run
    ranks: list[RankSummary]
    verdict: Verdict
    """Of the ranks read, saying first which ranks of the world size it cannot judge (no spans)."""
    communication: Communication
    """What communication costs the step and what another hook would give."""
    world: World | None = None
    """The world size the run's spans say and the ranks they lack (None: not looked at)."""

    @property
    def model(self) -> int:
        return self.run.model


def _number(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def summarize_run(run: Run, world_of_run: World | None = None) -> ModelSummary:
    """The per-rank figures and the verdict of one aggregated model (of a run whose world is ``world_of_run``)."""
    waits = run.end_waits()
    figures = {f.rank: f for f in lateness(waits)}
    p50, compute, trained = run.latency_ms_p50(), run.compute_ms_mean(), run.trained_steps()
    timeline = communication(run)
    rows = []
    for row, rank in enumerate(run.ranks.tolist()):
        joins = [join for join in run.joins if join.rank == rank]
        wait = waits[row]
        own = timeline.of_rank(rank)
        rows.append(RankSummary(
            rank=rank,
            steps=int(trained[row]),
            shadowed=sum(join.shadow_iterations for join in joins) if joins else None,
            latency_ms_p50=_number(p50[row]),
            wire_bytes=int(run.rank_wire_bytes[row]),
            bucket_bytes=int(run.rank_bucket_bytes[row]),
            relative_error=_number(run.rank_relative_error[row]),
            nonfinite=int(run.rank_nonfinite[row]),
            compute_ms_mean=_number(compute[row]),
            end_wait_ms=1e3 * wait.wait_s / wait.steps if wait.steps else None,
            lateness=figures.get(rank),
            join_wait_ms=sum(join.wait_ms for join in joins) if joins else None,
            last_joiner=joins[-1].last_joiner if joins else None,
            exposed_ms=None if own is None else own.exposed_ms,
            hidden_share=None if own is None else own.hidden_share,
        ))
    verdict = straggler_verdict(waits)
    return ModelSummary(run, rows, verdict if world_of_run is None else world_of_run.judged(verdict), timeline,
                        world_of_run)


def summarize(spans: Spans) -> list[ModelSummary]:
    """Each model's figures and verdict, in model order."""
    world_of_run = world(spans)
    return [summarize_run(aggregate(spans, model), world_of_run) for model in models(spans)]
