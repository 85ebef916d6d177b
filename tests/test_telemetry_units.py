"""Telemetry parts that need no ranks: span life, the finisher's thread, where callbacks run, the
in-flight gauge, figures (the CUDA path exercised with stand-in events on CPU), and
configure_tracing's set-up rules."""

import os
import threading
import time
import types
from typing import Any

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.util._once import Once
from prometheus_client import CollectorRegistry

from tensorplay.telemetry import TensorplayMetrics, configure_tracing
from tensorplay.telemetry import compression_figures as figures
from tensorplay.telemetry.finish import Finisher, OwnedSpan, _events_happened
from tensorplay.telemetry.names import Candidate
from tensorplay.telemetry.outcome import observe, outcome
from tensorplay.telemetry.recorder import BucketLayout, BucketRecord, CompressionStage
from tensorplay.telemetry.timing import Stamp, happened, seconds_between, unix_ns

from .sink import MemorySink, memory_sink


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


class FakeDevice:
    """Stands in for a CUDA device's stream: stamps carry a FakeEvent each, copies to the host are
    queued, and both happen when the device runs. Once ``hung`` (a collective that never completes
    was queued after them), nothing more ever does: reading device memory would wait for good."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []
        self.copies: list[Any] = []
        self.hung = False

    def stamp(self, device: Any = None) -> Stamp:
        event = FakeEvent(float(len(self.events)))
        self.events.append(event)
        return Stamp(time.time_ns(), time.perf_counter_ns(), event)

    def run(self) -> None:
        """Everything queued so far happens: the copies, then the events."""
        while self.copies:
            self.copies.pop(0)()
        for event in self.events:
            event.done = True

    def memory(self) -> type:
        """A tensor class whose instances live in this device's memory (their values are real)."""
        device = self

        class OnDevice(torch.Tensor):
            @property
            def is_cuda(self) -> bool:
                return True

            def item(self) -> Any:  # a read in place: a copy on the stream, then waiting for it
                if device.hung:
                    raise AssertionError("a figure was read on the device: that waits for the hung stream")
                return self.as_subclass(torch.Tensor).item()

            def to(self, *args: Any, **kwargs: Any) -> Any:
                if args == ("cpu",) and kwargs == {"non_blocking": True}:  # lands in host memory when the device runs
                    host, value = torch.empty(self.shape, dtype=self.dtype), self.as_subclass(torch.Tensor).clone()
                    device.copies.append(lambda: host.copy_(value))
                    return host
                return super().to(*args, **kwargs)

        return OnDevice


def _record(metrics: TensorplayMetrics | None = None, span: OwnedSpan | None = None) -> BucketRecord:
    tracer = memory_sink().provider.get_tracer("test")
    return BucketRecord(
        hook="fp16_compress_hook",
        reports_collectives=True,
        step=0,
        rank=0,
        world_size=2,
        bucket_index=0,
        layout=BucketLayout(torch.zeros(8)),
        sample_error=True,
        span=span if span is not None else OwnedSpan(tracer.start_span("tensorplay.comm_hook")),
        metrics=metrics,
        previous_step_end=None,
        step_start=None,
    )


# --- spans ---------------------------------------------------------------------------------------


def test_an_owned_span_ends_once_with_the_error(sink: MemorySink) -> None:
    span = OwnedSpan(sink.provider.get_tracer("test").start_span("s"))
    span.end({"a": 1}, error=ValueError("boom"))
    span.end({"a": 2})
    span.end(incomplete="again")
    (finished,) = sink.finished()
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


def test_the_finisher_queue_is_bounded_and_a_drop_is_no_longer_pending() -> None:
    finisher = Finisher(capacity=2)
    stuck = _BlockingSpan()
    finisher.abandoned(stuck)  # type: ignore[arg-type]
    assert stuck.entered.wait(10)  # the thread took it: the queue is empty again
    for _ in range(3):
        finisher.abandoned(stuck)  # type: ignore[arg-type]
    assert finisher.waiting() == 2 and finisher.pending() == 3  # the third was dropped, not queued
    assert not finisher.flush(0.05)
    stuck.release.set()
    assert finisher.flush(10) and stuck.ended == 3


def test_a_join_span_is_ended_on_the_finisher_thread_and_flushed(sink: MemorySink) -> None:
    finisher = Finisher()
    ended_on: list[str] = []
    span = sink.provider.get_tracer("test").start_span("tensorplay.join")
    original_end = span.end
    span.end = lambda **kwargs: (ended_on.append(threading.current_thread().name), original_end(**kwargs))  # type: ignore[method-assign]
    finisher.end_span(OwnedSpan(span), {"a": 1}, end_time=span.start_time + 5)  # type: ignore[operator]
    assert finisher.flush(10)
    (finished,) = sink.finished()
    assert ended_on == ["tensorplay-finisher"] and finished.attributes["a"] == 1
    assert finished.end_time == finished.start_time + 5


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
    numbers = outcome(record)
    assert numbers.relative_error is None and numbers.nonfinite == 16
    observe(record, numbers)
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


class _FakeGroup:
    def size(self) -> int:
        return 1


class _Work:
    """A collective's work whose future completes at once (the one-rank case) or when told."""

    def __init__(self, tensor: torch.Tensor, done: bool) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self.result = [tensor]
        if done:
            self.future.set_result(self.result)

    def get_future(self) -> torch.futures.Future:
        return self.future


@pytest.mark.parametrize("already_done", [True, False], ids=["completed at launch", "completed later"])
def test_callbacks_run_where_torch_runs_them(monkeypatch: pytest.MonkeyPatch, already_done: bool) -> None:
    """The hook's decompression and the user's callbacks run on the thread that completes the collective.

    Completed at launch: inline, on the calling thread, as torch runs them; later: on the thread
    that completes it. Never on tensorplay's thread.
    """
    import types

    from tensorplay.distributed.algorithms.ddp_comm_hooks import _common, default_hooks
    from tensorplay.telemetry.probe import install_recorder, uninstall_recorder

    works: list[_Work] = []

    def all_reduce(tensor: torch.Tensor, group: Any = None, async_op: bool = True) -> _Work:
        works.append(_Work(tensor, already_done))
        return works[-1]

    monkeypatch.setattr(
        _common, "dist", types.SimpleNamespace(all_reduce=all_reduce, group=types.SimpleNamespace(WORLD=_FakeGroup()))
    )
    monkeypatch.setattr(default_hooks.dist, "ProcessGroup", _FakeGroup, raising=False)
    buffer = torch.randn(1000)
    expected = buffer.to(torch.float16).to(torch.float32)
    expected_error = float((buffer - expected).norm() / buffer.norm())
    record = _record(TensorplayMetrics(CollectorRegistry()))
    record.sample_error = True
    handed: list[str] = []
    token = install_recorder(record)
    try:
        future = default_hooks.fp16_compress_hook(None, (buffer,))  # type: ignore[arg-type]
    finally:
        uninstall_recorder(token)
    followed = record.follow(future, None, lambda r: handed.append(threading.current_thread().name))
    seen: list[str] = []
    result = followed.then(lambda done: (seen.append(threading.current_thread().name), done.value())[1])
    if not already_done:
        completer = threading.Thread(target=lambda: works[0].future.set_result(works[0].result), name="collective")
        completer.start()
        completer.join()
    where = threading.current_thread().name if already_done else "collective"
    assert torch.equal(result.wait(), expected)
    assert seen == handed == [where]
    (stage,) = record.stages
    assert stage.relative_error == pytest.approx(expected_error, rel=1e-6)


def test_a_cast_to_the_buckets_own_dtype_is_counted_before_the_collective() -> None:
    """A float16 bucket under fp16 compression is DDP's buffer itself: counted now, error 0."""
    record = _record()
    record.sample_error = True
    bucket = torch.ones(64, dtype=torch.float16)
    bucket[:3] = float("nan")
    record.compression("float16", bucket, bucket.to(torch.float16), scale=2, recomputable=True)
    bucket.fill_(float("nan"))  # the collective's sum over ranks overwrites it
    (stage,) = record.stages
    assert (stage.relative_error, stage.nonfinite, stage.input_nonfinite) == (None, 0, 3)
    clean = torch.ones(64, dtype=torch.bfloat16)
    record.compression("bfloat16", clean, clean.to(torch.bfloat16), recomputable=True)
    assert (record.stages[1].relative_error, record.stages[1].nonfinite, record.stages[1].input_nonfinite) == (0.0, 0, 0)


def test_a_forked_child_finishes_on_a_thread_of_its_own() -> None:
    """The parent's finisher thread does not survive a fork: the child must start its own."""
    from tensorplay.telemetry.finish import finisher

    tracer = memory_sink().provider.get_tracer("test")
    finisher().abandoned(OwnedSpan(tracer.start_span("parent")))
    assert finisher().flush(10)  # the parent's thread runs
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its span was ended
        status = 1
        try:
            finisher().abandoned(OwnedSpan(tracer.start_span("child")))
            status = 0 if finisher().flush(5) else 1
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's span never ended"


def test_a_cuda_record_is_finished_once_its_events_complete() -> None:
    metrics = TensorplayMetrics(CollectorRegistry())
    record = _record(metrics)
    record.device = torch.device("cuda")
    record.called = Stamp(0, 0, FakeEvent(0.0))
    record.ends.completed = Stamp(0, 0, FakeEvent(2.0))
    finisher = Finisher()
    finisher.completed(record)
    assert not finisher.flush(0.05) and finisher.waiting() == 1
    record.called.event.done = record.ends.completed.event.done = True
    assert finisher.flush(5) and finisher.waiting() == 0
    labels = {"rank": "0", "hook": "fp16_compress_hook"}
    assert metrics.registry.get_sample_value("tensorplay_bucket_bytes_total", labels) == 32


def test_cuda_figures_are_read_from_their_host_copies_never_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's branch on a fake device: a float16 bucket holding 3 NaN under float16 compression is
    counted at once. Then a collective queued after it hangs the stream: the record, whose events
    happened before, is still finished, from host copies of its figures (no read on the device)."""
    from tensorplay.telemetry import recorder as recorder_module

    device = FakeDevice()
    monkeypatch.setattr(recorder_module, "stamp", device.stamp)
    metrics = TensorplayMetrics(CollectorRegistry())
    record = _record(metrics)
    record.device, record.called = torch.device("cuda"), device.stamp()
    bucket = torch.ones(64, dtype=torch.float16)
    bucket[:3] = float("nan")
    bucket = bucket.as_subclass(device.memory())
    record.compression("float16", bucket, bucket, scale=2, recomputable=True)
    finisher = Finisher()
    hook_future: torch.futures.Future = torch.futures.Future()
    hook_future.set_result(bucket)
    record.follow(hook_future, None, finisher.completed)
    device.hung = True
    device.run()
    assert finisher.flush(10)
    labels = {"rank": "0", "hook": "fp16_compress_hook"}
    assert metrics.registry.get_sample_value("tensorplay_bucket_nonfinite_elements_total", labels) == 3
    assert metrics.registry.get_sample_value("tensorplay_allreduce_latency_seconds_count", labels) == 1


class _GatedProcessor(SpanProcessor):
    """An application's span processor that hangs in ``on_end`` (an export in line) until its gate opens."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.ended = 0

    def on_end(self, span: Any) -> None:
        self.entered.set()
        self.gate.wait(30)
        self.ended += 1


def _cuda_record_launched(metrics: TensorplayMetrics, device: FakeDevice, tracer: trace.Tracer, step: int) -> BucketRecord:
    """A CUDA record (events of ``device``) whose one collective was launched, on NCCL: its future completed at enqueue."""
    record = _record(metrics, OwnedSpan.later(tracer, "tensorplay.comm_hook", time.time_ns()))
    record.device, record.step, record.called = torch.device("cuda"), step, device.stamp()
    token = record.collective_launching(torch.zeros(8))
    launched: torch.futures.Future = torch.futures.Future()
    launched.set_result([torch.zeros(8)])
    record.collective_launched(token, launched)
    return record


def test_a_full_queue_drops_spans_never_a_cuda_records_metrics_or_its_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The span processor hangs while 20 CUDA records come in; the device keeps up. Spans beyond the
    queue's bound are dropped (counted); every record's metrics are written and its collective leaves
    the in-flight gauge, those the thread cannot take while it hangs finished where they are handed over."""
    from tensorplay.telemetry import recorder as recorder_module

    device = FakeDevice()
    monkeypatch.setattr(recorder_module, "stamp", device.stamp)
    metrics = TensorplayMetrics(CollectorRegistry())
    processor = _GatedProcessor()
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    finisher = Finisher(capacity=4)
    calls = 20

    def latency_observations() -> float:
        return metrics.registry.get_sample_value(
            "tensorplay_allreduce_latency_seconds_count", {"rank": "0", "hook": "fp16_compress_hook"}
        ) or 0.0

    for step in range(calls):
        record = _cuda_record_launched(metrics, device, tracer, step)
        hook_future: torch.futures.Future = torch.futures.Future()
        hook_future.set_result(torch.zeros(8))
        record.follow(hook_future, None, finisher.completed)
        del record
        device.run()
        if step == 0:
            assert processor.entered.wait(10)  # the thread hangs in the first span's end
    observed_while_hanging = latency_observations()
    processor.gate.set()
    assert finisher.flush(10)
    dropped = metrics.registry.get_sample_value("tensorplay_telemetry_errors_total", {"rank": "0", "reason": "span_dropped"})
    assert latency_observations() == calls
    assert metrics.collectives_in_flight.in_flight("0") == 0
    assert dropped and dropped + processor.ended == calls, (dropped, processor.ended)
    # While the thread hung, records beyond the bound (4) were finished where they were handed over.
    assert observed_while_hanging >= calls - (4 + 1), observed_while_hanging


@pytest.mark.parametrize("on_cuda", [True, False], ids=["cuda (fake device)", "cpu"])
def test_a_hook_that_raises_after_launching_leaves_no_collective_in_flight(monkeypatch: pytest.MonkeyPatch, on_cuda: bool) -> None:
    """A hook launches a collective, then raises. On CUDA (events of a fake device) its future
    completed at enqueue; on CPU it completes later. Either way the collective stays in flight until
    it is done, then leaves the gauge; the record is finished and its span carries the error."""
    import importlib

    import torch.distributed as dist

    from tensorplay.telemetry import finish, model_identity, probe, recorder as recorder_module

    traced_module = importlib.import_module("tensorplay.telemetry.traced")  # the package's ``traced`` is the function

    class CudaLayout(BucketLayout):
        def __init__(self, buffer: torch.Tensor) -> None:
            super().__init__(buffer)
            self.device = torch.device("cuda")

    device = FakeDevice()
    if on_cuda:
        monkeypatch.setattr(recorder_module, "stamp", device.stamp)
        monkeypatch.setattr(traced_module, "stamp", device.stamp)
        monkeypatch.setattr(model_identity, "BucketLayout", CudaLayout)
    monkeypatch.setattr(
        traced_module, "dist", types.SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda: 1, ProcessGroup=dist.ProcessGroup)
    )
    monkeypatch.setattr(finish, "_finisher", Finisher())
    launched: torch.futures.Future = torch.futures.Future()

    def launching_then_failing(state: Any, bucket: Any) -> torch.futures.Future:
        recorder = probe.current_recorder()
        recorder.collective_launched(recorder.collective_launching(bucket.buffer()), launched)
        if on_cuda:
            launched.set_result([bucket.buffer()])  # NCCL: complete at enqueue
        raise RuntimeError("the hook failed after launching")

    probe.describe_hook(launching_then_failing, "launching_then_failing")
    sink = memory_sink()
    hook = sink.traced(launching_then_failing)
    bucket = _Bucket(torch.zeros(4), [torch.zeros(2)])
    with pytest.raises(RuntimeError, match="failed after launching"):
        hook(None, bucket)
    assert not finish.finisher().flush(0.05)
    assert sink.metrics.collectives_in_flight.in_flight("0") == 1  # not done yet
    if on_cuda:
        device.run()
    else:
        launched.set_result([bucket.buffer()])
    assert finish.finisher().flush(10)
    assert sink.metrics.collectives_in_flight.in_flight("0") == 0
    (span,) = sink.finished()
    assert span.status.status_code == trace.StatusCode.ERROR and "failed after launching" in span.status.description
    assert sink.sample("tensorplay_allreduce_latency_seconds_count", rank="0", hook="launching_then_failing") == 1


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
        assert _eventually(lambda: server.scrapes.seen() == 2)
        assert wait_for_final_scrape(timeout_s=0.2) is False  # no scrape came in time
        later = threading.Timer(0.3, scrape, kwargs={"prometheus": True})
        later.start()
        assert wait_for_final_scrape() is True  # the next one read the final values
        later.join()
    finally:
        server.close()


def test_a_scraper_whose_second_scrape_is_unfinished_still_bounds_the_final_wait_by_its_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a loaded host: Prometheus holds a slow scraper's second scrape before the rank noted it
    sent, and the fast scraper stalled; the wait is still 1.5 slow intervals and a second, not a
    minute (issue 25: a job's exit took 60 s with one replica gone)."""
    from tensorplay.telemetry import server as server_module

    now = [0.0]
    monkeypatch.setattr(server_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    scrapes = server_module.ScrapeLog()

    def scrape(scraper: tuple[str, ...], at: float, completes: bool = True) -> None:
        now[0] = at
        started = scrapes.started(scraper)
        if completes:
            scrapes.completed(started)

    fast, slow = ("127.0.0.1", "Prometheus/3", "1"), ("127.0.0.1", "Prometheus/3", "3")
    for at in (0.0, 1.0, 2.0):
        scrape(fast, at)
    scrape(slow, 0.5)
    scrape(slow, 3.5, completes=False)
    now[0] = 5.6  # the fast one last started 3.6 s ago: over 2 of its intervals and a second
    assert scrapes.final_wait_s() == 1.5 * 3 + 1
    assert scrapes.wait_for_next(timeout_s=0.01) is False  # the slow one is waited for
    now[0] = 2.0 + 60.1  # a minute on, neither is scraping: nobody to wait for
    assert scrapes.final_wait_s() is None and scrapes.wait_for_next() is False


def _one_rank_exposition(metrics: TensorplayMetrics, hooks: tuple[str, ...]) -> list[str]:
    """Every family of ``metrics`` given a child for rank 0 (and each hook), as served: sample lines."""
    from prometheus_client.openmetrics.exposition import generate_latest

    for hook in hooks:
        labels = {"rank": "0", "hook": hook}
        metrics.allreduce_latency.labels(**labels).observe(0.01)
        metrics.compression_error.labels(**labels).observe(0.001)
        for counter in (metrics.bucket_bytes, metrics.wire_bytes, metrics.nonfinite, metrics.bucket_nonfinite,
                        metrics.step_wait, metrics.step_seconds, metrics.steps, metrics.step_busy,
                        metrics.step_exposed_communication, metrics.step_communication):
            counter.labels(**labels).inc()
        for gauge in (metrics.candidate_error, metrics.candidate_wire, metrics.candidate_nonfinite):
            for candidate in Candidate.ALL:
                gauge.labels(**labels, candidate=candidate).set(0.5)
    metrics.step_compute.labels(rank="0").observe(0.2)
    metrics.join_wait.labels(rank="0").observe(1.0)
    for gauge in (metrics.last_step_timestamp, metrics.collective_waiting_since, metrics.join_timestamp,
                  metrics.join_shadow_iterations, metrics.join_last_joiner):
        gauge.labels(rank="0").set(1)
    metrics.joins.labels(rank="0").inc()
    for counter in (metrics.optimizer_steps, metrics.gradient_reductions, metrics.unreduced_optimizer_steps):
        counter.labels(rank="0").inc()
    metrics.replica_fingerprints.set("0", 100, 2**53 - 1)
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_exposition_has_no_created_series_and_stays_within_the_series_budget() -> None:
    one_hook = _one_rank_exposition(TensorplayMetrics(CollectorRegistry()), ("fp16_compress_hook",))
    two_hooks = _one_rank_exposition(TensorplayMetrics(CollectorRegistry()), ("fp16_compress_hook", "allreduce_hook"))
    assert not [line for line in one_hook + two_hooks if "_created" in line]
    per_hook = len(two_hooks) - len(one_hook)
    per_rank = len(one_hook) - per_hook
    assert per_hook > 0 and per_rank > 0
    assert len(one_hook) <= 105  # docs/telemetry.md, "Series budget"
    assert (per_hook, per_rank) == (59, 43)  # the figures that table gives


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


def test_disabling_metrics_takes_them_out_of_the_applications_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The application serves its own registry; tensorplay's families leave it when metrics are
    turned off (they used to stay, served frozen, and enabling again raised Duplicated timeseries)."""
    from prometheus_client import Counter, generate_latest

    from tensorplay.telemetry import active_metrics, disable_metrics, enable_metrics, metrics as metrics_module

    monkeypatch.delenv("TENSORPLAY_METRICS_PORT", raising=False)
    disable_metrics()
    shared = CollectorRegistry()
    Counter("app_batches", "the application's own counter", registry=shared).inc()
    try:
        enable_metrics(registry=shared, serve=False).joins.labels(rank="0").inc()
        assert shared.get_sample_value("tensorplay_joins_total", {"rank": "0"}) == 1
        disable_metrics()
        served = generate_latest(shared).decode()
        assert "tensorplay_" not in served and "app_batches_total 1.0" in served
        monkeypatch.setattr(metrics_module, "_env_checked", True)  # off stays off: no environment to read
        assert active_metrics() is None
        again = enable_metrics(registry=shared, serve=False)  # no Duplicated timeseries
        assert shared.get_sample_value("tensorplay_joins_total", {"rank": "0"}) is None  # fresh counts
        again.joins.labels(rank="0").inc()
        assert shared.get_sample_value("tensorplay_joins_total", {"rank": "0"}) == 1
    finally:
        disable_metrics()
    assert "tensorplay_" not in generate_latest(shared).decode()


# --- a slow span processor, told apart from a busy machine ---------------------------------------


class _SlowSpan:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def end(self, *args: Any) -> None:
        time.sleep(self.seconds)


def test_only_a_slow_span_processor_is_called_slow(caplog: pytest.LogCaptureFixture) -> None:
    from tensorplay.telemetry import finish

    caplog.set_level("DEBUG", logger="tensorplay.telemetry.finish")
    finisher = Finisher()
    for span in (_SlowSpan(0.0), _SlowSpan(finish.SLOW_END_S), _SlowSpan(finish.SLOW_END_S)):
        finisher.abandoned(span)  # type: ignore[arg-type]
    assert finisher.flush(10)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "rank 0: the span processor is slow: ending one span took" in warned[0]


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


# --- which model a bucket is from ----------------------------------------------------------------


class _Bucket:
    """A GradBucket's face for ModelsOfHook: a buffer, an index, the parameters it reduces."""

    def __init__(self, buffer: torch.Tensor, parameters: list[torch.Tensor], index: int = 0, last: bool = True) -> None:
        self._buffer, self._parameters, self._index, self._last = buffer, parameters, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def test_a_buffer_is_known_only_while_it_lives_and_never_by_a_reused_id() -> None:
    """Buffers that die (freed models, DDP's bucket rebuild) leave no entry behind, and a new tensor
    that happens to get a dead buffer's ``id`` is placed afresh, not taken for the dead one's bucket."""
    from tensorplay.telemetry.model_identity import ModelsOfHook

    models = ModelsOfHook()
    parameter = torch.zeros(2)
    for _ in range(1000):  # one-shot buffers: a model's first iteration, then a rebuild, over and over
        place = models.enter(_Bucket(torch.zeros(4), [parameter]))
        assert place.bucket.layout.numel == 4
    assert len(models._by_buffer) <= 1  # only a buffer still referenced (none, once the loop's is gone)

    kept = torch.zeros(4)
    first = models.enter(_Bucket(kept, [parameter]))
    stale = models._by_buffer[id(kept)]
    stranger = torch.zeros(8)
    models._by_buffer[id(stranger)] = stale  # as if ``stranger`` had reused a dead buffer's id
    place = models.enter(_Bucket(stranger, [torch.zeros(2)], index=0))
    assert place.bucket is not stale and place.bucket.layout.numel == 8 and place.model is not first.model


def _model_of_each_call(models: Any, calls: list[tuple[Any, "_Bucket"]]) -> list[int]:
    """Enter each bucket on its thread (an executor of one thread), in this order; the model of each call."""
    return [executor.submit(lambda b=bucket: models.enter(b).model.index).result() for executor, bucket in calls]


def test_two_models_in_their_first_iteration_on_two_threads_keep_their_buckets() -> None:
    """Two threads each train a model; the second model's bucket 1 comes while the first model also
    expects its bucket 1 (its thread is between buckets 0 and 1): it is the second model's."""
    from concurrent.futures import ThreadPoolExecutor

    from tensorplay.telemetry.model_identity import ModelsOfHook

    def buckets() -> list[_Bucket]:
        return [_Bucket(torch.zeros(4), [torch.zeros(2)], index=i, last=i == 2) for i in range(3)]

    a, b = buckets(), buckets()
    with ThreadPoolExecutor(1) as first, ThreadPoolExecutor(1) as second:
        order = [(first, a[0]), (second, b[0]), (second, b[1]), (first, a[1]), (second, b[2]), (first, a[2])]
        models = ModelsOfHook()
        placed = _model_of_each_call(models, order)
        again = _model_of_each_call(models, order)  # the next iteration: known buffers
    assert placed == again == [0, 1, 1, 0, 1, 0]


@pytest.mark.parametrize("first_to_rebuild", [0, 1])
def test_a_rebuilt_bucket_of_shared_parameters_stays_with_its_model(first_to_rebuild: int) -> None:
    """Two models share a layer; after DDP's rebuild, bucket 0 of each holds only that layer's
    parameters, which both models reduced: each rebuilt bucket stays with its own model."""
    from tensorplay.telemetry.model_identity import ModelsOfHook

    models = ModelsOfHook()
    shared = torch.zeros(2)
    own = [torch.zeros(2), torch.zeros(2)]
    first_iteration = [_Bucket(torch.zeros(4), [own[m], shared]) for m in range(2)]  # one bucket each
    assert [models.enter(bucket).model.index for bucket in first_iteration] == [0, 1]
    placed: dict[int, list[int]] = {}
    rebuilt: dict[int, list[_Bucket]] = {}  # the models' new buffers live on (DDP holds them)
    for m in (first_to_rebuild, 1 - first_to_rebuild):
        first_iteration[m] = None  # type: ignore[call-overload]  # the rebuild frees the old buffer
        rebuilt[m] = [_Bucket(torch.zeros(2), [shared], index=0, last=False), _Bucket(torch.zeros(2), [own[m]], index=1)]
        placed[m] = [models.enter(bucket).model.index for bucket in (*rebuilt[m], *rebuilt[m])]
    assert placed == {0: [0, 0, 0, 0], 1: [1, 1, 1, 1]}
