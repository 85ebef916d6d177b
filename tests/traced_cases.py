"""What traced hooks report, as the CPU tests and tests/test_cuda_path.py check it alike: the hooks
traced, the rank functions that train under them, and the checks of what those return.

Rank functions train the model ``training.make_model`` builds, on the device it builds it on.
"""

import gc
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from tensorplay.telemetry import flush
from tensorplay.telemetry.names import Attr
from tensorplay.telemetry.probe import describe_hook, hook_name, reports_collectives
from tensorplay.telemetry.recorder import BucketRecord

from . import training
from .sink import memory_sink
from .training import passthrough, train

__all__ = ["HOOKS", "STEP_COUNTERS", "user_hook", "BucketCopies", "expected_error", "spans_and_metrics",
           "check_gradients_equal_untraced", "check_metrics_agree_with_spans", "check_step_figures_agree_with_spans",
           "overflow", "traced_powersgd", "POWERSGD_CASES", "powersgd_poisoned_on_rank_0", "check_powersgd_poisoned",
           "live_records"]

HOOKS = {
    "allreduce_hook": (default_hooks.allreduce_hook, None),
    "fp16_compress_hook": (default_hooks.fp16_compress_hook, "float16"),
    "bf16_compress_hook": (default_hooks.bf16_compress_hook, "bfloat16"),
    "fp16_compress_wrapper(allreduce_hook)": (default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook), "float16"),
    "bf16_compress_wrapper(allreduce_hook)": (default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook), "bfloat16"),
    "noop_hook": (debugging_hooks.noop_hook, None),
}
STEP_COUNTERS = {
    "step_busy_seconds": Attr.STEP_BUSY_MS,
    "step_exposed_communication_seconds": Attr.STEP_EXPOSED_COMMUNICATION_MS,
    "step_communication_seconds": Attr.STEP_COMMUNICATION_MS,
    "steps": None,
}
"""The step counters of each traced hook (``tensorplay_<name>_total``) and the span attribute each sums."""
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def user_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A hook tensorplay knows nothing about."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


class BucketCopies:
    """Wraps a hook to keep a copy of every bucket as DDP handed it over, keyed by (step, index), and
    where each of its gradients lies in it: (offset, shape)."""

    def __init__(self, hook: Any) -> None:
        self.copies: dict[tuple[int, int], torch.Tensor] = {}
        self.layouts: dict[tuple[int, int], list[tuple[int, torch.Size]]] = {}
        self._step = 0

        def copying_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            self.copies[(self._step, bucket.index())] = buffer.clone()
            self.layouts[(self._step, bucket.index())] = [
                (gradient.storage_offset() - buffer.storage_offset(), gradient.shape) for gradient in bucket.gradients()
            ]
            if bucket.is_last():
                self._step += 1
            return hook(state, bucket)

        self.hook = copying_hook


def expected_error(copy: torch.Tensor, dtype: torch.dtype, world_size: int, wrapper: bool) -> float:
    """The relative error of casting ``copy`` (a bucket as DDP handed it over) to ``dtype``, as the hook divides it."""
    x = copy.double() if wrapper else copy.double() / world_size
    x_hat = copy.to(dtype).double() if wrapper else copy.to(dtype).div(world_size).double()
    return float((x - x_hat).norm() / x.norm())


def spans_and_metrics(rank: int, world_size: int) -> dict:
    """Train under every hook of HOOKS and ``user_hook``, traced at full fidelity, and untraced: {name: what was seen}."""
    outcome: dict[str, Any] = {}
    for name, (hook, compression) in [*HOOKS.items(), ("user_hook", (user_hook, None))]:
        sink = memory_sink()
        copies = BucketCopies(sink.traced(hook, error_every=1))
        traced_params = train(rank, copies.hook, steps=3)
        assert flush(30), "records still pending"
        plain_params = train(rank, passthrough(hook), steps=3)
        spans = sink.spans()
        errors = []
        for span in spans:
            if compression is not None:
                copy = copies.copies[(span[Attr.STEP], span[Attr.BUCKET_INDEX])]
                expected = expected_error(copy, DTYPES[compression], world_size, "wrapper" in name)
                errors.append((span[Attr.COMPRESSION_RELATIVE_ERROR], expected))
        registry = sink.metrics.registry
        labels = {"rank": str(rank), "hook": name}
        outcome[name] = {
            "equal": all(torch.equal(a, b) for a, b in zip(traced_params, plain_params)),
            "spans": spans,
            "errors": errors,
            "bucket_numels": {k: v.numel() for k, v in copies.copies.items()},
            "latency_count": registry.get_sample_value("tensorplay_allreduce_latency_seconds_count", labels),
            "bucket_bytes": registry.get_sample_value("tensorplay_bucket_bytes_total", labels),
            "wire_bytes": registry.get_sample_value("tensorplay_wire_bytes_total", labels),
            "error_count": registry.get_sample_value("tensorplay_compression_error_ratio_count", labels),
            "compute_count": registry.get_sample_value("tensorplay_step_compute_seconds_count", {"rank": str(rank)}),
            **{counter: registry.get_sample_value(f"tensorplay_{counter}_total", labels) for counter in STEP_COUNTERS},
            "last_step": registry.get_sample_value("tensorplay_last_step_timestamp_seconds", {"rank": str(rank)}),
        }
    return outcome


def check_gradients_equal_untraced(outcomes: list[dict], name: str) -> None:
    """Tracing ``name`` left every rank's gradients as they were (``outcomes``: spans_and_metrics per rank)."""
    for rank, outcome in enumerate(outcomes):
        assert outcome[name]["equal"], f"rank {rank}: traced({name}) changed the gradients"


def check_metrics_agree_with_spans(outcomes: list[dict], name: str) -> None:
    """Each rank's metrics of ``name`` count what its spans say."""
    for outcome in outcomes:
        result = outcome[name]
        spans = result["spans"]
        assert result["latency_count"] == len(spans)
        assert result["bucket_bytes"] == sum(s[Attr.BUCKET_BYTES] for s in spans)
        assert result["wire_bytes"] == sum(s[Attr.BUCKET_WIRE_BYTES] for s in spans)
        assert result["error_count"] == (len(spans) if HOOKS.get(name, (0, None))[1] else None)
        assert result["compute_count"] == 2  # steps 1 and 2 follow a completed step
        assert 1.7e9 < result["last_step"] < 4e9  # a unix time
        check_step_figures_agree_with_spans(result)


def check_step_figures_agree_with_spans(result: dict, resolution_ms: float = 1e-3) -> None:
    """One span closes each counted iteration (steps 1 and 2 of 3) and carries its step figures; the
    counters are their sums. Each single-collective call's latency interval lies within its
    iteration's communication, which the sum of the latencies bounds (``resolution_ms``: CUDA
    events' offsets from a common origin round to about a microsecond)."""
    spans = result["spans"]
    closing = [span for span in spans if Attr.STEP_BUSY_MS in span]
    assert sorted(span[Attr.STEP] for span in closing) == [1, 2] and result["steps"] == 2
    for counter, attribute in STEP_COUNTERS.items():
        if attribute is not None:
            assert result[counter] * 1e3 == pytest.approx(sum(span[attribute] for span in closing), rel=1e-9)
    for span in closing:
        latencies = [s[Attr.ALLREDUCE_LATENCY_MS] for s in spans if s[Attr.STEP] == span[Attr.STEP]]
        assert max(latencies) - resolution_ms <= span[Attr.STEP_COMMUNICATION_MS] <= sum(latencies) + resolution_ms
        assert span[Attr.STEP_BUSY_MS] > 0 and span[Attr.STEP_EXPOSED_COMMUNICATION_MS] >= 0


def overflow(rank: int, world_size: int) -> dict:
    """fp16 overflow: gradients above float16's range turn into inf when compressed."""
    sink = memory_sink()
    hook = default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
    copies = BucketCopies(sink.traced(hook))
    train(rank, copies.hook, steps=1, lr=0.0, seed=0, loss_scale=1e9)
    assert flush(30)
    spans = sink.spans(None)
    expected = {
        key: int((~torch.isfinite(copy.to(torch.float16))).sum() - (~torch.isfinite(copy)).sum())
        for key, copy in copies.copies.items()
    }
    return {
        "span": {(s[Attr.STEP], s[Attr.BUCKET_INDEX]): s[Attr.COMPRESSION_NONFINITE] for s in spans},
        "expected": expected,
        "metric": sink.sample("tensorplay_nonfinite_elements_total", rank=str(rank), hook="fp16_compress_wrapper(allreduce_hook)"),
    }


def traced_powersgd(rank: int, world_size: int) -> dict:
    """powerSGD_hook traced and untraced: parameters, spans, and each span's expected figure (its residual's)."""
    def run(hook: Any, traced_too: bool) -> tuple[list[torch.Tensor], list[dict], dict, dict]:
        sink = memory_sink()
        state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        inputs: dict[tuple[int, int], torch.Tensor] = {}  # (step, bucket) -> bucket + previous error
        residuals: dict[tuple[int, int], torch.Tensor] = {}
        step = [0]

        def observing_hook(st: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            previous = state.error_dict.get(bucket.index())
            buffer = bucket.buffer()
            inputs[(step[0], bucket.index())] = buffer.clone() + (previous if previous is not None else 0)
            return hook(st, bucket)

        describe_hook(observing_hook, hook_name(hook), reports_collectives(hook))
        model = DDP(training.make_model(), bucket_cap_mb=training.BUCKET_CAP_MB)
        model.register_comm_hook(
            state,
            traced(observing_hook, error_every=1, tracer_provider=sink.provider) if traced_too else passthrough(hook),
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step[0] in range(5):
            optimizer.zero_grad()
            model(training.rank_batch(rank, step[0])).square().mean().backward()
            optimizer.step()
            residuals.update({(step[0], index): error.clone() for index, error in state.error_dict.items()})
        flush(30)
        spans = sink.spans(None)
        return [p.detach().clone() for p in model.parameters()], spans, inputs, residuals

    hook = powerSGD_hook
    plain, _, _, _ = run(hook, traced_too=False)
    traced_params, spans, inputs, residuals = run(hook, traced_too=True)
    expected = {
        key: float(residuals[key].norm() / inputs[key].norm()) for key in inputs if key in residuals and key[0] >= 2
    }
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(plain, traced_params)),
        "spans": spans,
        "expected": expected,
    }


POWERSGD_CASES = [(True, 0), (True, 1), (False, 0), (False, 1)]
"""(error feedback, error_every): the hook keeps a copy of its input, or not, and samples the error, or not."""


def powersgd_poisoned_on_rank_0(rank: int, world_size: int) -> dict:
    """PowerSGD compresses from step 2 of 5; at step 3, 3 elements of a weight's gradient in rank 0's
    bucket 0 are NaN. No step is applied (as a GradScaler skips one with NaN gradients): the
    gradients of step 4 are clean, but PowerSGD's memory (error feedback, warm start) carries the
    NaN the group's result held."""
    outcome: dict[Any, Any] = {}
    for error_feedback, error_every in POWERSGD_CASES:
        sink = memory_sink()
        hook = sink.traced(powerSGD_hook, error_every=error_every)
        step = [0]
        returned: dict[tuple[int, int], int] = {}  # (step, bucket) -> non-finite elements of the averaged bucket

        def poisoning(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            key = (step[0], bucket.index())
            if key == (3, 0) and rank == 0:
                next(g for g in bucket.gradients() if g.dim() == 2).view(-1)[:3] = float("nan")
            if bucket.is_last():
                step[0] += 1

            def counted(done: torch.futures.Future) -> torch.Tensor:
                returned[key] = int((~torch.isfinite(done.value())).sum())
                return done.value()

            return hook(state, bucket).then(counted)

        model = DDP(training.make_model(), bucket_cap_mb=training.BUCKET_CAP_MB)
        model.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=2, use_error_feedback=error_feedback), poisoning)
        for index in range(5):
            model.zero_grad()
            model(training.rank_batch(rank, index)).square().mean().backward()
        assert flush(30)
        spans = {(s[Attr.STEP], s[Attr.BUCKET_INDEX]): s for s in sink.spans(None)}
        labels = {"rank": str(rank), "hook": "powerSGD_hook"}
        outcome[(error_feedback, error_every)] = {
            "arrived": {key: span.get(Attr.BUCKET_NONFINITE) for key, span in spans.items()},
            "made": {key: span.get(Attr.COMPRESSION_NONFINITE) for key, span in spans.items()},
            "returned": returned,
            "arrived metric": sink.sample("tensorplay_bucket_nonfinite_elements_total", **labels),
            "made metric": sink.sample("tensorplay_nonfinite_elements_total", **labels),
        }
    return outcome


def check_powersgd_poisoned(outcomes: list[dict], case: tuple[bool, int]) -> None:
    """What ``powersgd_poisoned_on_rank_0`` must find on each rank, for one of its cases."""
    for rank, outcome in enumerate(outcomes):
        result = outcome[case]
        arrived, made, returned = result["arrived"], result["made"], result["returned"]
        assert returned[(3, 0)] > 3 and returned[(4, 0)] > 0, "the NaN must reach every rank's result"
        for key in arrived:
            if key[0] < 2:  # plain averaging: nothing compressed
                assert (arrived[key], made[key]) == (None, 0), (rank, key)
            elif key[0] < 4:
                # Only rank 0's bucket held NaN; the group's result carried them to rank 1, whose
                # own input and compression were finite, and to rank 0, whose input explains them.
                assert arrived[key] == (3 if (rank, key) == (0, (3, 0)) else 0), (rank, key, arrived[key])
                assert made[key] == 0, (rank, key, made[key])
            else:
                # Clean gradients, but every rank's PowerSGD memory holds the NaN: its compression
                # makes them, on every rank (docs/telemetry.md, "Compression error, per hook").
                assert arrived[key] == 0, (rank, key, arrived[key])
                assert made[key] == returned[key], (rank, key, made[key], returned[key])
        assert result["arrived metric"] == (3 if rank == 0 else 0)
        assert result["made metric"] == returned[(4, 0)]


def live_records() -> int:
    """How many bucket records are alive in this process."""
    return sum(isinstance(o, BucketRecord) for o in gc.get_objects())
