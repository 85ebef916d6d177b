"""Telemetry never hangs, leaks or stalls training, and never loses or falsifies a span.

Every scenario runs on the same two real gloo ranks (one spawn, ``outcomes`` fixture):

* PowerSGD's latency times the bucket's own collectives, not the backward compute of the next
  bucket (its future completes on its own; the wrapper-waits-inside-the-hook case is checked
  against torch in test_powersgd.py);
* a span processor whose exporter never answers does not hold training, and every metric is
  recorded while it hangs;
* spans end exactly once, with ERROR status and the exception, when the hook, one of its
  collectives, or the telemetry itself fails;
* a soak of 2,000 steps on a one-bucket model keeps live objects and pending records flat;
* one traced hook on two DDP models (one backward each, or both in one backward) counts each
  model's steps from 0, samples each model's error on the same steps, and changes no bit.
"""


import gc
import threading
import time
import types
from typing import Any, Sequence

import pytest
import torch
import torch.distributed as dist
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import _common, default_hooks
from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from tensorplay.telemetry import TensorplayMetrics, flush
from tensorplay.telemetry.finish import CAPACITY, finisher
from tensorplay.telemetry.names import HOOK_SPAN_NAME, Attr

from .ranks import run_ranks
from .sink import CountingExporter, hook_spans, memory_sink
from .traced_cases import live_records
from .training import BUCKET_CAP_MB, make_model, rank_batch, train

SOAK_STEPS = 2000


# --- PowerSGD: latency of this bucket only ------------------------------------------------------

HELD_AT_MOST_S = 30.0
"""How long the pause holds the training thread for the buckets already called (a bound, not a figure)."""


class _Calls:
    """The traced hook's calls in the current backward, and how the pause between them went."""

    def __init__(self) -> None:
        self.step = 0
        self.this_backward: list[tuple[int, float, torch.futures.Future]] = []  # bucket index, called, future
        self.held: dict[int, dict] = {}  # per step: the buckets called before the hold, its release

    def new_backward(self, step: int) -> None:
        self.step = step
        self.this_backward = []


class _HoldInBackward(torch.autograd.Function):
    """Identity forward; its backward holds the training thread, as a slow layer between two buckets
    does, until every bucket called before it completed (at most ``HELD_AT_MOST_S``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, calls: _Calls) -> torch.Tensor:
        ctx.calls = calls
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        calls: _Calls = ctx.calls
        before = list(calls.this_backward)
        done = [threading.Event() for _ in before]
        for (_, _, future), event in zip(before, done):
            future.add_done_callback(lambda _, event=event: event.set())
        deadline = time.monotonic() + HELD_AT_MOST_S
        completed = all(event.wait(max(0.0, deadline - time.monotonic())) for event in done)
        calls.held[calls.step] = {"called": {index: called for index, called, _ in before},
                                  "completed": completed, "released": time.monotonic()}
        return grad, None


class _Held(nn.Module):
    def __init__(self, calls: _Calls) -> None:
        super().__init__()
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HoldInBackward.apply(x, self.calls)


def powersgd_latency(rank: int) -> dict:
    """PowerSGD's second round runs from the first round's completion, not from the next hook call.

    The backward holds the training thread between two buckets until the buckets already called
    completed. Had the traced hook's second round waited for the training thread, they could not
    complete, and the hold would end at its bound instead; a bucket's latency (launch of its first
    collective to completion of its last) then fits between its call and the hold's release.
    """
    sink = memory_sink()
    calls = _Calls()
    layers = list(make_model())
    model = DDP(nn.Sequential(*layers[:3], _Held(calls), *layers[3:]), bucket_cap_mb=BUCKET_CAP_MB)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    hook = traced(powerSGD_hook, tracer_provider=sink.provider)

    def noting_calls(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        called = time.monotonic()
        future = hook(state, bucket)
        calls.this_backward.append((bucket.index(), called, future))
        return future

    model.register_comm_hook(state, noting_calls)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        optimizer.zero_grad()
        calls.new_backward(step)
        model(rank_batch(rank, step)).square().mean().backward()
        optimizer.step()
    assert flush(30)
    compressing = [s for s in sink.spans() if s[Attr.STEP] >= 2]
    held_buckets = []  # latency, and the most it can be had the bucket completed within the hold
    for span in compressing:
        hold = calls.held[span[Attr.STEP]]
        called = hold["called"].get(span[Attr.BUCKET_INDEX])
        if called is not None:
            held_buckets.append((span[Attr.ALLREDUCE_LATENCY_MS] / 1e3, hold["released"] - called))
    return {
        "compressing spans": len(compressing),
        "collectives per bucket": sorted({s[Attr.ALLREDUCE_COUNT] for s in compressing}),
        "buckets": len({s[Attr.BUCKET_INDEX] for s in compressing}),
        "holds": [(len(calls.held[step]["called"]), calls.held[step]["completed"]) for step in (2, 3)],
        "held buckets (latency s, call to release s)": held_buckets,
    }


# --- an exporter that never answers -------------------------------------------------------------


class _NeverAnswers(SpanExporter):
    """An exporter stuck in its first export until released, like a collector that never answers."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        self.release.wait()
        self.exported += hook_spans(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def stuck_exporter(rank: int) -> dict:
    exporter = _NeverAnswers()
    sink = memory_sink(exporter)
    calls = [0]

    def counting(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls[0] += 1
        return hook(state, bucket)

    hook = sink.traced(default_hooks.fp16_compress_hook)
    started = time.monotonic()
    traced_params = train(rank, counting, steps=6)
    elapsed = time.monotonic() - started
    observed_while_stuck = sink.sample("tensorplay_allreduce_latency_seconds_count", rank=str(rank), hook="fp16_compress_hook")
    exports_while_stuck = exporter.calls
    exporter.release.set()
    drained = flush(30)
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(traced_params, train(rank, default_hooks.fp16_compress_hook, steps=6))),
        "calls": calls[0],
        "observed while stuck": observed_while_stuck,
        "exports while stuck": exports_while_stuck,
        "exported after release": exporter.exported,
        "drained": drained,
        "seconds": elapsed,
    }


# --- spans of failures --------------------------------------------------------------------------


class _FailedWork:
    """A collective whose future holds an error, as a broken connection or a timeout leaves it."""

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(RuntimeError("collective broke: connection reset by peer"))
        return future


def _spans_of(hook: Any, rank: int, state: Any = None, **traced_options: Any) -> dict:
    """Train one step with traced(hook); return the error (if any) and the spans' status and events."""
    sink = memory_sink()
    wrapped = traced(hook, tracer_provider=sink.provider, **traced_options)
    calls = [0]

    def counting(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls[0] += 1
        return wrapped(state, bucket)

    try:
        params = train(rank, counting, state=state, steps=1)
        error = None
    except (RuntimeError, ValueError) as caught:  # DDP re-raises the hook's or the future's error
        params, error = None, str(caught)
    assert flush(30)
    spans = [s for s in sink.finished() if s.name == HOOK_SPAN_NAME]
    return {
        "error": error,
        "params": params,
        "calls": calls[0],
        "span ids": len({s.context.span_id for s in spans}),
        "spans": len(spans),
        "status": sorted({(s.status.status_code.name, s.status.description or "") for s in spans}),
        "exceptions": sorted({e.attributes["exception.message"] for s in spans for e in s.events if e.name == "exception"}),
        "with attributes": sum(Attr.ALLREDUCE_LATENCY_MS in s.attributes for s in spans),
    }


def failing_spans(rank: int) -> dict:
    outcome: dict[str, Any] = {}

    def raising_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        raise ValueError("the hook itself failed")

    def failed_future_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return _FailedWork().get_future()

    outcome["hook raised"] = _spans_of(raising_hook, rank)
    outcome["future failed"] = _spans_of(failed_future_hook, rank)

    original = _common.dist
    _common.dist = types.SimpleNamespace(
        group=dist.group, ProcessGroup=dist.ProcessGroup, all_reduce=lambda *args, **kwargs: _FailedWork()
    )
    try:
        outcome["collective failed"] = _spans_of(default_hooks.allreduce_hook, rank)
    finally:
        _common.dist = original

    # Telemetry fails while finishing the record: the span still ends, marked incomplete.
    metrics = TensorplayMetrics(CollectorRegistry())

    def broken_labels(**labels: str) -> Any:
        raise RuntimeError("a metric that cannot be recorded")

    metrics.allreduce_latency.labels = broken_labels  # type: ignore[method-assign]
    outcome["finishing failed"] = _spans_of(default_hooks.allreduce_hook, rank, metrics=metrics)

    # Telemetry fails after the span started, before its record exists.
    class Unreadable:
        @property
        def process_group(self) -> Any:
            raise RuntimeError("a state that cannot be read")

    def user_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return default_hooks.allreduce_hook(None, bucket)

    outcome["record failed"] = _spans_of(user_hook, rank, state=Unreadable())
    plain = train(rank, default_hooks.allreduce_hook, steps=1)
    for result in outcome.values():
        params = result.pop("params")
        result["equal to untraced"] = params is not None and all(torch.equal(a, b) for a, b in zip(params, plain))
    return outcome


# --- soak ---------------------------------------------------------------------------------------


def soak(rank: int) -> dict:
    exporter = CountingExporter()
    sink = memory_sink(exporter)
    torch.manual_seed(0)
    model = DDP(nn.Linear(32, 32))  # one bucket per step
    model.register_comm_hook(None, sink.traced(default_hooks.allreduce_hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(4, 32)
    objects, records, pending, drained = {}, {}, [], {}
    for step in range(1, SOAK_STEPS + 1):
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()
        if step % 100 == 0:
            pending.append(finisher().pending())
        if step in (300, SOAK_STEPS):
            drained[step] = flush(30)
            gc.collect()
            objects[step] = len(gc.get_objects())
            records[step] = live_records()
    return {
        "objects": objects,
        "records": records,
        "pending": pending,
        "drained": drained,
        "exported": exporter.exported,
        "in flight": sink.metrics.collectives_in_flight.in_flight(str(rank)),
        "waiting since": sink.sample("tensorplay_collective_waiting_since_timestamp_seconds", rank=str(rank)),
    }


# --- one traced hook on two DDP models -----------------------------------------------------------

TWO_MODEL_STEPS = 4


def _train_two_models(rank: int, hook: Any, one_backward: bool) -> list[torch.Tensor]:
    """Two DDP models (state None for both) sharing ``hook``; their parameters after training."""
    first = DDP(make_model(seed=1), bucket_cap_mb=BUCKET_CAP_MB)
    second = DDP(make_model(seed=2), bucket_cap_mb=BUCKET_CAP_MB)
    for model in (first, second):
        model.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    for step in range(TWO_MODEL_STEPS):
        optimizer.zero_grad()
        batch = rank_batch(rank, step)
        if one_backward:  # a generator feeding its discriminator: both reduce in one backward
            second(first(batch)).square().mean().backward()
        else:  # teacher, then student: one model's backward fully, then the other's
            first(batch).square().mean().backward()
            second(batch).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in (*first.parameters(), *second.parameters())]


def two_models(rank: int) -> dict:
    outcome: dict[str, Any] = {}
    for one_backward in (False, True):
        sink = memory_sink()
        hook = sink.traced(default_hooks.fp16_compress_hook, error_every=2)
        traced_params = _train_two_models(rank, hook, one_backward)
        assert flush(30)
        plain_params = _train_two_models(rank, default_hooks.fp16_compress_hook, one_backward)
        calls: dict[int, list[tuple[int, bool]]] = {}
        for attributes in sink.spans(None):
            calls.setdefault(attributes.get(Attr.MODEL, 0), []).append(
                (attributes[Attr.STEP], Attr.COMPRESSION_RELATIVE_ERROR in attributes)
            )
        outcome["one backward" if one_backward else "one backward each"] = {
            "bitwise equal": all(
                torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(traced_params, plain_params)
            ),
            "steps": {model: sorted({step for step, _ in c}) for model, c in calls.items()},
            "sampled": {model: sorted({step for step, sampled in c if sampled}) for model, c in calls.items()},
            "unsampled": {model: sorted({step for step, sampled in c if not sampled}) for model, c in calls.items()},
            "buckets per step": {
                model: [sum(step == s for s, _ in c) for step in range(1, TWO_MODEL_STEPS)] for model, c in calls.items()
            },
            "spans": {model: len(c) for model, c in calls.items()},
            "latency counts": [
                sink.sample("tensorplay_allreduce_latency_seconds_count", rank=str(rank), hook=label)
                for label in ("fp16_compress_hook", "fp16_compress_hook#1")
            ],
            "compute observations": sink.sample("tensorplay_step_compute_seconds_count", rank=str(rank)),
        }
    return outcome


def _counted_steps(registry: CollectorRegistry, rank: int) -> dict:
    return {
        "compute observations": registry.get_sample_value("tensorplay_step_compute_seconds_count", {"rank": str(rank)}),
        "steps counted": registry.get_sample_value(
            "tensorplay_steps_total", {"rank": str(rank), "hook": "allreduce_hook"}
        ),
    }


def freed_then_new_model(rank: int) -> dict:
    """A model trains 3 steps and is freed; a new one takes its place for 3 more."""
    metrics = TensorplayMetrics(CollectorRegistry())
    hook = traced(default_hooks.allreduce_hook, metrics=metrics)
    for seed in (1, 2):
        model = DDP(make_model(seed=seed), bucket_cap_mb=BUCKET_CAP_MB)
        model.register_comm_hook(None, hook)
        for step in range(3):
            model(rank_batch(rank, step)).square().mean().backward()
        assert flush(30)
        del model
        gc.collect()
    return {**_counted_steps(metrics.registry, rank), "models": hook._models.count()}  # type: ignore[attr-defined]


def models_sharing_a_parameter(rank: int, shared_last: bool = False) -> dict:
    """Two DDP models that share one layer, each with a layer of its own.

    The shared layer first, in one bucket with the rest; or last, with a bucket per layer: after
    DDP's rebuild, each model's bucket 0 holds only the shared layer, whose parameters both reduce.
    The models take turns in a different order at every step.
    """
    sink = memory_sink()
    hook = sink.traced(default_hooks.allreduce_hook)
    torch.manual_seed(0)
    shared = nn.Linear(32, 32)
    layers = (lambda: (nn.Linear(32, 32), shared)) if shared_last else (lambda: (shared, nn.Linear(32, 32)))
    bucket_cap_mb = 0.001 if shared_last else 25  # 4 kB: a bucket per layer once rebuilt
    models = [DDP(nn.Sequential(*layers()), bucket_cap_mb=bucket_cap_mb) for _ in range(2)]
    for model in models:
        model.register_comm_hook(None, hook)
    for step in range(3):
        for model in models if step % 2 == 0 else models[::-1]:
            model(rank_batch(rank, step)[:, :32]).square().mean().backward()
    assert flush(30)
    steps: dict[int, list[int]] = {}
    for span in sink.spans(None):
        steps.setdefault(span[Attr.MODEL], []).append(span[Attr.STEP])
    return {model: sorted(s) for model, s in steps.items()}


def all_scenarios(rank: int, world_size: int) -> dict:
    return {
        "powersgd": powersgd_latency(rank),
        "stuck exporter": stuck_exporter(rank),
        "failures": failing_spans(rank),
        "soak": soak(rank),
        "two models": two_models(rank),
        "freed model": freed_then_new_model(rank),
        "shared parameter": models_sharing_a_parameter(rank),
        "shared last layer": models_sharing_a_parameter(rank, shared_last=True),
    }


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(all_scenarios, 2, timeout=300)


def test_powersgd_latency_times_only_the_buckets_own_collectives(outcomes: list[dict]) -> None:
    for outcome in outcomes:
        result = outcome["powersgd"]
        assert result["buckets"] >= 3 and result["compressing spans"] == 2 * result["buckets"]
        assert result["collectives per bucket"] in ([2], [3], [2, 3])
        assert result["holds"] and all(before >= 1 and completed for before, completed in result["holds"]), result
        held = result["held buckets (latency s, call to release s)"]
        assert len(held) == sum(before for before, _ in result["holds"]), result
        assert all(latency <= most for latency, most in held), result


def test_an_exporter_that_never_answers_does_not_hold_training(outcomes: list[dict]) -> None:
    for outcome in outcomes:
        result = outcome["stuck exporter"]
        assert result["equal"]
        assert result["calls"] >= 6 * 2  # 6 steps of several buckets
        assert result["observed while stuck"] == result["calls"], "metrics waited for span export"
        assert result["exports while stuck"] == 1, "one span processor call hangs, the rest are queued"
        assert result["drained"] and result["exported after release"] == result["calls"]


@pytest.mark.parametrize(
    "case, expected_exception",
    [
        ("hook raised", "the hook itself failed"),
        ("future failed", "collective broke: connection reset by peer"),
        ("collective failed", "collective broke: connection reset by peer"),
    ],
)
def test_a_failed_hook_or_collective_ends_its_span_once_with_error(
    outcomes: list[dict], case: str, expected_exception: str
) -> None:
    for outcome in outcomes:
        result = outcome["failures"][case]
        assert result["error"] is not None and expected_exception in result["error"]
        assert result["calls"] >= 1
        assert result["spans"] == result["span ids"] == result["calls"], "one span per call, each ended once"
        ((status, description),) = result["status"]
        assert status == "ERROR" and expected_exception in description
        assert result["exceptions"] == [expected_exception]


@pytest.mark.parametrize("case, description", [("finishing failed", "could not finish"), ("record failed", "could not start")])
def test_telemetry_failures_end_the_span_and_spare_training(outcomes: list[dict], case: str, description: str) -> None:
    for outcome in outcomes:
        result = outcome["failures"][case]
        assert result["error"] is None
        assert result["equal to untraced"]
        assert result["spans"] == result["span ids"] == result["calls"] >= 1
        ((status, text),) = result["status"]
        assert status == "ERROR" and description in text


def test_soak_keeps_objects_and_pending_records_flat(outcomes: list[dict]) -> None:
    for outcome in outcomes:
        result = outcome["soak"]
        early, late = result["objects"][300], result["objects"][SOAK_STEPS]
        # One record kept per step would be ~20 objects x 1,700 steps.
        assert late - early < 500, result["objects"]
        # A few records stay reachable (those DDP still holds the futures of), never more.
        assert result["records"][SOAK_STEPS] <= result["records"][300] <= 4, result["records"]
        # Every call's count is given back (a leaked one would hold flush() to its timeout), and
        # the thread's backlog is bounded by its queue, however far a loaded host lets it fall behind.
        assert result["drained"] == {300: True, SOAK_STEPS: True}, result["pending"]
        assert max(result["pending"]) <= CAPACITY, result["pending"]
        assert result["exported"] == SOAK_STEPS
        assert result["in flight"] == 0 and result["waiting since"] == 0.0


@pytest.mark.parametrize("interleaving", ["one backward each", "one backward"])
def test_one_traced_hook_on_two_models_counts_each_models_steps(outcomes: list[dict], interleaving: str) -> None:
    every_step = list(range(TWO_MODEL_STEPS))
    for outcome in outcomes:
        result = outcome["two models"][interleaving]
        assert result["bitwise equal"]
        assert result["steps"] == {0: every_step, 1: every_step}, "each model's steps run 0..N-1"
        assert result["sampled"] == {0: [0, 2], 1: [0, 2]}, "error_every=2 samples both models"
        assert result["unsampled"] == {0: [1, 3], 1: [1, 3]}
        for model, per_step in result["buckets per step"].items():  # every bucket found its model
            assert len(set(per_step)) == 1 and per_step[0] >= 3, (model, per_step)
        assert result["latency counts"] == [result["spans"][0], result["spans"][1]]  # hook="<name>", "<name>#1"
        assert result["compute observations"] == TWO_MODEL_STEPS - 1  # the first model's iterations


def test_a_model_that_replaces_a_freed_one_starts_its_own_steps(outcomes: list[dict]) -> None:
    for outcome in outcomes:
        result = outcome["freed model"]
        # Steps 1 and 2 of each model follow a step of the same model; its step 0 follows none.
        assert result["compute observations"] == 4, "the new model's first step was timed from the freed one's last"
        assert result["steps counted"] == 4
        assert result["models"] == 0, "a freed model's state outlived it"


def test_models_sharing_a_parameter_are_two_models(outcomes: list[dict]) -> None:
    for outcome in outcomes:
        assert outcome["shared parameter"] == {0: [0, 1, 2], 1: [0, 1, 2]}
        # One bucket in the first iteration, one per layer (2) once rebuilt, for each model.
        assert outcome["shared last layer"] == {0: [0, 1, 1, 2, 2], 1: [0, 1, 1, 2, 2]}
