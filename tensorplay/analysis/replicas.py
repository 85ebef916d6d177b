"""Were the gradients reduced, once per optimizer step, and did the replicas stay equal? From the spans.

Each rank's ``tensorplay.optimizer_step`` spans (one per optimizer step that updated a traced DDP
model) say how many gradient reductions preceded the step, whether it updated a model with none,
and, every ``TENSORPLAY_FINGERPRINT_EVERY`` steps, the replica fingerprint taken right after it.
:func:`replica_sync` derives, per rank and across ranks, what the demo's report and ``tensorplay
report`` say in one sentence each, with what to do -- the same facts the rules behind
``TensorplayGradientsNotReduced`` and ``TensorplayReplicasDiverged`` weigh, and the same
comparison: ranks are only compared at the same step number.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .span_reader import OptimizerSteps

__all__ = ["RankSteps", "Divergence", "ReplicaSync", "replica_sync"]

NAMED_STEPS = 5
"""Step numbers named in a sentence at most."""


@dataclass(frozen=True)
class RankSteps:
    """One rank's optimizer steps over traced models."""

    rank: int
    steps: int
    reductions: int
    unreduced: list[int]
    """The numbers of its steps without a reduction since the model's previous step."""
    fingerprints: dict[int, int]
    """Step number -> the fingerprint taken right after it."""

    @property
    def reductions_per_step(self) -> float:
        return self.reductions / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class Divergence:
    """The first step at which ranks that fingerprinted it disagree."""

    step: int
    fingerprints: int
    """How many different fingerprints that step had."""
    minority: list[int]
    """Ranks holding a fingerprint fewer ranks share than the most common one (none when the ranks split evenly)."""
    ranks: list[int]
    """Every rank that fingerprinted the step."""


@dataclass(frozen=True)
class ReplicaSync:
    """Every rank's steps, the steps compared across ranks, and the first that differed."""

    ranks: list[RankSteps]
    compared: list[int]
    """Step numbers fingerprinted by two or more ranks."""
    differing: list[int]
    """Of those, the steps whose fingerprints were not all equal."""
    divergence: Divergence | None

    @property
    def problem(self) -> bool:
        """Whether a step went unreduced or the replicas differ."""
        return self.divergence is not None or any(rank.unreduced for rank in self.ranks)

    def lines(self) -> list[str]:
        """The three sentences: reductions per optimizer step, unreduced steps, fingerprints; each with what to do.

        One sentence when no rank has an optimizer step span (no optimizer stepped a traced model,
        or the spans come from a tensorplay that did not record them).
        """
        if not self.ranks:
            return ["gradient synchronisation: no optimizer step over a traced model was recorded (tensorplay "
                    "counts the step() of torch.optim optimizers whose parameters a traced hook reduced)"]
        return [self._reductions_line(), self._unreduced_line(), self._fingerprints_line()]

    def _reductions_line(self) -> str:
        stepping = self.ranks
        ratios = {rank.rank: rank.reductions_per_step for rank in stepping}
        low, high = min(ratios.values()), max(ratios.values())
        if high - low < 0.05:
            figure = f"{_ratio(high)} per optimizer step on every rank ({_steps_each(stepping)})"
        else:
            figure = (f"{_ratio(low)} to {_ratio(high)} per optimizer step across ranks "
                      f"(rank {max(ratios, key=ratios.get)}: {_ratio(high)})")
        if high >= 1.5:
            advice = ("if these are the micro-batches of gradient accumulation, no_sync() wraps only the backward: "
                      "wrap the forward too, DDP decides at the forward whether the backward reduces (a second "
                      "backward per step, or several DDP models under one optimizer, count one each: nothing to fix then)")
        elif low < 0.95:
            advice = "some steps' gradients were never reduced (next line)"
        else:
            advice = "as it should be, each step's gradients reduced once"
        return f"gradient reductions: {figure}: {advice}"

    def _unreduced_line(self) -> str:
        affected = [rank for rank in self.ranks if rank.unreduced]
        if not affected:
            return "unreduced optimizer steps: none (every step followed a reduction of the models it updated)"
        first = min(rank.unreduced[0] for rank in affected)
        counts = ", ".join(f"rank {rank.rank}: {len(rank.unreduced)} of {rank.steps}" for rank in affected[:NAMED_STEPS])
        more = f" and {len(affected) - NAMED_STEPS} more ranks" if len(affected) > NAMED_STEPS else ""
        return (f"unreduced optimizer steps: {counts}{more}, the first at step {first}: each such step trained its "
                f"rank on its own gradients, and the replicas drift apart -- a no_sync() that is never left? End "
                f"no_sync() before the micro-batch whose backward precedes the step (or replace a hook that "
                f"reduces nothing, such as noop_hook)")

    def _fingerprints_line(self) -> str:
        taken = sum(len(rank.fingerprints) for rank in self.ranks)
        if not taken:
            return ("replica fingerprints: none taken (every TENSORPLAY_FINGERPRINT_EVERY optimizer steps, default "
                    "100; set it lower to compare the replicas of a short run)")
        if not self.compared:
            return "replica fingerprints: not compared (no step was fingerprinted by two ranks)"
        divergence = self.divergence
        if divergence is None:
            return (f"replica fingerprints: equal on every rank at the {_count(len(self.compared), 'step')} compared "
                    f"({_steps(self.compared)}): the replicas are the same model")
        if divergence.minority:
            who = (f"rank{'s' if len(divergence.minority) > 1 else ''} "
                   f"{', '.join(map(str, divergence.minority[:NAMED_STEPS]))} "
                   f"hold{'' if len(divergence.minority) > 1 else 's'} a fingerprint fewer ranks share than the most common one")
        else:
            who = f"the ranks split evenly, so no majority says which is right (ranks {', '.join(map(str, divergence.ranks[:NAMED_STEPS]))})"
        return (f"replica fingerprints: differ at {len(self.differing)} of the {_count(len(self.compared), 'step')} compared, "
                f"from step {divergence.step} on, where {divergence.fingerprints} different fingerprints were held and {who}: "
                f"the replicas are no longer the same model (TensorplayReplicasDiverged) -- fix the cause above, "
                f"then restart from a checkpoint taken before step {divergence.step}")


def _ratio(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 0.005 else f"{value:.2f}"


def _steps_each(ranks: list[RankSteps]) -> str:
    low, high = min(rank.steps for rank in ranks), max(rank.steps for rank in ranks)
    return f"{_count(high, 'step')} each" if low == high else f"{low} to {high} steps each"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _steps(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:NAMED_STEPS]))
    return shown + (f", ... {numbers[-1]}" if len(numbers) > NAMED_STEPS else "")


def replica_sync(steps: OptimizerSteps) -> ReplicaSync:
    """Per rank and across ranks, from every rank's optimizer step spans."""
    ranks = []
    for rank in np.unique(steps.rank).tolist():
        mine = steps.rank == rank
        numbers, fingerprints = steps.step[mine], steps.fingerprint[mine]
        taken = fingerprints >= 0
        ranks.append(RankSteps(
            rank=rank,
            steps=int(mine.sum()),
            reductions=int(steps.reductions[mine].sum()),
            unreduced=sorted(numbers[steps.unreduced[mine]].tolist()),
            fingerprints=dict(zip(numbers[taken].tolist(), fingerprints[taken].tolist())),
        ))
    by_step: dict[int, dict[int, int]] = {}
    for rank in ranks:
        for number, fingerprint in rank.fingerprints.items():
            by_step.setdefault(number, {})[rank.rank] = fingerprint
    compared = sorted(number for number, held in by_step.items() if len(held) > 1)
    differing = [number for number in compared if len(set(by_step[number].values())) > 1]
    return ReplicaSync(ranks, compared, differing, _divergence(differing[0], by_step[differing[0]]) if differing else None)


def _divergence(step: int, held: dict[int, int]) -> Divergence:
    shares = Counter(held.values())
    most = max(shares.values())
    minority = sorted(rank for rank, fingerprint in held.items() if shares[fingerprint] < most)
    return Divergence(step, len(shares), minority, sorted(held))
