"""Turns what the algorithms report into OpenTelemetry spans and Prometheus metrics.

Public entry points: :func:`traced`, :func:`enable_metrics` / :func:`disable_metrics`,
:func:`configure_tracing` (with :class:`SystemRandomIdGenerator`), :func:`flush` and :func:`wait_for_final_scrape`.

Each is loaded on first use (:pep:`562`): the algorithms import :mod:`.probe` through this
package and must get the probe alone, without the OpenTelemetry SDK or prometheus_client, and
without Join's exporter listening (``Join`` then reads no clock at all). Reaching for any of
the names above is using the telemetry, and turns on the export of every ``Join``'s timing
(:func:`.join_telemetry.listen`), whoever configured the SDK.
"""

import importlib
import sys
import types
from typing import Any

_HOME = {
    "traced": "traced",
    "DEFAULT_ERROR_EVERY": "traced",
    "DEFAULT_ADVISE_EVERY": "traced",
    "TensorplayMetrics": "metrics",
    "enable_metrics": "metrics",
    "disable_metrics": "metrics",
    "active_metrics": "metrics",
    "served_address": "metrics",
    "wait_for_final_scrape": "metrics",
    "configure_tracing": "tracing",
    "SystemRandomIdGenerator": "tracing",
    "flush": "finish",
}
"""The submodule each public name lives in."""

__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    """Load the submodule that defines the public ``name``, and have Join's timing exported."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .join_telemetry import listen

    listen()
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package, keeping its function ``traced`` when the submodule of that name is imported.

    The import system names every loaded submodule on its package (``setattr``): after an import
    of ``tensorplay.telemetry.traced`` (``from tensorplay.telemetry.traced import Hook``),
    ``tensorplay.telemetry.traced`` would be that module, not the function. A submodule that
    shares a public name is therefore not set, and the name still resolves to the function.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOME and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
