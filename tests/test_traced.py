"""traced(hook): same gradients, and every contract attribute and metric with the right value."""

import functools
import socket
import urllib.error
import urllib.request
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks
from prometheus_client import CollectorRegistry

import tensorplay
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks, traced
from tensorplay.telemetry import TensorplayMetrics, flush
from tensorplay.telemetry.names import HOOK_SPAN_NAME, Attr
from tensorplay.telemetry.probe import describe_hook, hook_name, reports_collectives

from .ranks import free_base_port, free_port, run_ranks
from .sink import memory_sink
from .traced_cases import (
    HOOKS,
    POWERSGD_CASES,
    BucketCopies,
    check_gradients_equal_untraced,
    check_metrics_agree_with_spans,
    check_powersgd_poisoned,
    expected_error,
    overflow,
    powersgd_poisoned_on_rank_0,
    spans_and_metrics,
    traced_powersgd,
)
from .training import passthrough, train


@pytest.fixture(scope="module")
def two_rank_outcome() -> list[dict]:
    return run_ranks(spans_and_metrics, 2)


@pytest.mark.parametrize("name", [*HOOKS, "user_hook"])
def test_traced_gradients_equal_untraced(two_rank_outcome: list[dict], name: str) -> None:
    check_gradients_equal_untraced(two_rank_outcome, name)


@pytest.mark.parametrize("name", [*HOOKS, "user_hook"])
def test_every_contract_attribute_has_its_value(two_rank_outcome: list[dict], name: str) -> None:
    compression = HOOKS.get(name, (None, None))[1]
    for rank, outcome in enumerate(two_rank_outcome):
        result = outcome[name]
        spans = result["spans"]
        assert len(spans) == len(result["bucket_numels"])  # one span per bucket of every step
        assert len([key for key in result["bucket_numels"] if key[0] == 2]) >= 3  # after DDP's rebuild
        assert sorted({s[Attr.STEP] for s in spans}) == [0, 1, 2]
        for span in spans:
            numel = result["bucket_numels"][(span[Attr.STEP], span[Attr.BUCKET_INDEX])]
            assert span[Attr.HOOK] == name
            assert span[Attr.RANK] == rank and span[Attr.WORLD_SIZE] == 2
            assert span[Attr.BUCKET_NUMEL] == numel
            assert span[Attr.BUCKET_BYTES] == numel * 4
            assert span[Attr.BUCKET_DTYPE] == "float32"
            assert span[Attr.COMPRESSION_NONFINITE] == 0
            if name == "noop_hook":
                assert span[Attr.ALLREDUCE_COUNT] == 0 and span[Attr.BUCKET_WIRE_BYTES] == 0
                assert span[Attr.ALLREDUCE_LATENCY_MS] == 0.0
            else:
                assert span[Attr.ALLREDUCE_COUNT] == 1
                assert span[Attr.ALLREDUCE_LATENCY_MS] > 0
                expected_wire = numel * (2 if compression else 4)
                assert span[Attr.BUCKET_WIRE_BYTES] == expected_wire
            if compression:
                assert span[Attr.COMPRESSION_DTYPE] == compression
            else:
                assert Attr.COMPRESSION_DTYPE not in span and Attr.COMPRESSION_RELATIVE_ERROR not in span
        for measured, expected in result["errors"]:
            assert measured == pytest.approx(expected, rel=1e-5)
            assert 0 < measured < 0.05
        assert len(result["errors"]) == (len(spans) if compression else 0)


@pytest.mark.parametrize("name", [*HOOKS, "user_hook"])
def test_metrics_agree_with_spans(two_rank_outcome: list[dict], name: str) -> None:
    check_metrics_agree_with_spans(two_rank_outcome, name)


def test_fp16_overflow_is_counted_in_span_and_metric() -> None:
    for outcome in run_ranks(overflow, 2):
        assert outcome["span"] == outcome["expected"]
        total = sum(outcome["expected"].values())
        assert total > 1000, "the test must actually overflow"
        assert outcome["metric"] == total


def _negative_cases(rank: int, world_size: int, busy_port: int, dead_endpoint: str) -> dict:
    import tensorplay.telemetry.compression_figures as figures
    import tensorplay.telemetry.recorder as recorder
    from tensorplay.telemetry import configure_tracing, disable_metrics, enable_metrics, metrics as metrics_module

    result: dict[str, Any] = {}
    # 1. No SDK, metrics off: no record is built and no figure computed.
    built = []
    original_init = recorder.BucketRecord.__init__
    recorder.BucketRecord.__init__ = lambda self, **kw: (built.append(1), original_init(self, **kw))[1]
    calls = []
    original_figures = figures.compression_figures
    figures.compression_figures = lambda *a, **k: (calls.append(1), original_figures(*a, **k))[1]
    plain = train(rank, default_hooks.fp16_compress_hook)
    quiet = train(rank, traced(default_hooks.fp16_compress_hook, error_every=1))
    result["off: equal"] = all(torch.equal(a, b) for a, b in zip(plain, quiet))
    result["off: records built"] = len(built)
    result["off: errors computed"] = len(calls)
    result["off: metrics"] = metrics_module.active_metrics() is None
    recorder.BucketRecord.__init__ = original_init
    figures.compression_figures = original_figures

    # 2. A taken port: a warning, a counted error, training goes on.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = enable_metrics(port=busy_port - rank, addr="127.0.0.1")  # LOCAL_RANK is added
    result["port: warning"] = [str(w.message) for w in caught if "cannot serve metrics" in str(w.message)]
    result["port: counted"] = metrics.registry.get_sample_value(
        "tensorplay_telemetry_errors_total", {"rank": str(rank), "reason": "metrics_port_unavailable"}
    )
    disable_metrics()

    # 3. A collector that is down: training finishes with the same gradients; failures counted.
    metrics = enable_metrics(port=0, addr="127.0.0.1", serve=False)
    provider = configure_tracing(endpoint=dead_endpoint, service_name="test")
    down = train(rank, traced(default_hooks.fp16_compress_hook))
    result["down: equal"] = all(torch.equal(a, b) for a, b in zip(plain, down))
    flush(30)
    provider.force_flush(20_000)
    result["down: failures"] = metrics.registry.get_sample_value(
        "tensorplay_telemetry_errors_total", {"rank": str(rank), "reason": "span_export_failed"}
    )
    return result


def test_off_port_taken_and_collector_down() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        # Both ranks' base+LOCAL_RANK land on the one busy port.
        outcomes = run_ranks(_negative_cases, 2, port, dead)
    finally:
        busy.close()
    for outcome in outcomes:
        assert outcome["off: equal"]
        assert outcome["off: records built"] == 0
        assert outcome["off: errors computed"] == 0
        assert outcome["off: metrics"]
        assert outcome["port: warning"] and str(port) in outcome["port: warning"][0]
        assert outcome["port: counted"] == 1
        assert outcome["down: equal"]
        assert outcome["down: failures"] >= 1


def _served(rank: int, world_size: int, base_port: int) -> dict:
    from tensorplay.telemetry import enable_metrics

    enable_metrics(port=base_port, addr="127.0.0.1")
    train(rank, traced(default_hooks.fp16_compress_hook), steps=2)
    flush(30)
    url = f"http://127.0.0.1:{base_port + rank}"
    body = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    try:
        urllib.request.urlopen(url + "/", timeout=10)
        other = 200
    except urllib.error.HTTPError as error:
        other = error.code
    return {"body": body, "other": other}


def test_each_rank_serves_metrics_on_base_port_plus_local_rank() -> None:
    base = free_base_port(2)
    for rank, outcome in enumerate(run_ranks(_served, 2, base)):
        body = outcome["body"]
        assert f'tensorplay_allreduce_latency_seconds_count{{hook="fp16_compress_hook",rank="{rank}"}}' in body
        assert f'tensorplay_wire_bytes_total{{hook="fp16_compress_hook",rank="{rank}"}}' in body
        assert outcome["other"] == 404


def test_traced_keeps_wrapped_and_doc_and_is_named_for_ddp() -> None:
    hook = traced(default_hooks.bf16_compress_hook)
    assert hook.__wrapped__ is default_hooks.bf16_compress_hook
    assert hook.__doc__ == default_hooks.bf16_compress_hook.__doc__
    assert hook.__name__ == "traced(bf16_compress_hook)"
    assert tensorplay.traced is traced
    wrapped = traced(default_hooks.bf16_compress_wrapper(default_hooks.fp16_compress_hook))
    assert wrapped.__name__ == "traced(bf16_compress_wrapper(fp16_compress_hook))"


def _module_level_user_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user's own hook, defined at module level as spawn needs."""
    return default_hooks.allreduce_hook(state, bucket)


class _OneBucket:
    """Enough of a GradBucket for a traced hook with no process group: buffer, index, last."""

    def __init__(self) -> None:
        self._buffer = torch.ones(4)

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list:
        return []


@pytest.mark.parametrize(
    "hook, name",
    [
        (default_hooks.bf16_compress_hook, "bf16_compress_hook"),
        (torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook, "fp16_compress_hook"),
        (_module_level_user_hook, "_module_level_user_hook"),
        (functools.partial(default_hooks.allreduce_hook), "allreduce_hook"),
        (traced(default_hooks.allreduce_hook), "allreduce_hook"),
    ],
)
def test_a_traced_hook_pickles_and_copies_to_an_equivalent_one(hook: Any, name: str) -> None:
    import copy
    import inspect
    import pickle

    from tensorplay.telemetry.model_identity import ModelsOfHook

    metrics = TensorplayMetrics(CollectorRegistry())
    original = traced(hook, error_every=3, advise_every=7, metrics=metrics)
    original._models.enter(_OneBucket())  # type: ignore[attr-defined]  # as if it had trained
    for copied, keeps_metrics in ((pickle.loads(pickle.dumps(original)), False), (copy.deepcopy(original), True)):
        assert copied.__name__ == copied.__qualname__ == f"traced({name})"
        assert copied.__doc__ == original.__doc__ and copied.__doc__ is not None
        assert hook_name(copied) == name and reports_collectives(copied) == reports_collectives(original)
        assert list(inspect.signature(copied).parameters)[1] == "bucket"  # what DDP checks
        assert copied._error_every == 3 and copied._advisor.every == 7  # type: ignore[attr-defined]
        assert (copied._metrics is metrics) == keeps_metrics  # type: ignore[attr-defined]
        models = copied._models  # type: ignore[attr-defined]
        assert isinstance(models, ModelsOfHook) and models.count() == 0  # fresh counts
        wrapped = copied.__wrapped__
        assert hook_name(wrapped) == hook_name(hook) and getattr(wrapped, "__name__", None) == getattr(hook, "__name__", None)


def test_a_traced_closure_does_not_pickle_as_torchs_wrappers_do_not() -> None:
    import pickle

    with pytest.raises((pickle.PicklingError, AttributeError), match="Can't pickle .*fp16_compress_wrapper_hook"):
        pickle.dumps(traced(default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)))


def test_traced_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="traced: expected a communication hook"):
        traced("allreduce")
    with pytest.raises(ValueError, match="error_every must be >= 0"):
        traced(default_hooks.allreduce_hook, error_every=-1)
    # A registry where the metrics go is the likely slip: it used to be taken, then every bucket
    # warned with a traceback and recorded nothing.
    for wrong in (CollectorRegistry(), "metrics"):
        with pytest.raises(TypeError) as refused:
            traced(default_hooks.allreduce_hook, metrics=wrong)  # type: ignore[arg-type]
        assert str(refused.value) == (
            "traced: metrics must be a TensorplayMetrics (TensorplayMetrics(registry) for a registry of your own), "
            f"or None for the process's metrics; got {type(wrong).__name__}")
    assert traced(default_hooks.allreduce_hook, metrics=TensorplayMetrics(CollectorRegistry())) is not None
    with pytest.raises(ValueError, match="advise_every must be >= 0"):
        traced(default_hooks.allreduce_hook, advise_every=-1)


def test_traced_powersgd_reports_its_residual_and_keeps_gradients() -> None:
    for outcome in run_ranks(traced_powersgd, 2):
        assert outcome["equal"]
        compressed = [s for s in outcome["spans"] if s[Attr.STEP] >= 2]
        warm_up = [s for s in outcome["spans"] if s[Attr.STEP] < 2]
        assert compressed and warm_up
        for span in warm_up:  # plain allreduce before start_powerSGD_iter: no compression
            assert Attr.COMPRESSION_DTYPE not in span and span[Attr.ALLREDUCE_COUNT] == 1
            assert span[Attr.BUCKET_WIRE_BYTES] == span[Attr.BUCKET_BYTES]
        for span in compressed:
            assert span[Attr.HOOK] == "powerSGD_hook"
            assert span[Attr.COMPRESSION_DTYPE] == "powersgd"
            assert 2 <= span[Attr.ALLREDUCE_COUNT] <= 3
            assert 0 < span[Attr.BUCKET_WIRE_BYTES] < span[Attr.BUCKET_BYTES] / 10
            key = (span[Attr.STEP], span[Attr.BUCKET_INDEX])
            assert span[Attr.COMPRESSION_RELATIVE_ERROR] == pytest.approx(outcome["expected"][key], rel=1e-5)


def _from_environment(rank: int, world_size: int, base_port: int) -> dict:
    import os

    os.environ["TENSORPLAY_METRICS_PORT"] = str(base_port)
    os.environ["TENSORPLAY_METRICS_ADDR"] = "127.0.0.1"
    train(rank, traced(default_hooks.allreduce_hook), steps=2)
    flush(30)
    body = urllib.request.urlopen(f"http://127.0.0.1:{base_port + rank}/metrics", timeout=10).read().decode()
    return {"body": body}


def test_torchrun_environment_turns_metrics_on() -> None:
    base = free_base_port(2)
    for rank, outcome in enumerate(run_ranks(_from_environment, 2, base)):
        assert f'tensorplay_step_compute_seconds_count{{rank="{rank}"}} 1.0' in outcome["body"]


def _sampled_steps(rank: int, world_size: int) -> dict:
    sink = memory_sink()
    train(rank, sink.traced(default_hooks.fp16_compress_hook, error_every=3), steps=7)
    flush(30)
    spans = sink.spans(None)
    return {
        "with error": sorted({s[Attr.STEP] for s in spans if Attr.COMPRESSION_RELATIVE_ERROR in s}),
        "without": sorted({s[Attr.STEP] for s in spans if Attr.COMPRESSION_RELATIVE_ERROR not in s}),
        "nonfinite checked": sorted({s[Attr.STEP] for s in spans if s[Attr.COMPRESSION_NONFINITE] == 0}),
        "observations": sink.sample("tensorplay_compression_error_ratio_count", rank=str(rank), hook="fp16_compress_hook"),
        "spans with error": sum(Attr.COMPRESSION_RELATIVE_ERROR in s for s in spans),
    }


def test_exact_error_only_on_sampled_steps() -> None:
    from tensorplay.telemetry import DEFAULT_ERROR_EVERY

    assert DEFAULT_ERROR_EVERY == 25  # documented in docs/telemetry.md
    for outcome in run_ranks(_sampled_steps, 2):
        assert outcome["with error"] == [0, 3, 6]
        assert outcome["without"] == [1, 2, 4, 5]
        assert outcome["nonfinite checked"] == list(range(7))  # every step
        assert outcome["observations"] == outcome["spans with error"]


def _global_provider(rank: int, world_size: int) -> dict:
    from opentelemetry import trace

    hook = traced(default_hooks.fp16_compress_hook)  # made before the application sets its SDK up
    sink = memory_sink()
    trace.set_tracer_provider(sink.provider)
    with trace.get_tracer("my.training").start_as_current_span("train"):
        train(rank, hook, steps=2)
    flush(30)
    spans = sink.finished()
    train_span = next(s for s in spans if s.name == "train")
    hook_spans = [s for s in spans if s.name == HOOK_SPAN_NAME]
    return {
        "scopes": {s.instrumentation_scope.name for s in hook_spans},
        "count": len(hook_spans),
        "children of train": all(s.parent is not None and s.parent.span_id == train_span.context.span_id for s in hook_spans),
    }


def test_spans_go_to_the_global_provider_under_the_tensorplay_tracer() -> None:
    for outcome in run_ranks(_global_provider, 2):
        assert outcome["scopes"] == {"tensorplay"}
        assert outcome["count"] >= 4
        assert outcome["children of train"]


def _nan_bucket(rank: int, world_size: int) -> dict:
    """A bucket that arrives holding NaN and inf: training goes on, the elements are counted."""
    outcome: dict[str, Any] = {}
    for error_every in (1, 0):  # the error pass and the plain finiteness check both notice
        sink = memory_sink()
        hook = sink.traced(default_hooks.fp16_compress_hook, error_every=error_every)
        plain = default_hooks.fp16_compress_hook
        step = [0, 0]

        def poisoned(target: Any, slot: int) -> Any:
            def poisoning_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                if step[slot] == 1 and bucket.index() == 0:
                    bucket.buffer()[:5] = float("nan")
                    bucket.buffer()[5:8] = float("inf")
                if bucket.is_last():
                    step[slot] += 1
                return target(state, bucket)

            return poisoning_hook

        traced_params = train(rank, poisoned(hook, 0), steps=2)  # poisoned in the last step
        plain_params = train(rank, poisoned(plain, 1), steps=2)
        spans = {(s[Attr.STEP], s[Attr.BUCKET_INDEX]): s for s in sink.spans(None)}
        outcome[error_every] = {
            "bitwise equal": all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(traced_params, plain_params)),
            "poisoned span": spans[(1, 0)],
            "other spans clean": all(s[Attr.BUCKET_NONFINITE] == 0 for key, s in spans.items() if key != (1, 0)),
            "metric": sink.sample("tensorplay_bucket_nonfinite_elements_total", rank=str(rank), hook="fp16_compress_hook"),
            "created metric": sink.sample("tensorplay_nonfinite_elements_total", rank=str(rank), hook="fp16_compress_hook"),
        }
    return outcome


def test_a_bucket_holding_nan_is_counted_and_training_goes_on() -> None:
    for outcome in run_ranks(_nan_bucket, 2):
        for error_every, result in outcome.items():
            span = result["poisoned span"]
            assert result["bitwise equal"], error_every
            assert span[Attr.BUCKET_NONFINITE] == 8
            assert span[Attr.COMPRESSION_NONFINITE] == 0  # compression made none of them
            assert Attr.COMPRESSION_RELATIVE_ERROR not in span  # undefined on a non-finite bucket
            assert result["other spans clean"]
            assert result["metric"] == 8
            assert result["created metric"] == 0


@pytest.fixture(scope="module")
def powersgd_poisoned() -> list[dict]:
    return run_ranks(powersgd_poisoned_on_rank_0, 2)


@pytest.mark.parametrize("case", POWERSGD_CASES)
def test_powersgd_counts_each_ranks_own_nonfinite_elements(powersgd_poisoned: list[dict], case: tuple[bool, int]) -> None:
    check_powersgd_poisoned(powersgd_poisoned, case)


POISONED_HOOKS = {
    "fp16_compress_hook": (default_hooks.fp16_compress_hook, torch.float16, False),
    "bf16_compress_wrapper(allreduce_hook)": (
        default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook), torch.bfloat16, True,
    ),
}
OVERFLOW = {torch.float16: 1e6, torch.bfloat16: 3.4e38}  # finite in float32, inf once cast


def _poisoned_on_one_rank(rank: int, world_size: int) -> dict:
    """Step 2 of 3: rank 0's bucket 0 holds NaN and values that overflow when cast, rank 1's bucket 1 overflows.

    The collective spreads the non-finite sums to every rank: what each rank counts must still be
    only its own elements, in its own bucket, and the error of a rank's clean bucket stays exact.
    Errors are sampled every other step (0 and 2).
    """
    import threading

    import tensorplay.telemetry.compression_figures as figures

    events: list[tuple[str, int]] = []
    launch = dist.all_reduce
    passes = ("compression_figures", "cast_figures", "all_finite", "nonfinite_counts")
    watched = {name: getattr(figures, name) for name in passes if hasattr(figures, name)}

    def note(kind: str) -> None:
        events.append((kind, threading.get_ident()))

    def launching(*args: Any, **kwargs: Any) -> Any:
        note("launch")
        return launch(*args, **kwargs)

    def watching(name: str) -> Any:
        return lambda *args, **kwargs: (note("figures"), watched[name](*args, **kwargs))[1]

    outcome: dict[str, Any] = {}
    for name, (hook, dtype, wrapper) in POISONED_HOOKS.items():
        sink = memory_sink()
        step = [0, 0]

        def poisoned(target: Any, slot: int) -> Any:
            def poisoning_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                note("call")
                if step[slot] == 2 and (rank, bucket.index()) == (0, 0):
                    bucket.buffer()[:3] = float("nan")
                    bucket.buffer()[10:14] = OVERFLOW[dtype]
                if step[slot] == 2 and (rank, bucket.index()) == (1, 1):
                    bucket.buffer()[20:25] = -OVERFLOW[dtype]
                if bucket.is_last():
                    step[slot] += 1
                return target(state, bucket)

            return poisoning_hook

        copies = BucketCopies(poisoned(sink.traced(hook, error_every=2), 0))
        events.clear()
        dist.all_reduce = launching
        for watched_name in watched:
            setattr(figures, watched_name, watching(watched_name))
        try:
            traced_params = train(rank, copies.hook, steps=3)
            # On the training thread, what each hook call does first (callbacks may run inline later).
            own = [kind for kind, thread in events if thread == threading.get_ident()]
        finally:
            dist.all_reduce = launch
            for watched_name, function in watched.items():
                setattr(figures, watched_name, function)
        assert flush(30)
        plain_params = train(rank, poisoned(passthrough(hook), 1), steps=3)
        spans = {(s[Attr.STEP], s[Attr.BUCKET_INDEX]): s for s in sink.spans(None)}
        labels = {"rank": str(rank), "hook": name}
        outcome[name] = {
            "bitwise equal": all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(traced_params, plain_params)),
            "after each call": {after for before, after in zip(own, own[1:]) if before == "call"},
            "created": {key: span[Attr.COMPRESSION_NONFINITE] for key, span in spans.items()},
            "already": {key: span[Attr.BUCKET_NONFINITE] for key, span in spans.items()},
            "errors": {key: span.get(Attr.COMPRESSION_RELATIVE_ERROR) for key, span in spans.items()},
            "expected errors": {
                key: expected_error(copies.copies[key], dtype, world_size, wrapper) for key in spans if key[0] != 1
            },
            "created metric": sink.sample("tensorplay_nonfinite_elements_total", **labels),
            "already metric": sink.sample("tensorplay_bucket_nonfinite_elements_total", **labels),
        }
    return outcome


@pytest.mark.parametrize("name", POISONED_HOOKS)
def test_nonfinite_counts_stay_exact_per_rank_and_bucket_off_the_launch_path(
    poisoned_outcome: list[dict], name: str
) -> None:
    poisoned_bucket = {0: (2, 0), 1: (2, 1)}
    expected = {0: (4, 3), 1: (5, 0)}  # (made by compression, already there) in the poisoned bucket
    for rank, outcome in enumerate(poisoned_outcome):
        result = outcome[name]
        assert result["bitwise equal"], f"rank {rank}: traced({name}) changed the gradients"
        assert result["after each call"] == {"launch"}, "a figure was computed before the bucket's collective was launched"
        for key, created in result["created"].items():
            counts = (created, result["already"][key])
            assert counts == (expected[rank] if key == poisoned_bucket[rank] else (0, 0)), (rank, key)
        assert (result["created metric"], result["already metric"]) == expected[rank]
        for key, error in result["errors"].items():
            if key[0] == 1 or key == poisoned_bucket[rank]:  # not sampled (error_every=2), or undefined
                assert error is None
            else:
                assert error == pytest.approx(result["expected errors"][key], rel=1e-5)


def _poisoned(rank: int, world_size: int) -> dict:
    """One launch of two ranks for both poisoned cases: float32 models, and models in the compression dtype."""
    return {**_poisoned_on_one_rank(rank, world_size), "low precision": _nan_in_a_low_precision_model(rank, world_size)}


@pytest.fixture(scope="module")
def poisoned_outcome() -> list[dict]:
    return run_ranks(_poisoned, 2)


# --- callbacks that wait on other futures, and models in the compression dtype --------------------


def _two_halves(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce the bucket in two halves with fp16_compress_hook; the first half's callback waits for the second."""
    buffer = bucket.buffer()
    half = buffer.numel() // 2
    first = default_hooks.fp16_compress_hook(state, (buffer[:half],))  # type: ignore[arg-type]
    second = default_hooks.fp16_compress_hook(state, (buffer[half:],))  # type: ignore[arg-type]
    return first.then(lambda _: (second.wait(), buffer)[1])


def _gated(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The first half's callback waits for a future that a callback of the second half completes."""
    buffer = bucket.buffer()
    half = buffer.numel() // 2
    gate: torch.futures.Future = torch.futures.Future()
    first = default_hooks.fp16_compress_hook(state, (buffer[:half],))  # type: ignore[arg-type]
    second = default_hooks.fp16_compress_hook(state, (buffer[half:],))  # type: ignore[arg-type]
    second.then(lambda _: gate.set_result(None))
    return first.then(lambda _: (gate.wait(), buffer)[1])


CALLBACK_PATTERNS = {"two halves": _two_halves, "gated": _gated}


def _callbacks_that_wait(rank: int, world_size: int) -> dict:
    """One gloo rank, where most collectives have completed by the time their hook chains on them."""
    outcome = {}
    for name, hook in CALLBACK_PATTERNS.items():
        metrics = TensorplayMetrics(CollectorRegistry())
        traced_params = train(rank, traced(passthrough(hook), error_every=1, metrics=metrics), steps=20)
        plain_params = train(rank, passthrough(hook), steps=20)
        outcome[name] = all(torch.equal(a, b) for a, b in zip(traced_params, plain_params))
    assert flush(30)
    return outcome


@pytest.mark.parametrize("name", CALLBACK_PATTERNS)
def test_a_callback_that_waits_for_another_future_trains_traced_as_untraced(name: str, waiting_callbacks: dict) -> None:
    assert waiting_callbacks[name], f"traced({name}) changed the parameters"


@pytest.fixture(scope="module")
def waiting_callbacks() -> dict:
    # A hang fails the launch after the timeout instead of stalling the suite.
    return run_ranks(_callbacks_that_wait, 1, timeout=120)[0]


LOW_PRECISION = {
    "fp16_compress_hook": (default_hooks.fp16_compress_hook, torch.float16),
    "bf16_compress_hook": (default_hooks.bf16_compress_hook, torch.bfloat16),
    "fp16_compress_wrapper(allreduce_hook)": (default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook), torch.float16),
    "bf16_compress_wrapper(allreduce_hook)": (default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook), torch.bfloat16),
}


def _nan_in_a_low_precision_model(rank: int, world_size: int) -> dict:
    """A model whose gradients already have the compression dtype: rank 0 puts 3 NaN in bucket 0 at step 1."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .training import make_model, rank_batch

    outcome = {}
    for name, (hook, dtype) in LOW_PRECISION.items():
        sink = memory_sink()
        step = [0]

        def poisoning(state: Any, bucket: dist.GradBucket, hook: Any = hook) -> torch.futures.Future[torch.Tensor]:
            if step[0] == 1 and rank == 0 and bucket.index() == 0:
                bucket.buffer()[:3] = float("nan")
            if bucket.is_last():
                step[0] += 1
            return hook(state, bucket)

        describe_hook(poisoning, name, reports_collectives(hook))
        model = DDP(make_model().to(dtype), bucket_cap_mb=0.3)
        model.register_comm_hook(None, sink.traced(poisoning, error_every=1))
        for index in range(3):
            model.zero_grad()
            model(rank_batch(rank, index).to(dtype)).float().square().mean().backward()
        assert flush(30)
        outcome[name] = {
            "spans": {(s[Attr.STEP], s[Attr.BUCKET_INDEX]): s[Attr.BUCKET_NONFINITE] for s in sink.spans(None)},
            "metric": sink.sample("tensorplay_bucket_nonfinite_elements_total", rank=str(rank), hook=name),
        }
    return outcome


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_a_low_precision_models_nan_is_counted_only_on_its_rank(poisoned_outcome: list[dict], name: str) -> None:
    for rank, outcome in enumerate(poisoned_outcome):
        result = outcome["low precision"][name]
        expected = 3 if rank == 0 else 0
        assert result["metric"] == expected, f"rank {rank}"
        assert result["spans"][(1, 0)] == expected, f"rank {rank}"
        assert sum(result["spans"].values()) == expected, f"rank {rank}: {result['spans']}"
