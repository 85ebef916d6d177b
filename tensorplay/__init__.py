"""tensorplay: PyTorch DDP communication hooks and Join, observable through OpenTelemetry and Prometheus.

Importing the package loads nothing else: ``tensorplay.traced`` is resolved on first use
(:pep:`562`), so ``tensorplay.analysis`` and ``tensorplay.report`` come without torch or the
telemetry, and the version is the installed distribution's (written once, in ``pyproject.toml``).
"""

from importlib import metadata
from typing import Any

try:
    __version__ = metadata.version("tensorplay")
except metadata.PackageNotFoundError:  # a source tree put on sys.path without being installed
    __version__ = "0+unknown"

__all__ = ["__version__", "traced"]


def __getattr__(name: str) -> Any:
    """Resolve ``traced`` from :mod:`tensorplay.telemetry` the first time it is asked for."""
    if name == "traced":
        from tensorplay.telemetry import traced

        return traced
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
