"""Which ranks a run's spans should hold and which they lack: a rank with no spans cannot be judged.

Every tensorplay span says its job's world size (:attr:`~.span_reader.Spans.world_sizes`: its
resource's ``tensorplay.world_size``, else its own). A rank below it with no span at all -- killed
before its exporter wrote, or its node's file not copied -- is *missing*: its figures cannot be
drawn, and the straggler verdict, which compares the ranks read, cannot clear it (the rank the job
waited for may be the one whose spans are absent: its peers then wait alike, and the verdict of
those read says none). Spans that disagree on the world size come from more than one job, or from
a damaged line; that is said too, and the ranks are judged against the size most spans say. Where
spans say no world size, or ranks beyond the one they say (a DDP over a subgroup, whose spans
carry the group's size, and no resource that says the job's), which ranks are missing cannot be
told and none is named.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .span_reader import Spans
from .straggler import Verdict

__all__ = ["World", "world", "rank_words"]

_LISTED = 6
"""Runs of consecutive ranks, or files, named before the rest are counted."""


@dataclass(frozen=True)
class World:
    """The world size the spans say, the ranks of it they lack, and every size they say."""

    size: int | None
    """The world size most spans say; None when none says one."""
    missing: tuple[int, ...]
    """Ranks below :attr:`size` with no span, ascending."""
    sizes: dict[int, dict[str, int]]
    """Each world size said: per file name, how many of its spans say it."""

    def problems(self) -> list[str]:
        """What the report, and the demo, say about missing ranks and disagreeing world sizes."""
        problems = []
        if self.missing:
            them = "it" if len(self.missing) == 1 else "them"
            problems.append(f"no spans of {rank_words(self.missing)} of the {self.size} the spans say "
                            f"(tensorplay.world_size): killed before {them} exported, or a file not copied here? "
                            f"Missing from the figures, and the straggler verdict cannot judge {them}")
        if len(self.sizes) > 1:
            said = ", ".join(f"{size} ({_files(files)})" for size, files in sorted(self.sizes.items()))
            problems.append(f"the spans disagree on the job's world size: {said}: files of more than one job, or a "
                            f"damaged line? Ranks are judged against {self.size}, which most spans say")
        return problems

    def judged(self, verdict: Verdict) -> Verdict:
        """``verdict`` (of the ranks read), saying first which ranks it cannot judge."""
        if not self.missing or self.size is None:
            return verdict
        them = "it" if len(self.missing) == 1 else "them"
        return Verdict(verdict.ranks, f"{rank_words(self.missing)} of {self.size} cannot be judged (no spans of {them} "
                                      f"were read); of the other {self.size - len(self.missing)}: {verdict.evidence}",
                       verdict.share, verdict.noise)


def world(spans: Spans) -> World:
    """The world size ``spans`` say and the ranks of it they hold no span of."""
    sizes: dict[int, dict[str, int]] = {}
    for name, said in spans.world_sizes.items():
        for size, count in said.items():
            sizes.setdefault(size, {})[name] = count
    if not sizes:
        return World(None, (), {})
    size = max(sizes, key=lambda s: (sum(sizes[s].values()), s))
    present = np.union1d(spans.hooks.rank, np.array([join.rank for join in spans.joins], dtype=np.int64))
    if len(present) and present.max() >= size:  # ranks beyond the size said: which are missing cannot be told
        return World(size, (), sizes)
    return World(size, tuple(np.setdiff1d(np.arange(size), present).tolist()), sizes)


def rank_words(ranks: tuple[int, ...] | list[int]) -> str:
    """``rank 1``, ``ranks 1, 3-5 and 9``; after a few runs of consecutive ranks, how many more."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    words = [str(low) if low == high else f"{low}-{high}" for low, high in runs[:_LISTED]]
    rest = sum(high - low + 1 for low, high in runs[_LISTED:])
    if rest:
        words.append(f"{rest} more")
    listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {listed}"


def _files(files: dict[str, int]) -> str:
    """``spans-rank0.jsonl, spans-rank2.jsonl: 70 spans``: a few file names, and the spans they hold."""
    names = sorted(files)
    listed = ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more files" if len(names) > _LISTED else "")
    spans = sum(files.values())
    return f"{listed}: {spans} span{'s' if spans != 1 else ''}"
