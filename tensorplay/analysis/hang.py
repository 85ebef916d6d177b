"""Which ranks a hung job is stuck on: the rule of the ``TensorplayRankStalled`` / ``TensorplayJobHung`` alerts.

Given each rank's live state (the collective it waits in, if any; whether it finished), the ranks
in no collective while others wait are the ones that never arrived; when every unfinished rank
waits inside a collective there is no rank to blame.
"""

from __future__ import annotations

from typing import Any

__all__ = ["attribute_hang"]


def attribute_hang(states: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split the unfinished ranks' states, in rank order, into (never arrived, waiting in a collective)."""
    active = sorted((s for s in states if not s["finished"]), key=lambda s: s["rank"])
    return [s for s in active if s["waiting"] is None], [s for s in active if s["waiting"] is not None]
