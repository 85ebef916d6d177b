"""Telemetry parts that need no ranks: span life, span ending, the in-flight gauge, figures on
the CUDA path (exercised with stand-in events on CPU), and configure_tracing's set-up rules."""

import os
import threading
import time
from typing import Any

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once
from prometheus_client import CollectorRegistry

from tensorplay.telemetry import TensorplayMetrics, configure_tracing
from tensorplay.telemetry import figures
from tensorplay.telemetry.device_events import EventWatcher
from tensorplay.telemetry.recorder import BucketRecord, CompressionStage
from tensorplay.telemetry.resolver import _events_happened, observe, resolve
from tensorplay.telemetry.spans import OwnedSpan, SpanEnd, SpanEnder
from tensorplay.telemetry.timing import Stamp, happened, seconds_between, unix_ns


class FakeEvent:
    """Stands in for a ``torch.cuda.Event``: completes when told, elapsed time from a device clock."""

    def __init__(self, device_ms: float) -> None:
        self.device_ms = device_ms
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, later: "FakeEvent") -> float:
        assert self.done and later.done, "elapsed_time on an event that has not completed"
        return later.device_ms - self.device_ms


def _tracer() -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def _record(metrics: TensorplayMetrics | None = None) -> BucketRecord:
    tracer, _ = _tracer()
    return BucketRecord(
        hook="fp16_compress_hook",
        reports_collectives=True,
        step=0,
        rank=0,
        world_size=2,
        bucket_index=0,
        buffer=torch.zeros(8),
        sample_error=True,
        span=OwnedSpan(tracer.start_span("tensorplay.comm_hook")),
        metrics=metrics,
        previous_step_end=None,
        step_start=None,
        on_collective_end=lambda end, action: action(),
    )


# --- spans ---------------------------------------------------------------------------------------


def test_an_owned_span_ends_once_with_the_error() -> None:
    tracer, exporter = _tracer()
    span = OwnedSpan(tracer.start_span("s"))
    span.end({"a": 1}, error=ValueError("boom"))
    span.end({"a": 2})
    span.end(incomplete="again")
    (finished,) = exporter.get_finished_spans()
    assert finished.attributes["a"] == 1
    assert finished.status.status_code == trace.StatusCode.ERROR and "boom" in finished.status.description
    assert [e.attributes["exception.message"] for e in finished.events] == ["boom"]


class _BlockingSpan:
    """A span whose end() hangs in its processor until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.ended = 0

    def end(self, *args: Any) -> None:
        self.entered.set()
        self.release.wait(10)
        self.ended += 1


def test_the_ender_queue_is_bounded_and_drops_are_counted() -> None:
    ender = SpanEnder(capacity=2)
    stuck = _BlockingSpan()
    dropped, finished = [], []
    ender.submit(SpanEnd(stuck, then=lambda: finished.append(0)))  # type: ignore[arg-type]
    assert stuck.entered.wait(10)
    accepted = [
        ender.submit(SpanEnd(stuck, then=lambda i=i: finished.append(i), dropped=lambda i=i: dropped.append(i)))  # type: ignore[arg-type]
        for i in (1, 2, 3)
    ]
    assert accepted == [True, True, False] and dropped == [3] and finished == [3]
    stuck.release.set()
    for _ in range(100):
        if len(finished) == 4:
            break
        threading.Event().wait(0.05)
    assert sorted(finished) == [0, 1, 2, 3] and stuck.ended == 3


class _NeverDone:
    def __init__(self) -> None:
        self.waits: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return False


def test_a_late_span_costs_one_budget_then_nobody_waits() -> None:
    ender = SpanEnder(budget_s=0.01)
    first, second, third = _NeverDone(), _NeverDone(), _NeverDone()
    for done in (first, second, third):
        ender.wait_briefly(SpanEnd(None, done=done))  # type: ignore[arg-type]
    assert first.waits == [0.01] and second.waits == [] and third.waits == []


# --- the in-flight gauge -------------------------------------------------------------------------


def test_waiting_since_follows_the_oldest_collective_in_flight() -> None:
    metrics = TensorplayMetrics(CollectorRegistry())
    in_flight = metrics.collectives_in_flight

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("tensorplay_collective_waiting_since_timestamp_seconds", {"rank": "3"})

    a = in_flight.launched("3", 100.0)
    b = in_flight.launched("3", 105.0)
    c = in_flight.launched("3", 107.0)
    assert gauge() == 100.0
    in_flight.completed("3", b)  # a younger one completing changes nothing
    assert gauge() == 100.0
    in_flight.completed("3", a)
    assert gauge() == 107.0
    in_flight.completed("3", c)
    assert gauge() == 0.0 and in_flight.in_flight("3") == 0
    in_flight.completed("3", c)  # twice: ignored
    assert gauge() == 0.0


# --- CUDA path rules with stand-in events ----------------------------------------------------------


def test_device_time_comes_from_events_not_the_enqueue_clock() -> None:
    origin = Stamp(unix_ns=1_000_000_000_000, monotonic_ns=0, event=FakeEvent(5.0))
    end = Stamp(unix_ns=1_000_000_000_001, monotonic_ns=1, event=FakeEvent(37.5))  # enqueued 1 ns later
    assert not happened(end)
    origin.event.done = end.event.done = True
    assert happened(end)
    assert seconds_between(origin, end) == pytest.approx(0.0325)
    assert unix_ns(end, origin) == 1_000_000_000_000 + 32_500_000
    cpu = Stamp(unix_ns=42, monotonic_ns=0)
    assert happened(cpu) and unix_ns(cpu, cpu) == 42


def test_a_record_waits_for_the_stream_its_figures_were_computed_on() -> None:
    record = _record()
    ready = Stamp(0, 0, FakeEvent(1.0))
    record.stages.append(CompressionStage("float16", torch.tensor(0.01), torch.tensor(0), torch.tensor(0), ready))
    assert not _events_happened(record)
    ready.event.done = True
    assert _events_happened(record)


def test_an_overflowed_cuda_figure_is_left_out_as_on_cpu() -> None:
    original = torch.full((16,), 1e6)
    approximation = original.to(torch.float16).div_(2)  # inf: float16 cannot hold 5e5
    error, created, already = figures._cuda_figures(original, approximation, 2.0, None, True)
    assert not torch.isfinite(error) and int(created) == 16 and int(already) == 0
    cpu_error, cpu_created, _ = figures.compression_figures(original, approximation, 2.0)
    assert cpu_error is None and cpu_created == 16
    assert figures.error_value(error) is None and figures.error_value(torch.tensor(float("nan"))) is None
    assert figures.error_value(torch.tensor(0.25)) == 0.25 and figures.error_value(None) is None

    metrics = TensorplayMetrics(CollectorRegistry())
    record = _record(metrics)
    record.stages.append(CompressionStage("float16", error, created, already, None))
    record.ends.completed = record.called
    outcome = resolve(record)
    assert outcome.relative_error is None and outcome.nonfinite == 16
    observe(record, outcome)
    labels = {"rank": "0", "hook": "fp16_compress_hook"}
    assert metrics.registry.get_sample_value("tensorplay_compression_error_ratio_sum", labels) is None
    assert metrics.registry.get_sample_value("tensorplay_nonfinite_elements_total", labels) == 16


def test_figures_recomputed_from_the_input_equal_those_of_the_compressed_tensor() -> None:
    """What the recorder takes after the collective equals what it took before, bit for bit.

    Cases: a healthy bucket, one whose float16 sum overflows although every element is finite
    (a non-finite sum is no proof of a non-finite element), and one holding NaN, inf and values
    that overflow when cast.
    """
    generator = torch.Generator().manual_seed(0)
    healthy = torch.randn(270_000, generator=generator)  # more than one slice of the error pass
    large = torch.full((20_000,), 60_000.0)
    poisoned = healthy[:20_000].clone()
    poisoned[:3], poisoned[3:5], poisoned[5:12] = float("nan"), float("inf"), -1e6
    for dtype in (torch.float16, torch.bfloat16):
        for original, scale in ((healthy, 2), (large, 1), (poisoned, 3), (poisoned * 1e33, 1)):
            approximation = original.to(dtype).div_(scale) if scale != 1 else original.to(dtype)
            expected = figures.compression_figures(original, approximation, scale)
            assert figures.cast_figures(original, dtype, scale, True, proven_finite=False) == expected
            finite = figures.all_finite(approximation)
            assert finite == bool(torch.isfinite(approximation).all())
            if finite:
                assert figures.cast_figures(original, dtype, scale, True, proven_finite=True) == expected
                assert figures.cast_figures(original, dtype, scale, False, proven_finite=True) == (None, 0, 0)
    assert not figures.all_finite(torch.tensor([1.0, float("nan")])) and figures.all_finite(large.half())


def test_a_completed_collectives_continuation_runs_off_the_training_thread() -> None:
    from tensorplay.telemetry.offthread import then_off_this_thread

    def where(done: torch.futures.Future) -> tuple[str, int]:
        return threading.current_thread().name, done.value() + 1

    completed: torch.futures.Future = torch.futures.Future()
    completed.set_result(1)
    assert then_off_this_thread(completed, where).wait() == ("tensorplay-continuations", 2)
    failed: torch.futures.Future = torch.futures.Future()
    failed.set_exception(ValueError("collective failed"))
    with pytest.raises(ValueError, match="collective failed"):
        then_off_this_thread(failed, where).wait()
    pending: torch.futures.Future = torch.futures.Future()
    chained = then_off_this_thread(pending, where)
    pending.set_result(5)  # a pending one continues where it completes, as then() does
    assert chained.wait() == (threading.current_thread().name, 6)


def test_a_forked_child_runs_completed_continuations_on_a_thread_of_its_own() -> None:
    """The parent's continuation thread does not survive a fork: the child must start its own."""
    from tensorplay.telemetry.offthread import then_off_this_thread

    completed: torch.futures.Future = torch.futures.Future()
    completed.set_result(1)
    assert then_off_this_thread(completed, lambda done: done.value()).wait() == 1  # the parent's thread runs
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its continuation ran
        status = 1
        try:
            chained = then_off_this_thread(completed, lambda done: done.value() + 1)
            deadline = time.monotonic() + 5
            while not chained.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            status = 0 if chained.done() and chained.value() == 2 else 1
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's continuation never ran"


def test_the_event_watcher_acts_once_events_complete() -> None:
    watcher = EventWatcher()
    event = FakeEvent(0.0)
    acted = threading.Event()
    watcher.when(lambda: event.query(), acted.set)
    assert not acted.wait(0.05) and watcher.waiting() == 1
    event.done = True
    assert acted.wait(5) and watcher.waiting() == 0


# --- configure_tracing ---------------------------------------------------------------------------


@pytest.fixture
def fresh_otel(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A process with no tracer provider set yet, and no OTEL_* service variables."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    providers: list[TracerProvider] = []
    yield providers
    for provider in providers:
        provider.shutdown()


@pytest.mark.parametrize(
    "environment, argument, expected",
    [
        ({}, None, "tensorplay"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes,team=ml"}, None, "from-attributes"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes", "OTEL_SERVICE_NAME": "from-name"}, None, "from-name"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes", "OTEL_SERVICE_NAME": "from-name"}, "arg", "arg"),
    ],
)
def test_service_name_follows_opentelemetry_precedence(
    fresh_otel: list, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, environment: dict, argument: str | None, expected: str
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    provider = configure_tracing(service_name=argument, otlp=False, span_file=str(tmp_path / "spans.jsonl"))
    fresh_otel.append(provider)
    assert provider.resource.attributes["service.name"] == expected
    if "team=ml" in environment.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert provider.resource.attributes["team"] == "ml"


def test_a_repeated_call_exports_each_span_once(fresh_otel: list, tmp_path: Any) -> None:
    first, other = tmp_path / "spans.jsonl", tmp_path / "other.jsonl"
    provider = configure_tracing(otlp=False, span_file=str(first))
    fresh_otel.append(provider)
    assert configure_tracing(otlp=False, span_file=str(first)) is provider
    assert configure_tracing(otlp=False, span_file=str(other)) is provider  # a new destination is added
    trace.get_tracer("test").start_span("one").end()
    provider.force_flush()
    assert len(first.read_text().splitlines()) == 1
    assert len(other.read_text().splitlines()) == 1


# --- the final scrape ----------------------------------------------------------------------------


def test_a_rank_waits_for_one_more_prometheus_scrape_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.request

    from tensorplay.telemetry import metrics as metrics_module, wait_for_final_scrape
    from tensorplay.telemetry.server import MetricsServer

    server = MetricsServer(TensorplayMetrics(CollectorRegistry()).registry, "127.0.0.1", 0)
    monkeypatch.setattr(metrics_module, "_server", server)
    url = "http://127.0.0.1:%d/metrics" % server.address[1]

    def scrape(prometheus: bool) -> None:
        headers = {"X-Prometheus-Scrape-Timeout-Seconds": "10"} if prometheus else {}
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).read()

    try:
        scrape(prometheus=False)  # a person's curl: nobody to wait for
        assert wait_for_final_scrape() is False
        scrape(prometheus=True)
        scrape(prometheus=True)
        # A scrape completes once the server has written its body, just after the client read it.
        assert _eventually(lambda: server.scrapes.interval_s() is not None)
        assert wait_for_final_scrape(timeout_s=0.2) is False  # no scrape came in time
        later = threading.Timer(0.3, scrape, kwargs={"prometheus": True})
        later.start()
        assert wait_for_final_scrape() is True  # the next one read the final values
        later.join()
    finally:
        server.close()


def _one_rank_exposition(metrics: TensorplayMetrics, hooks: tuple[str, ...]) -> list[str]:
    """Every family of ``metrics`` given a child for rank 0 (and each hook), as served: sample lines."""
    from prometheus_client.openmetrics.exposition import generate_latest

    for hook in hooks:
        labels = {"rank": "0", "hook": hook}
        metrics.allreduce_latency.labels(**labels).observe(0.01)
        metrics.compression_error.labels(**labels).observe(0.001)
        for counter in (metrics.bucket_bytes, metrics.wire_bytes, metrics.nonfinite, metrics.bucket_nonfinite,
                        metrics.step_wait, metrics.step_seconds, metrics.steps):
            counter.labels(**labels).inc()
    metrics.step_compute.labels(rank="0").observe(0.2)
    metrics.join_wait.labels(rank="0").observe(1.0)
    for gauge in (metrics.last_step_timestamp, metrics.collective_waiting_since, metrics.join_timestamp,
                  metrics.join_shadow_iterations, metrics.join_last_joiner):
        gauge.labels(rank="0").set(1)
    metrics.joins.labels(rank="0").inc()
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_exposition_has_no_created_series_and_stays_within_the_series_budget() -> None:
    one_hook = _one_rank_exposition(TensorplayMetrics(CollectorRegistry()), ("fp16_compress_hook",))
    two_hooks = _one_rank_exposition(TensorplayMetrics(CollectorRegistry()), ("fp16_compress_hook", "allreduce_hook"))
    assert not [line for line in one_hook + two_hooks if "_created" in line]
    per_hook = len(two_hooks) - len(one_hook)
    per_rank = len(one_hook) - per_hook
    assert per_hook > 0 and per_rank > 0
    assert len(one_hook) <= 100  # docs/telemetry.md, "Series budget"
    assert (per_hook, per_rank) == (41, 38)  # the figures that table gives


def test_an_applications_own_metrics_keep_their_created_series() -> None:
    from prometheus_client import Counter
    from prometheus_client.openmetrics.exposition import generate_latest

    shared = CollectorRegistry()
    Counter("app_batches", "the application's own counter", registry=shared).inc()
    metrics = TensorplayMetrics(shared)
    metrics.joins.labels(rank="0").inc()
    text = generate_latest(shared).decode()
    assert "app_batches_created" in text and "tensorplay_joins_total" in text
    assert "tensorplay_joins_created" not in text
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        TensorplayMetrics(shared)  # registering twice is still refused, as prometheus_client does


# --- a slow span processor, told apart from a busy machine ---------------------------------------


class _QuickSpan:
    def end(self, *args: Any) -> None:
        pass


def test_only_a_slow_span_processor_is_called_slow(caplog: pytest.LogCaptureFixture) -> None:
    from tensorplay.telemetry import spans

    caplog.set_level("DEBUG", logger="tensorplay.telemetry.spans")
    stuck = _BlockingSpan()
    ender = SpanEnder(budget_s=0.05)
    ender.submit(SpanEnd(stuck))  # type: ignore[arg-type]
    assert stuck.entered.wait(10)
    threading.Event().wait(spans.SLOW_END_S)  # the end() has been running this long
    waiting = SpanEnd(_QuickSpan())  # type: ignore[arg-type]
    ender.submit(waiting)
    ender.wait_briefly(waiting)
    stuck.release.set()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "rank 0: the span processor is slow: ending one span has taken" in warned[0]


def test_a_busy_machine_is_not_called_a_slow_span_processor(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level("DEBUG", logger="tensorplay.telemetry.spans")
    healthy = SpanEnder(budget_s=0.0)  # a waiter that gets no time at all
    monkeypatch.setattr(healthy, "_start", lambda: None)  # and an ender's thread that has not run yet
    for _ in range(3):
        job = SpanEnd(_QuickSpan())  # type: ignore[arg-type]
        healthy.submit(job)
        healthy._no_wait_until = 0.0  # wait each time, past the cool-down
        healthy.wait_briefly(job)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert healthy.late_waits == 3  # each run-out wait is counted, and logged at debug level
    assert sum("its processor is not slow" in r.getMessage() for r in caplog.records) == 3


# --- a collective whose launch raises -----------------------------------------------------------


def test_a_collective_that_fails_to_launch_is_not_left_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from tensorplay.distributed.algorithms.ddp_comm_hooks import _common

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("gloo: connection closed by peer")

    monkeypatch.setattr(_common, "dist", types.SimpleNamespace(all_reduce=refuse))
    metrics = TensorplayMetrics(CollectorRegistry())
    record = _record(metrics)
    with pytest.raises(RuntimeError, match="connection closed"):
        _common.allreduce_future(torch.ones(4), None, record)  # type: ignore[arg-type]
    assert metrics.collectives_in_flight.in_flight("0") == 0
    assert metrics.registry.get_sample_value("tensorplay_collective_waiting_since_timestamp_seconds", {"rank": "0"}) == 0
    assert isinstance(record.error, RuntimeError) and not record.failures


# --- the metrics endpoint: scrapes complete once sent, idle connections are closed --------------


def test_a_scrape_completes_only_once_its_body_is_sent() -> None:
    import socket

    from prometheus_client.core import GaugeMetricFamily

    from tensorplay.telemetry.server import MetricsServer

    class Big:
        def collect(self) -> Any:
            yield GaugeMetricFamily("big", "x" * 16_000_000, value=1)  # far more than socket buffers hold

    registry = CollectorRegistry()
    registry.register(Big())
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        client.connect(server.address)
        client.sendall(b"GET /metrics HTTP/1.0\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n")
        client.settimeout(10)
        received = len(client.recv(65536))  # the answer has begun
        threading.Event().wait(0.5)  # a slow reader: the server is still writing the body
        completed_before_read = server.scrapes.seen()
        while chunk := client.recv(1 << 20):
            received += len(chunk)
        client.close()
        completed_once_read = _eventually(lambda: server.scrapes.seen() == 1)
    finally:
        server.close()
    assert received > 16_000_000
    assert completed_before_read == 0
    assert completed_once_read


def _eventually(check: Any, timeout_s: float = 5.0) -> bool:
    pause = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return True
        pause.wait(0.05)
    return bool(check())


def test_an_idle_connection_is_closed_by_the_server(capfd: pytest.CaptureFixture) -> None:
    import socket
    import time

    from tensorplay.telemetry import server as server_module

    assert 10 <= server_module.REQUEST_TIMEOUT_S <= 30  # docs/telemetry.md
    server = server_module.MetricsServer(CollectorRegistry(), "127.0.0.1", 0, request_timeout_s=0.5)
    try:
        idle = socket.create_connection(server.address)
        idle.settimeout(10)
        started = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server: it sent nothing and will send nothing
        waited = time.monotonic() - started
        idle.close()
    finally:
        server.close()
    assert waited < 5
    assert "Traceback" not in capfd.readouterr().err  # a timed-out client is no news on stderr
