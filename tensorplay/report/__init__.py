"""``tensorplay report``: a run's spans as one self-contained HTML page of figures.

It reads the JSON-lines span files a run leaves (``tensorplay demo``'s run directory, or any job
with ``configure_tracing(span_file=...)``) and draws, per rank and step: compute time, allreduce
latency heatmaps, bytes per hook, compression error and non-finite counts, Join timing, and the
straggler verdict and per-rank table of the demo's. Every figure comes from :mod:`tensorplay.analysis`
(which reads the spans and derives them, for the demo too); here :mod:`.plots` draws (matplotlib,
the ``report`` extra), :mod:`.page` writes the HTML, :mod:`.build` puts them together and
:mod:`.cli` is the command.
"""

from .build import INSTALL_HINT, Report, ReportUnavailable, build_report, default_output, render_html, write_report
from tensorplay.analysis.span_reader import NoSpans

__all__ = ["build_report", "render_html", "write_report", "default_output", "Report", "ReportUnavailable",
           "NoSpans", "INSTALL_HINT"]
