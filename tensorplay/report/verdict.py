"""The straggler verdict of a run read from its spans: the one rule, fed by the spans.

The rule lives in :func:`tensorplay.analysis.straggler.straggler_verdict` (the demo's text report
and the ``TensorplayStragglerRank`` alert follow it too); this module feeds it each rank's
end-of-step waits as :meth:`tensorplay.report.aggregate.Run.end_waits` derives them.
"""

from __future__ import annotations

from tensorplay.analysis.straggler import Verdict, straggler_verdict

from .aggregate import Run

__all__ = ["run_verdict"]


def run_verdict(run: Run) -> Verdict:
    """Which ranks straggle in ``run``, with the evidence in words."""
    return straggler_verdict(run.end_waits())
