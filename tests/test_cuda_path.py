"""The CUDA path: torch's gradients bit for bit, every span attribute, timing from CUDA events,
no host-device synchronization on the training thread, and nothing that grows over a long run.

Runs where a GPU and NCCL are present; elsewhere every test is skipped with that reason. One GPU
gives two configurations, each set up once for the tests that use it:

* ``nccl``: this process as the one rank of an NCCL group. NCCL refuses two ranks on one device,
  and at world size 1 it reduces nothing, so these tests cover what runs around the collectives:
  the hooks' arithmetic on CUDA, the telemetry's events and device figures, synchronization and
  memory.
* ``gloo_cuda``: two spawned gloo ranks sharing cuda:0. gloo reduces CUDA tensors (through the
  host), so communication is real: parity over two ranks, latency above zero.

The CPU suite's own comparisons run here unchanged: :func:`_training_on_cuda` has
tests/training.py build its model and batches on the GPU, so its ``train()`` runs there.
"""

import collections
import contextlib
import functools
import gc
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from opentelemetry.sdk.trace import SpanProcessor
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)
from tensorplay.telemetry import flush
from tensorplay.telemetry.advisor import pooled_error
from tensorplay.telemetry.candidate_figures import bucket_sums
from tensorplay.telemetry.names import ADVICE_SPAN_NAME, HOOK_SPAN_NAME, Attr, Candidate
from tensorplay.telemetry.finish import finisher

from . import parity_cases, traced_cases, training
from .ranks import free_port, run_ranks
from .sink import CountingExporter, MemorySink, memory_sink
from .waiting import wait_until

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA GPU and NCCL; the CPU path is covered by test_traced.py and test_powersgd.py",
)

SPAN_HOOKS = [*traced_cases.HOOKS, "user_hook"]
SLEEP_CYCLES = 20_000_000
"""Device clock cycles a hook keeps the GPU busy: at 3 GHz or less (any GPU's clock), 6.7 ms or more."""
SLEEP_MS_AT_LEAST = 5.0
EVENT_RESOLUTION_MS = 1e-3  # cudaEventElapsedTime resolves about half a microsecond
SOAK_STEPS = 1200
TELEMETRY_THREAD_PREFIX = "tensorplay-"  # tensorplay-finisher and tensorplay-advisor, tensorplay's own threads


@contextlib.contextmanager
def _training_on_cuda() -> Iterator[None]:
    """Have tests/training.py build its model and batches on cuda:0 (its ``train()`` then runs there)."""
    make_model, rank_batch = training.make_model, training.rank_batch
    training.make_model = lambda seed=0: make_model(seed).cuda()
    training.rank_batch = lambda rank, step, batch=8: rank_batch(rank, step, batch).cuda()
    try:
        yield
    finally:
        training.make_model, training.rank_batch = make_model, rank_batch


def _deterministic_cublas() -> None:
    """Fix cuBLAS's workspace, so it picks the same algorithms on the streams that hook callbacks run on.

    Must happen before the process's first matrix product (child ranks inherit it).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="module")
def nccl() -> Iterator[None]:
    """This process as rank 0 of an NCCL group of one, on cuda:0."""
    _deterministic_cublas()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, device_id=device
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fully_traced(hook: Callable) -> tuple[Callable, MemorySink]:
    """``hook`` traced with everything on (spans, metrics, the exact error at every step), and its sink."""
    sink = memory_sink()
    return sink.traced(hook, error_every=1), sink


# -- what a traced call measured: attributes, latency, span times ---------------------------------


def _assert_attributes(result: dict, name: str, rank: int, world_size: int) -> None:
    """Every contract attribute of every span of ``traced(name)`` is there with a plausible value."""
    compression = traced_cases.HOOKS.get(name, (None, None))[1]
    spans = result["spans"]
    assert len(spans) == len(result["bucket_numels"]), "one span per bucket of every step"
    assert sorted({span[Attr.STEP] for span in spans}) == [0, 1, 2]
    for span in spans:
        numel = result["bucket_numels"][(span[Attr.STEP], span[Attr.BUCKET_INDEX])]
        assert (span[Attr.HOOK], span[Attr.RANK], span[Attr.WORLD_SIZE]) == (name, rank, world_size)
        assert (span[Attr.BUCKET_NUMEL], span[Attr.BUCKET_BYTES], span[Attr.BUCKET_DTYPE]) == (numel, numel * 4, "float32")
        assert span[Attr.COMPRESSION_NONFINITE] == 0
        latency = span[Attr.ALLREDUCE_LATENCY_MS]
        if name == "noop_hook":
            assert (span[Attr.ALLREDUCE_COUNT], span[Attr.BUCKET_WIRE_BYTES], latency) == (0, 0, 0.0)
            continue
        assert span[Attr.ALLREDUCE_COUNT] == 1
        assert span[Attr.BUCKET_WIRE_BYTES] == numel * (2 if compression else 4)
        # At world size 1 NCCL has nothing to do: the interval may be below the timer's resolution.
        assert (latency > 0 if world_size > 1 else latency >= 0) and latency < 10_000
        if compression:
            assert (span[Attr.COMPRESSION_DTYPE], span[Attr.BUCKET_NONFINITE]) == (compression, 0)
        else:
            assert Attr.COMPRESSION_DTYPE not in span and Attr.COMPRESSION_RELATIVE_ERROR not in span
    # The figure from the device (float32) against a float64 computation from the bucket's copy.
    assert len(result["errors"]) == (len(spans) if compression else 0)
    for measured, expected in result["errors"]:
        assert measured == pytest.approx(expected, rel=1e-4) and 0 < measured < 0.05


def _sleep_then_reduce(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user's hook that keeps the GPU busy before it reduces: its latency can only be device time."""
    torch.cuda._sleep(SLEEP_CYCLES)
    return traced_cases.user_hook(state, bucket)


def _span_timings(rank: int, hook: Callable, steps: int = 2) -> list[tuple[float, float]]:
    """(latency ms, span duration ms) of every span of ``traced(hook)`` over a short training."""
    sink = memory_sink()
    with _training_on_cuda():
        training.train(rank, traced(hook, tracer_provider=sink.provider), steps=steps)
    assert flush(60), "records still pending"
    spans = [span for span in sink.finished() if span.name == HOOK_SPAN_NAME]
    assert spans
    return [(span.attributes[Attr.ALLREDUCE_LATENCY_MS], (span.end_time - span.start_time) / 1e6) for span in spans]


def _assert_within_spans(timings: list[tuple[float, float]]) -> None:
    for latency, duration in timings:
        assert duration >= latency - EVENT_RESOLUTION_MS, (latency, duration)


# -- NCCL, world size 1, in this process -----------------------------------------------------------


def test_default_hooks_equal_torch_bit_for_bit_on_cuda(nccl: None) -> None:
    with _training_on_cuda():
        report = parity_cases.compare_default_hooks(0, 1)
    assert report.pop("buckets") >= 3, "the model must span several buckets"
    assert not [name for name, equal in report.items() if not equal], report


def test_powersgd_hooks_equal_torch_bit_for_bit_on_cuda(nccl: None) -> None:
    layer_hooks = (powerSGD_hook, torch_powersgd.powerSGD_hook)
    batched_hooks = (batched_powerSGD_hook, torch_powersgd.batched_powerSGD_hook)
    with _training_on_cuda():
        report = parity_cases.compare_powersgd(0, 1, False)
        for wrapper in ("fp16 wrapper", "bf16 wrapper"):
            case = parity_cases.LAYER_CASES[wrapper]
            report[f"powerSGD_hook: {wrapper}"] = parity_cases.compare_case(0, layer_hooks, case, jitter=False)
        with parity_cases.batched_orthogonalization():
            case = parity_cases.BATCHED_CASES["fp16 wrapper"]
            report["batched_powerSGD_hook: fp16 wrapper"] = parity_cases.compare_case(0, batched_hooks, case, jitter=False)
    assert report.pop("buckets") >= 3, "the model must span several buckets"
    assert not [name for name, equal in report.items() if not equal], report


@pytest.fixture(scope="module")
def nccl_spans(nccl: None) -> dict:
    with _training_on_cuda():
        return traced_cases.spans_and_metrics(0, 1)


@pytest.mark.parametrize("name", SPAN_HOOKS)
def test_every_attribute_and_metric_on_cuda(nccl_spans: dict, name: str) -> None:
    _assert_attributes(nccl_spans[name], name, rank=0, world_size=1)
    traced_cases.check_gradients_equal_untraced([nccl_spans], name)
    traced_cases.check_metrics_agree_with_spans([nccl_spans], name)


def test_latency_and_span_end_come_from_device_events(nccl: None) -> None:
    # NCCL's futures complete when the collective is enqueued: the host clock would give a few
    # microseconds, not the time the GPU spent sleeping inside the hook.
    slept = _span_timings(0, _sleep_then_reduce)
    assert all(latency >= SLEEP_MS_AT_LEAST for latency, _ in slept), slept
    _assert_within_spans(slept)
    reduced = _span_timings(0, default_hooks.fp16_compress_hook)
    assert all(latency >= 0 for latency, _ in reduced), reduced
    _assert_within_spans(reduced)


def _sleep_in_the_last_bucket(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user's hook that keeps the GPU busy in the last bucket only: after the backward's last hook call."""
    if bucket.is_last():
        torch.cuda._sleep(SLEEP_CYCLES)
    return traced_cases.user_hook(state, bucket)


def test_exposed_communication_comes_from_device_events(nccl: None) -> None:
    # The host's last completion follows the last hook call by microseconds (NCCL's futures
    # complete at enqueue); the device spends the sleep between them.
    sink = memory_sink()
    with _training_on_cuda():
        training.train(0, traced(_sleep_in_the_last_bucket, tracer_provider=sink.provider), steps=3)
    assert flush(60), "records still pending"
    closing = [span for span in sink.spans() if Attr.STEP_BUSY_MS in span]
    assert sorted(span[Attr.STEP] for span in closing) == [1, 2]
    for span in closing:
        assert span[Attr.STEP_EXPOSED_COMMUNICATION_MS] >= SLEEP_MS_AT_LEAST, span
        assert span[Attr.STEP_COMMUNICATION_MS] >= SLEEP_MS_AT_LEAST, span
        assert span[Attr.STEP_BUSY_MS] > 0, span


def test_fp16_overflow_is_counted_on_cuda(nccl: None) -> None:
    with _training_on_cuda():
        outcome = traced_cases.overflow(0, 1)
    total = sum(outcome["expected"].values())
    assert total > 1000, "the test must actually overflow"
    assert outcome["span"] == outcome["expected"]
    assert outcome["metric"] == total


def test_traced_powersgd_figure_is_its_residual_on_cuda(nccl: None) -> None:
    with _training_on_cuda():
        outcome = traced_cases.traced_powersgd(0, 1)
    assert outcome["equal"], "tracing changed PowerSGD's gradients"
    compressed = [span for span in outcome["spans"] if span[Attr.STEP] >= 2]
    assert compressed
    for span in compressed:
        expected = outcome["expected"][(span[Attr.STEP], span[Attr.BUCKET_INDEX])]
        assert span[Attr.COMPRESSION_DTYPE] == "powersgd"
        assert span[Attr.COMPRESSION_RELATIVE_ERROR] == pytest.approx(expected, rel=1e-4)


# -- synchronization --------------------------------------------------------------------------------


@contextlib.contextmanager
def _counting_syncs() -> Iterator[collections.Counter]:
    """Count host-device synchronizations by who made them: "training" threads or "tensorplay"'s own.

    Two sources, since neither sees every kind. torch's sync debug mode ("warn") reports implicit
    ones (``.item()``, blocking copies, ``Stream.synchronize``) as warnings from the thread that
    made them; it does not report ``torch.cuda.synchronize`` or ``Event.synchronize``, which are
    counted by wrapping them. Mode "error" would be process-wide: it would fail
    tensorplay-finisher's reads of figures whose events have completed, which wait for nothing.
    """
    counts: collections.Counter = collections.Counter()

    def note() -> None:
        thread = threading.current_thread().name
        counts["tensorplay" if thread.startswith(TELEMETRY_THREAD_PREFIX) else "training"] += 1

    def counted(synchronize: Callable) -> Callable:
        @functools.wraps(synchronize)
        def counting_synchronize(*args: Any, **kwargs: Any) -> Any:
            note()
            return synchronize(*args, **kwargs)

        return counting_synchronize

    def show(message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchronizing CUDA operation" in str(message):
            note()

    device_synchronize, event_synchronize = torch.cuda.synchronize, torch.cuda.Event.synchronize
    with warnings.catch_warnings():  # restores showwarning and the filters
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.synchronize = counted(device_synchronize)
        torch.cuda.Event.synchronize = counted(event_synchronize)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize, torch.cuda.Event.synchronize = device_synchronize, event_synchronize


def _syncs_in_backward(hook: Callable, state: Any = None, steps: int = 5) -> collections.Counter:
    """Train the test model on cuda:0 under ``hook``; count the synchronizations made inside backward."""
    with _training_on_cuda():
        model = DDP(training.make_model(), bucket_cap_mb=training.BUCKET_CAP_MB)
        batches = [training.rank_batch(0, step) for step in range(steps)]
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    total: collections.Counter = collections.Counter()
    for batch in batches:
        optimizer.zero_grad()
        loss = model(batch).square().mean()
        with _counting_syncs() as syncs:
            loss.backward()
        total.update(syncs)
    torch.cuda.synchronize()
    assert flush(60), "records still pending"
    return total


def test_sync_counting_sees_every_kind_of_synchronization(nccl: None) -> None:
    on_device = torch.ones(1, device="cuda")
    event = torch.cuda.Event()
    event.record()
    kinds: list[Callable[[], Any]] = [
        on_device.item,
        lambda: on_device.cpu(),
        torch.cuda.synchronize,
        lambda: torch.cuda.current_stream().synchronize(),
        lambda: event.synchronize(),
    ]
    for kind in kinds:
        with _counting_syncs() as syncs:
            kind()
        assert syncs["training"] >= 1 and syncs["tensorplay"] == 0, kind


@pytest.mark.parametrize("name", [name for name in traced_cases.HOOKS if name != "noop_hook"])
def test_traced_default_hooks_never_synchronize_the_training_thread(nccl: None, name: str) -> None:
    hook = traced_cases.HOOKS[name][0]
    traced_hook, sink = _fully_traced(hook)
    traced_syncs = _syncs_in_backward(traced_hook)
    untraced_syncs = _syncs_in_backward(hook)
    assert sink.finished(), "nothing was traced: the count proves nothing"
    counts = f"traced: {dict(traced_syncs)}, untraced: {dict(untraced_syncs)}"
    assert traced_syncs["training"] == untraced_syncs["training"], f"the telemetry synchronized ({counts})"
    assert traced_syncs["training"] == 0, f"DDP or the hook synchronized by itself ({counts})"


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook], ids=["powerSGD_hook", "batched_powerSGD_hook"])
def test_traced_powersgd_adds_no_synchronization(nccl: None, hook: Callable) -> None:
    # The hook synchronizes by itself (as torch's does, once a bucket is decompressed, and when it
    # copies random Qs from the host): tracing must add nothing to that.
    def state() -> PowerSGDState:
        return PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)

    traced_hook, sink = _fully_traced(hook)
    untraced_syncs = _syncs_in_backward(hook, state())
    traced_syncs = _syncs_in_backward(traced_hook, state())
    assert sink.finished(), "nothing was traced: the count proves nothing"
    assert untraced_syncs["training"] > 0, "the hook's own synchronizations went unseen: the count proves nothing"
    assert traced_syncs["training"] == untraced_syncs["training"], (dict(traced_syncs), dict(untraced_syncs))


def test_a_replica_fingerprint_on_cuda_never_synchronizes_and_equals_the_cpu_ones(nccl: None, monkeypatch) -> None:
    """Fingerprinted after every step: the training thread synchronizes no more than untraced (not at
    all), the fingerprint is served at a later step or by flush(), and it is the fingerprint of the
    same parameters copied to the host (the CPU path)."""
    from tensorplay.telemetry import replica_sync
    from tensorplay.telemetry.fingerprint import sample_indices, take_sample

    monkeypatch.setattr(replica_sync, "_every", 1)
    sampled: list[list[torch.Tensor]] = []  # the parameters of each fingerprint, in its order

    def noting(parameters: list[torch.Tensor], indices: list[torch.Tensor]) -> Any:
        sampled.append(list(parameters))
        return take_sample(parameters, indices)

    monkeypatch.setattr(replica_sync, "take_sample", noting)

    def syncs_in_steps(hook: Callable) -> collections.Counter:
        with _training_on_cuda():
            model = DDP(training.make_model(), bucket_cap_mb=training.BUCKET_CAP_MB)
            batches = [training.rank_batch(0, step) for step in range(4)]
        model.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        total: collections.Counter = collections.Counter()
        for batch in batches:
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            with _counting_syncs() as syncs:
                optimizer.step()  # the fingerprint is taken (and an earlier one published) in its post hook
            total.update(syncs)
        return total

    untraced = syncs_in_steps(default_hooks.allreduce_hook)
    sink = memory_sink()
    traced_syncs = syncs_in_steps(sink.traced(default_hooks.allreduce_hook))
    assert traced_syncs["training"] == untraced["training"] == 0, (dict(traced_syncs), dict(untraced))
    assert flush(60)  # publishes the last step's fingerprint once its copy happened
    step, served = sink.metrics.replica_fingerprints.get("0")
    assert sampled and any(p.is_cuda for p in sampled[-1])
    on_host = [p.detach().cpu() for p in sampled[-1]]
    assert served == take_sample(on_host, [sample_indices(p.numel()) for p in on_host]).value()
    # Earlier ones rode on the last hook span of a later iteration, once served: each once, in order.
    carried = [span[Attr.REPLICA_FINGERPRINT_STEP] for span in sink.spans() if Attr.REPLICA_FINGERPRINT in span]
    assert carried == sorted(set(carried)) and all(taken < step for taken in carried), (carried, step)


# -- what the finisher never waits for, and never drops -------------------------------------------

BUSY_CYCLES = 15_000_000_000
"""Device clock cycles a stream is kept busy: at 3 GHz or less (any GPU's clock), 5 s or more."""
BUSY_AT_LEAST_S = 5.0


def test_a_busy_stream_does_not_hold_the_records_finished_before_it(nccl: None) -> None:
    # As behind a hung collective: right after a traced backward the current stream is kept busy
    # for seconds. The step's records, whose events happened before, are finished meanwhile: their
    # figures are read from host copies, never on the device (that read would wait for the stream).
    traced_hook, sink = _fully_traced(default_hooks.fp16_compress_hook)
    with _training_on_cuda():
        model = DDP(training.make_model(), bucket_cap_mb=training.BUCKET_CAP_MB)
        batch = training.rank_batch(0, 0)
    model.register_comm_hook(None, traced_hook)
    model(batch).square().mean().backward()
    torch.cuda._sleep(BUSY_CYCLES)
    try:
        finished = flush(BUSY_AT_LEAST_S / 2)
        in_flight = sink.metrics.collectives_in_flight.in_flight("0")
    finally:
        torch.cuda.synchronize()
    assert finished, "a record waited for the busy stream"
    assert in_flight == 0
    spans = sink.spans()
    assert spans and all(span[Attr.BUCKET_NONFINITE] == 0 and Attr.COMPRESSION_RELATIVE_ERROR in span for span in spans)


class _SlowSpanProcessor(SpanProcessor):
    """An application's span processor that exports in line to a slow collector."""

    def on_end(self, span: Any) -> None:
        time.sleep(0.05)


def test_a_full_span_queue_drops_spans_never_a_cuda_records_metrics(nccl: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from tensorplay.telemetry import TensorplayMetrics, finish

    monkeypatch.setattr(finish, "_finisher", finish.Finisher(capacity=4))
    provider = TracerProvider()
    provider.add_span_processor(_SlowSpanProcessor())
    metrics = TensorplayMetrics(CollectorRegistry())
    hook = traced(default_hooks.allreduce_hook, metrics=metrics, tracer_provider=provider)
    calls: list[int] = []

    def counting(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        return hook(state, bucket)

    with _training_on_cuda():
        training.train(0, counting, steps=10)
    torch.cuda.synchronize()
    assert finish.finisher().flush(60), "records still pending"
    labels = {"rank": "0", "hook": "allreduce_hook"}
    dropped = metrics.registry.get_sample_value("tensorplay_telemetry_errors_total", {"rank": "0", "reason": "span_dropped"})
    assert len(calls) >= 30 and dropped, (len(calls), dropped)  # the queue was full: the case is real
    assert metrics.registry.get_sample_value("tensorplay_allreduce_latency_seconds_count", labels) == len(calls)
    assert metrics.collectives_in_flight.in_flight("0") == 0


def test_a_hook_that_raises_after_launching_leaves_no_collective_in_flight_on_cuda(nccl: None) -> None:
    def launching_then_failing(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        default_hooks.allreduce_hook(state, bucket)  # on NCCL its future completed at enqueue
        raise RuntimeError("the hook failed after launching")

    from tensorplay.telemetry.probe import describe_hook

    describe_hook(launching_then_failing, "launching_then_failing")
    sink = memory_sink()
    torch.manual_seed(0)
    model = DDP(nn.Linear(32, 32).cuda())  # one bucket
    model.register_comm_hook(None, sink.traced(launching_then_failing))
    with pytest.raises(Exception, match="failed after launching"):
        model(torch.randn(4, 32, device="cuda")).square().mean().backward()
    torch.cuda.synchronize()
    assert flush(60), "records still pending"
    assert sink.metrics.collectives_in_flight.in_flight("0") == 0
    (span,) = sink.finished()
    assert span.status.status_code.name == "ERROR" and "failed after launching" in span.status.description


def test_the_advice_on_cuda_never_synchronizes_the_training_thread_and_is_its_buckets_arithmetic(nccl: None) -> None:
    sink = memory_sink()
    copies = traced_cases.BucketCopies(sink.traced(default_hooks.allreduce_hook, advise_every=1))
    syncs = _syncs_in_backward(copies.hook)
    assert syncs["training"] == 0, dict(syncs)
    advice = sink.spans(ADVICE_SPAN_NAME)
    assert advice, "nothing was advised: the count proves nothing"
    for span in advice:
        pooled = {name: [0.0, 0.0, 0] for name in Candidate.ALL}
        for key, copy in copies.copies.items():
            if key[0] == span[Attr.STEP]:
                for name, sums in bucket_sums(copy.clone(), copies.layouts[key], 1).items():
                    pooled[name][0] += float(sums.error_sq)
                    pooled[name][1] += float(sums.reference_sq)
                    pooled[name][2] += int(sums.nonfinite)
        for name, (error_sq, reference_sq, nonfinite) in pooled.items():
            assert span[Attr.ADVICE_ERROR_RATIO.format(candidate=name)] == pytest.approx(pooled_error(error_sq, reference_sq), rel=1e-5)
            assert span[Attr.ADVICE_NONFINITE.format(candidate=name)] == nonfinite == 0


# -- memory over a long run -----------------------------------------------------------------------


def _settled_footprint() -> dict[str, int]:
    """Once the device, the telemetry and NCCL caught up: objects, live records, device bytes."""
    torch.cuda.synchronize()
    assert flush(60), "records still pending"
    # The in-flight gauge's last completions.
    wait_until(lambda: not finisher().waiting(), 30, "tensorplay-finisher to have no event left", interval=0.01)
    gc.collect()
    # NCCL's watchdog keeps each completed collective's tensors until its next sweep: wait until
    # two readings 0.3 s apart agree.
    readings = [torch.cuda.memory_allocated()]

    def device_bytes_settled() -> bool:
        time.sleep(0.3)
        readings.append(torch.cuda.memory_allocated())
        return readings[-1] == readings[-2]

    wait_until(device_bytes_settled, 30, "the device memory to settle", interval=0)
    device_bytes = readings[-1]
    return {
        "objects": len(gc.get_objects()),
        "records": traced_cases.live_records(),
        "device bytes": device_bytes,
        "finisher waiting": finisher().waiting(),
    }


def test_a_long_run_keeps_records_events_and_device_memory_flat(nccl: None) -> None:
    exporter = CountingExporter()
    sink = memory_sink(exporter)
    metrics = sink.metrics
    torch.manual_seed(0)
    model = DDP(nn.Linear(32, 32).cuda())  # one bucket per step
    hook = sink.traced(default_hooks.fp16_compress_hook, error_every=1)
    model.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(4, 32, device="cuda")
    in_flight, footprints = [], {}
    for step in range(1, SOAK_STEPS + 1):
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()
        if step % 100 == 0:
            in_flight.append((finisher().pending(), finisher().waiting()))
        if step in (300, SOAK_STEPS):
            footprints[step] = _settled_footprint()
    early, late = footprints[300], footprints[SOAK_STEPS]
    # Bounded by how far the host runs ahead of the device, never one per step (1,200).
    assert max(max(pending, waiting) for pending, waiting in in_flight) <= 64, in_flight
    assert late["finisher waiting"] == 0, late
    assert late["records"] <= early["records"] <= 4, footprints
    assert late["objects"] - early["objects"] < 500, footprints
    # Each record's figures are 0-dim device tensors (512 bytes each in the caching allocator):
    # a record kept per step would add over 1 MB here.
    assert late["device bytes"] <= early["device bytes"] + 64 * 1024, footprints
    assert exporter.exported == 2 * SOAK_STEPS  # a hook span (one bucket) and an optimizer step span per step
    assert metrics.collectives_in_flight.in_flight("0") == 0


# -- gloo, world size 2, two ranks sharing cuda:0 ----------------------------------------------------


def _on_two_ranks_sharing_one_gpu(rank: int, world_size: int) -> dict:
    torch.cuda.set_device(0)
    with _training_on_cuda():
        outcome = {
            "default hooks": parity_cases.compare_default_hooks(rank, world_size),
            "powersgd": parity_cases.compare_powersgd(rank, world_size, False),
            "spans": traced_cases.spans_and_metrics(rank, world_size),
            "powersgd poisoned": traced_cases.powersgd_poisoned_on_rank_0(rank, world_size),
        }
    outcome["timings"] = [
        *_span_timings(rank, default_hooks.allreduce_hook),
        *_span_timings(rank, default_hooks.fp16_compress_hook),
    ]
    return outcome


@pytest.fixture(scope="module")
def gloo_cuda() -> list[dict]:
    _deterministic_cublas()
    return run_ranks(_on_two_ranks_sharing_one_gpu, 2, timeout=300)


@pytest.mark.parametrize("comparison", ["default hooks", "powersgd"])
def test_hooks_equal_torch_bit_for_bit_over_gloo_on_cuda(gloo_cuda: list[dict], comparison: str) -> None:
    for rank, outcome in enumerate(gloo_cuda):
        report = dict(outcome[comparison])
        assert report.pop("buckets") >= 3, f"rank {rank}: the model must span several buckets"
        assert not [name for name, equal in report.items() if not equal], f"rank {rank}: {report}"


@pytest.mark.parametrize("name", SPAN_HOOKS)
def test_every_attribute_and_metric_over_gloo_on_cuda(gloo_cuda: list[dict], name: str) -> None:
    spans = [outcome["spans"] for outcome in gloo_cuda]
    for rank, outcome in enumerate(spans):
        _assert_attributes(outcome[name], name, rank=rank, world_size=2)
    traced_cases.check_gradients_equal_untraced(spans, name)
    traced_cases.check_metrics_agree_with_spans(spans, name)


def test_latency_of_real_communication_is_positive_and_within_its_span(gloo_cuda: list[dict]) -> None:
    for outcome in gloo_cuda:
        assert outcome["timings"] and all(latency > 0 for latency, _ in outcome["timings"]), outcome["timings"]
        _assert_within_spans(outcome["timings"])


@pytest.mark.parametrize("case", traced_cases.POWERSGD_CASES)
def test_powersgd_counts_each_ranks_own_nonfinite_elements_on_cuda(gloo_cuda: list[dict], case: tuple[bool, int]) -> None:
    traced_cases.check_powersgd_poisoned([outcome["powersgd poisoned"] for outcome in gloo_cuda], case)
