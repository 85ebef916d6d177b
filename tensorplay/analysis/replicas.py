"""Were the gradients reduced, once per optimizer step, and did the replicas stay equal? From the spans.

The last hook span of each iteration a traced hook reduced says how many optimizer steps had
updated its model before it (``tensorplay.optimizer.steps``); so, per model, the iterations whose
count is ``s - 1`` are the reductions that preceded its step ``s``, and a step without one is
unreduced: the count jumped by more than one between two iterations. Steps after a model's last
iteration show only when unreduced, on the span each such step has (``tensorplay.optimizer_step``,
what a ``no_sync()`` that is never left leaves); the step right after the last iteration followed
its reduction. Either span may carry the rank's latest replica fingerprint and its step.
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
    """One rank's optimizer steps over traced models, those the spans show (summed over its models)."""

    rank: int
    steps: int
    """Steps the spans show: each model's, from its first reduced iteration to its last iteration or
    its last unreduced step's span, whichever is later."""
    reductions: int
    """Reduced iterations that preceded those steps."""
    unreduced: int
    """Of those steps, the ones without a reduction since their model's previous step."""
    first_unreduced: int | None
    """The lowest number (among its model's steps) of an unreduced step; None without one."""
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

        One sentence when the spans show no optimizer step over a traced model (none stepped, the
        run ended right after its first, or the spans come from a tensorplay that did not count them).
        """
        if not any(rank.steps for rank in self.ranks):
            return ["gradient synchronisation: no optimizer step over a traced model was recorded (tensorplay "
                    "counts the step() of torch.optim optimizers whose parameters a traced hook reduced)"]
        return [self._reductions_line(), self._unreduced_line(), self._fingerprints_line()]

    def _reductions_line(self) -> str:
        stepping = [rank for rank in self.ranks if rank.steps]
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
                      "backward per step counts one more: nothing to fix then)")
        elif low < 0.95:
            advice = "some steps' gradients were never reduced (next line)"
        else:
            advice = "as it should be, each step's gradients reduced once"
        return f"gradient reductions: {figure}: {advice}"

    def _unreduced_line(self) -> str:
        affected = [rank for rank in self.ranks if rank.unreduced]
        if not affected:
            return "unreduced optimizer steps: none (every step followed a reduction of the models it updated)"
        first = min(rank.first_unreduced for rank in affected if rank.first_unreduced is not None)
        counts = ", ".join(f"rank {rank.rank}: {rank.unreduced} of {rank.steps}" for rank in affected[:NAMED_STEPS])
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


@dataclass(frozen=True)
class _ModelSteps:
    """One model's steps as its spans show them (:class:`RankSteps`' fields, for one model)."""

    steps: int
    reductions: int
    unreduced: int
    first_unreduced: int | None


def _model_steps(counts: np.ndarray, unreduced_spans: np.ndarray) -> _ModelSteps:
    """From a model's iteration counts (its hook spans) and the step numbers of its unreduced steps' spans.

    Its step ``s`` is reduced when an iteration counted ``s - 1`` steps before it. The steps shown
    run from its first iteration's count to the last count of either kind of span. Never more
    than one pass over the distinct counts: a count far beyond the others allocates nothing.
    """
    if not len(counts):  # its hook spans were lost: only what the unreduced steps' spans say
        numbers = np.unique(unreduced_spans)
        return _ModelSteps(len(numbers), 0, len(numbers), int(numbers[0]) if len(numbers) else None)
    distinct = np.unique(counts)
    first, last = int(distinct[0]), max(int(distinct[-1]), int(unreduced_spans.max(initial=0)))
    followed = distinct[distinct < last]  # the counts whose iterations a step followed
    unreduced_at = None
    gaps = np.flatnonzero(np.diff(distinct) > 1)
    if len(gaps):
        unreduced_at = int(distinct[gaps[0]]) + 2
    elif last > distinct[-1] + 1:
        unreduced_at = int(distinct[-1]) + 2
    return _ModelSteps(last - first, int(np.count_nonzero(counts < last)), last - first - len(followed), unreduced_at)


def replica_sync(steps: OptimizerSteps) -> ReplicaSync:
    """Per rank and across ranks, from the optimizer step counts and fingerprints every rank's spans carry."""
    ranks = []
    for rank in np.unique(steps.rank).tolist():
        mine = steps.rank == rank
        models = [_model_steps(steps.steps[same & ~steps.unreduced], steps.steps[same & steps.unreduced])
                  for same in (mine & (steps.model == model) for model in np.unique(steps.model[mine]))]
        taken = mine & (steps.fingerprint_step >= 0)
        firsts = [model.first_unreduced for model in models if model.first_unreduced is not None]
        ranks.append(RankSteps(
            rank=rank,
            steps=sum(model.steps for model in models),
            reductions=sum(model.reductions for model in models),
            unreduced=sum(model.unreduced for model in models),
            first_unreduced=min(firsts) if firsts else None,
            fingerprints=dict(zip(steps.fingerprint_step[taken].tolist(), steps.fingerprint[taken].tolist())),
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
