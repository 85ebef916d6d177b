"""Settings read from the environment, as OpenTelemetry reads its own: an empty variable is an unset one."""

from __future__ import annotations

import os

__all__ = ["steps_from_environment"]


def steps_from_environment(variable: str, default: int, meaning: str, unit: str = "steps") -> int:
    """``variable`` as a whole number of ``unit`` >= 0, or ``default`` when it is unset or empty.

    Anything else is a ``ValueError`` that names the variable, its value and what it accepts
    (``meaning``: what 0 and N stand for), raised where the setting is read, before training starts.
    """
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{variable}={os.environ[variable]!r} is not a number of {unit}: set it to a whole number >= 0 "
            f"({meaning}), or leave it unset or empty for the default, {default}"
        )
    return value
