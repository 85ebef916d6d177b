"""``tensorplay report``: a run's spans as one self-contained HTML page of figures.

It reads the JSON-lines span files a run leaves (``tensorplay demo``'s run directory, or any job
with ``configure_tracing(span_file='spans-rank{rank}.jsonl')``) and draws, per rank and step: compute time, busy
time and exposed communication, allreduce latency heatmaps, bytes per hook, compression error and
non-finite counts, the compression advice's candidates, Join timing, and the straggler verdict,
communication sentence and per-rank table of the demo's. Every figure comes from :mod:`tensorplay.analysis`
(which reads the spans and derives them, for the demo too); here :mod:`.plots` draws (matplotlib,
the ``report`` extra), :mod:`.page` writes the HTML, :mod:`.build` puts them together and
:mod:`.cli` is the command.
"""


import importlib
from typing import Any

_HOME = {name: f"{__name__}.build" for name in ("build_report", "render_html", "write_report", "default_output",
                                                 "Report", "ReportUnavailable", "INSTALL_HINT")} \
    | {"NoSpans": "tensorplay.analysis.span_reader"}
"""The module each public name lives in, loaded on first use (:pep:`562`): importing the package
loads neither matplotlib nor the telemetry."""

__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
