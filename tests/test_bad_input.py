"""Bad settings get a clear message naming the setting and its value, and disturb nothing else.

``TENSORPLAY_ERROR_EVERY`` and ``TENSORPLAY_ADVISE_EVERY`` are read when a hook is traced: a value
that is no number of steps stops there with a ValueError (empty counts as unset, as OpenTelemetry
reads its variables).
A metrics port that is no port warns, is counted, and metrics go on being collected, unserved.
"""

import warnings
from typing import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.telemetry import (
    DEFAULT_ADVISE_EVERY,
    DEFAULT_ERROR_EVERY,
    active_metrics,
    disable_metrics,
    enable_metrics,
    served_address,
)
from tensorplay.telemetry import metrics as metrics_module

SAMPLINGS = {  # variable -> (its default, what the traced hook holds of it)
    "TENSORPLAY_ERROR_EVERY": (DEFAULT_ERROR_EVERY, lambda hook: hook._error_every),
    "TENSORPLAY_ADVISE_EVERY": (DEFAULT_ADVISE_EVERY, lambda hook: hook._advisor.every),
}


@pytest.mark.parametrize("variable", SAMPLINGS)
@pytest.mark.parametrize("value", ["abc", "2.5", "-3", "1e3"])
def test_a_bad_sampling_names_the_variable_and_the_value(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as raised:
        traced(default_hooks.allreduce_hook)
    message = str(raised.value)
    assert f"{variable}={value!r}" in message
    assert "whole number >= 0" in message and f"unset or empty for the default, {SAMPLINGS[variable][0]}" in message


@pytest.mark.parametrize("variable", SAMPLINGS)
@pytest.mark.parametrize("value, expected", [("", None), ("  ", None), (" 4 ", 4), ("0", 0)])
def test_an_empty_sampling_is_unset(monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: int | None) -> None:
    monkeypatch.setenv(variable, value)
    default, held = SAMPLINGS[variable]
    assert held(traced(default_hooks.allreduce_hook)) == (default if expected is None else expected)


def test_error_every_must_be_a_whole_number() -> None:
    with pytest.raises(TypeError, match="error_every must be a whole number of steps, got 2.5"):
        traced(default_hooks.allreduce_hook, error_every=2.5)  # type: ignore[arg-type]


@pytest.fixture
def metrics_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Metrics off before and after, and the environment read afresh."""
    disable_metrics()
    monkeypatch.setattr(metrics_module, "_env_checked", False)
    monkeypatch.delenv("TENSORPLAY_METRICS_PORT", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    yield
    disable_metrics()


def _count(reason: str) -> float | None:
    metrics = active_metrics()
    assert metrics is not None, "metrics must stay on, collected if not served"
    return metrics.registry.get_sample_value("tensorplay_telemetry_errors_total", {"rank": "0", "reason": reason})


@pytest.mark.parametrize(
    "port, environment, named",
    [
        (70000, {}, "port=70000 is not a port number"),
        (-1, {}, "port=-1 is not a port number"),
        (None, {"TENSORPLAY_METRICS_PORT": "99999"}, "TENSORPLAY_METRICS_PORT='99999' is not a port number"),
        (None, {"TENSORPLAY_METRICS_PORT": "abc"}, "TENSORPLAY_METRICS_PORT='abc' is not a port number"),
        (
            None,
            {"TENSORPLAY_METRICS_PORT": "65535", "LOCAL_RANK": "3"},
            "port 65538 (TENSORPLAY_METRICS_PORT='65535' + LOCAL_RANK=3) is above 65535",
        ),
        (None, {"TENSORPLAY_METRICS_PORT": "9400", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a whole number"),
    ],
)
def test_a_port_that_is_no_port_warns_and_metrics_go_on(
    metrics_off: None, monkeypatch: pytest.MonkeyPatch, port: int | None, environment: dict, named: str
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.warns(RuntimeWarning) as warned:
        if port is None:
            active_metrics()  # a traced hook's first call, under torchrun, does this
        else:
            enable_metrics(port=port, registry=CollectorRegistry())
    (warning,) = [w for w in warned if "tensorplay" in str(w.message)]
    assert named in str(warning.message) and "metrics are collected but not served" in str(warning.message)
    assert served_address() is None
    assert _count("metrics_port_invalid") == 1


def test_an_empty_port_variable_leaves_metrics_off(metrics_off: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORPLAY_METRICS_PORT", "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert active_metrics() is None
