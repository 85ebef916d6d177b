"""What communication costs the step, and what another hook would give (telemetry contract, section 6).

**Per rank**, over its counted iterations -- those whose closing span carries the step figures
(``tensorplay.step.busy_ms``, ``.exposed_communication_ms``, ``.communication_ms``: the iterations
``tensorplay_steps_total`` counts) -- the busy time, exposed communication and communication per
step, as the recording rules take them (a counter's sum over the steps counted). Its step is busy
+ exposed: from the previous iteration's end to the last hook future's completion. The share of
its communication the backward hid is 1 - exposed / communication.

**The job's** figures are those of the rank the others wait for: the least exposed communication
per step over the ranks, as ``job:tensorplay_step_exposed_communication_seconds:min_mean5m`` takes
it (on every other rank the exposed time also holds its wait for that one). Below
:data:`NO_PAYOFF_SHARE` of that rank's step, no compression will pay: it can win back at most the
exposed communication.

**The advice** (``tensorplay.advice`` spans): per candidate, its error over every advised
iteration of every rank (the median and the worst finite one), its wire ratio, the elements it
would make non-finite, and an estimate of what it would win back per step. The model of that
estimate, stated beside every rendering: the exposed communication scales with the bytes on the
wire. A candidate sending ``w`` of the bytes DDP hands over, where the running hook sends ``w0``
(its wire bytes over the bytes handed to it, the whole run), leaves ``exposed x w / w0`` exposed:
it wins back ``exposed x (1 - w / w0)``, never below 0 (it would send more) nor above the exposed
communication. What the model leaves out: the latency of a collective that does not shrink with
its bytes, the time compressing and decompressing take, and PowerSGD's extra collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensorplay.telemetry.names import Candidate

from .run import Run
from .span_reader import AdviceSpan

__all__ = ["NO_PAYOFF_SHARE", "RankCommunication", "CandidateAdvice", "Communication", "communication"]

NO_PAYOFF_SHARE = 0.05
"""Exposed communication below this share of the step: no compression will pay (it could win back
less than 5 % of the step, within a shared machine's step-to-step noise)."""


@dataclass(frozen=True)
class RankCommunication:
    """One rank's step timeline: means per counted iteration, in ms."""

    rank: int
    steps: int
    """Counted iterations (the closing span carries the step figures)."""
    busy_ms: float
    exposed_ms: float
    communication_ms: float

    @property
    def step_ms(self) -> float:
        """Busy + exposed: the previous iteration's end to the last hook future's completion."""
        return self.busy_ms + self.exposed_ms

    @property
    def exposed_share(self) -> float:
        """Exposed communication over the step (0 for a step of no time)."""
        return self.exposed_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def hidden_share(self) -> float | None:
        """The share of its communication the backward hid; None when no collective was in flight."""
        if self.communication_ms <= 0:
            return None
        return max(0.0, 1.0 - self.exposed_ms / self.communication_ms)


@dataclass(frozen=True)
class CandidateAdvice:
    """What one candidate compression would have made of the advised iterations' gradients."""

    candidate: str
    error: float | None
    """Median pooled error over every advised iteration of every rank; None when none was finite."""
    worst_error: float | None
    """The largest finite one."""
    wire_ratio: float
    """Bytes it would send per byte DDP handed over (the median; the same on every rank)."""
    nonfinite: int
    """The most elements one advised iteration of one rank would have made non-finite (fp16 overflow)."""
    overflowed: int
    """Advised iterations (of any rank) in which it would have made some element non-finite."""
    win_back_ms: float | None
    """Estimated exposed communication per step it would win back (the module's model); None: not measured."""


@dataclass(frozen=True)
class Communication:
    """One model's figures of contract section 6."""

    ranks: tuple[RankCommunication, ...]
    """Ranks with at least one counted iteration, in rank order."""
    job: RankCommunication | None
    """The rank the others wait for (the least exposed per step); None: not measured."""
    wire_ratio: float | None
    """Bytes the running hook sent per byte DDP handed it, the whole run; None without bytes handed over."""
    candidates: tuple[CandidateAdvice, ...]
    """Empty when no iteration was advised."""
    advised: int
    """Advised iterations read, all ranks together."""
    advised_ranks: int
    advised_steps: tuple[int, ...]

    @property
    def pays(self) -> bool | None:
        """Whether compression can pay: exposed communication is at least :data:`NO_PAYOFF_SHARE` of the step."""
        return None if self.job is None else self.job.exposed_share >= NO_PAYOFF_SHARE

    def of_rank(self, rank: int) -> RankCommunication | None:
        return next((figures for figures in self.ranks if figures.rank == rank), None)


def _ranks(run: Run) -> tuple[RankCommunication, ...]:
    counted = ~np.isnan(run.exposed_ms) & ~np.isnan(run.busy_ms) & ~np.isnan(run.communication_ms)
    figures = []
    for row, rank in enumerate(run.ranks.tolist()):
        steps = counted[row]
        if steps.any():
            figures.append(RankCommunication(rank, int(steps.sum()), float(run.busy_ms[row, steps].mean()),
                                             float(run.exposed_ms[row, steps].mean()),
                                             float(run.communication_ms[row, steps].mean())))
    return tuple(figures)


def win_back_ms(exposed_ms: float, wire_ratio: float, running_wire_ratio: float) -> float:
    """The estimate: exposed x (1 - wire ratio / the running hook's), within [0, exposed]."""
    if running_wire_ratio <= 0:
        return 0.0  # the running hook sends nothing: there are no bytes to save
    return exposed_ms * min(1.0, max(0.0, 1.0 - wire_ratio / running_wire_ratio))


def _candidate(name: str, advice: list[AdviceSpan], job: RankCommunication | None,
               running_wire_ratio: float | None) -> CandidateAdvice:
    errors = np.array([span.candidates[name][0] for span in advice])
    finite = errors[np.isfinite(errors)]
    wire = float(np.median([span.candidates[name][1] for span in advice]))
    nonfinite = [span.candidates[name][2] for span in advice]
    gain = (None if job is None or running_wire_ratio is None
            else win_back_ms(job.exposed_ms, wire, running_wire_ratio))
    return CandidateAdvice(name, float(np.median(finite)) if len(finite) else None,
                           float(finite.max()) if len(finite) else None, wire, max(nonfinite),
                           sum(count > 0 for count in nonfinite), gain)


def communication(run: Run) -> Communication:
    """The figures of one aggregated model: per rank, the job's, and the advice's candidates."""
    ranks = _ranks(run)
    job = min(ranks, key=lambda figures: (figures.exposed_ms, figures.rank)) if ranks else None
    handed = sum(hook.handed_over for hook in run.hook_bytes)
    wire_ratio = sum(hook.wire for hook in run.hook_bytes) / handed if handed else None
    advice = run.advice  # the reader keeps an advice span only with every candidate's figures
    candidates = tuple(_candidate(name, advice, job, wire_ratio) for name in Candidate.ALL) if advice else ()
    return Communication(ranks, job, wire_ratio, candidates, len(advice), len({span.rank for span in advice}),
                         tuple(sorted({span.step for span in advice})))
