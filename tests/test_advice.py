"""The compression advice, ``traced(hook, advise_every=N)``: what each candidate would make of this rank's gradients.

On real gloo ranks: the fp16/bf16 candidates are what ``traced(fp16_compress_hook)`` and
``traced(bf16_compress_hook)`` measure on the same gradients, bit for bit; the PowerSGD candidates
lie between the best rank-k approximation's error and the whole norm, and vanish on gradients of
rank 1; fp16 overflow is counted and bf16's is not; a float16 model; under a hook that does not
compress and under PowerSGD (whose error feedback rewrites the bucket), the advice is that of the
buckets as DDP handed them over; gradients and the user's random streams are left as they were.
Without ranks: the PowerSGD rule is powerSGD_hook's, an iteration is skipped rather than a second
one copied while the first is computed, nothing is kept after a flush, and the CUDA reading logic
with a stand-in event.
"""

import gc
import random
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay.analysis.span_reader import read_spans
from tensorplay.distributed.algorithms.join import Join
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _split_layers, powerSGD_hook
from tensorplay.telemetry import TensorplayMetrics, flush
from tensorplay.telemetry import advisor as advisor_module
from tensorplay.telemetry.advisor import Advisor, device_figures, figures_from, pooled_error, when_happened
from tensorplay.telemetry.candidate_figures import POWERSGD_RANKS, CandidateSums, bucket_sums, compresses
from tensorplay.telemetry.finish import OwnedSpan
from tensorplay.telemetry.model_identity import CallPlace, KnownBucket, ModelSteps
from tensorplay.telemetry.names import ADVICE_SPAN_NAME, HOOK_SPAN_NAME, Attr, Candidate
from tensorplay.telemetry.recorder import BucketLayout, BucketRecord
from tensorplay.telemetry.timing import Stamp
from tensorplay.telemetry.tracing import JsonLinesSpanExporter

from . import training
from .ranks import run_ranks
from .sink import memory_sink
from .traced_cases import BucketCopies, expected_error

WORLD_SIZE = 2
METRICS = {"error": "tensorplay_compression_candidate_error_ratio", "wire": "tensorplay_compression_candidate_wire_ratio",
           "nonfinite": "tensorplay_compression_candidate_nonfinite"}


def _one_bucket_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Two layers, 0.5 MB: under DDP's 1 MB first bucket, so every iteration is one bucket."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(training.WIDTH, training.WIDTH), nn.Linear(training.WIDTH, training.WIDTH)).to(dtype)


def _advised_run(rank: int, hook: Callable, model: nn.Module, *, state: Any = None, steps: int = 2, batch: int = 8,
                 advise_every: int = 1, loss_scale: float = 1.0, lr: float = 0.1) -> dict:
    """Train ``model`` under ``traced(hook, advise_every=...)``, flushing after every step (so every
    step in ``advise_every`` is advised: none waits for the previous one's advice)."""
    sink = memory_sink()
    copies = BucketCopies(sink.traced(hook, error_every=1, advise_every=advise_every))
    ddp = DDP(model, bucket_cap_mb=training.BUCKET_CAP_MB)
    ddp.register_comm_hook(state, copies.hook)
    dtype = next(model.parameters()).dtype
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    torch.manual_seed(7)
    random.seed(7)
    for step in range(steps):
        optimizer.zero_grad()
        (ddp(training.rank_batch(rank, step, batch).to(dtype)).square().mean() * loss_scale).backward()
        optimizer.step()
        assert flush(60), "advice or spans still pending"
    after = {"torch": torch.rand(4).tolist(), "random": random.random()}
    advice = {span[Attr.STEP]: span for span in sink.spans(ADVICE_SPAN_NAME)}
    labels = {"rank": str(rank)}
    gauges = {
        (figure, candidate): sink.sample(metric, **labels, hook=_name(hook), candidate=candidate)
        for figure, metric in METRICS.items() for candidate in Candidate.ALL
    }
    return {
        "advice": advice,
        "hook errors": {(s[Attr.STEP], s[Attr.BUCKET_INDEX]): s.get(Attr.COMPRESSION_RELATIVE_ERROR) for s in sink.spans()},
        "copies": copies.copies,
        "layouts": copies.layouts,
        "gauges": gauges,
        "random after": after,
        "params": [p.detach().clone() for p in ddp.parameters()],
        "copies alive": sum(type(o) is advisor_module._BucketCopy for o in gc.get_objects()),
    }


def _name(hook: Callable) -> str:
    from tensorplay.telemetry.probe import hook_name

    return hook_name(hook)


def _arithmetic_on_copies(result: dict, step: int) -> dict[str, tuple]:
    """The candidate figures :mod:`candidate_figures` makes of the copies of one step's buckets, pooled."""
    pooled = {name: [0.0, 0.0, 0, 0, 0] for name in Candidate.ALL}
    for key, copy in sorted(result["copies"].items()):
        if key[0] != step:
            continue
        for name, sums in bucket_sums(copy.clone(), result["layouts"][key], WORLD_SIZE).items():
            pooled[name][0] += sums.error_sq
            pooled[name][1] += sums.reference_sq
            pooled[name][2] += int(sums.nonfinite)
            pooled[name][3] += sums.wire_bytes
            pooled[name][4] += copy.numel() * copy.element_size()
    return {name: (pooled_error(e, r), wire / size, nonfinite) for name, (e, r, nonfinite, wire, size) in pooled.items()}


def _svd_bound(result: dict, step: int, rank: int) -> float:
    """The best rank-k approximation's pooled error (SVD) of one step's tensors that PowerSGD compresses at ``rank``."""
    error_sq, reference_sq = 0.0, 0.0
    for key, copy in result["copies"].items():
        if key[0] != step:
            continue
        reference_sq += float(copy.double().square().sum())
        for offset, shape in result["layouts"][key]:
            matrix = copy[offset : offset + shape.numel()].double().view(shape[0], -1)
            if compresses(*matrix.shape, rank):
                error_sq += float(torch.linalg.svdvals(matrix)[rank:].square().sum())
    return (error_sq / reference_sq) ** 0.5


def _advice_under_join(rank: int) -> list[int]:
    """Rank 0 runs out of inputs after 2 steps and shadows rank 1's last 2: the steps advised on this rank."""
    sink = memory_sink()
    ddp = DDP(training.make_model(), bucket_cap_mb=training.BUCKET_CAP_MB)
    ddp.register_comm_hook(None, sink.traced(default_hooks.allreduce_hook, advise_every=1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp]):
        for step in range(2 if rank == 0 else 4):
            optimizer.zero_grad()
            ddp(training.rank_batch(rank, step)).square().mean().backward()
            optimizer.step()
            assert flush(60)
    assert flush(60)
    return sorted(span[Attr.STEP] for span in sink.spans(ADVICE_SPAN_NAME))


def advice_cases(rank: int, world_size: int) -> dict:
    """Every ranked case, in one pair of ranks."""
    out: dict[str, Any] = {}
    for name, hook in (("fp16", default_hooks.fp16_compress_hook), ("bf16", default_hooks.bf16_compress_hook)):
        out[name] = _advised_run(rank, hook, _one_bucket_model())
    half = out["float16 model"] = _advised_run(rank, default_hooks.fp16_compress_hook, _one_bucket_model(torch.float16))
    half["bf16 expected"] = {step: expected_error(half["copies"][(step, 0)], torch.bfloat16, world_size, wrapper=False)
                             for step in (0, 1)}

    allreduce = _advised_run(rank, default_hooks.allreduce_hook, training.make_model())
    quiet = _advised_run(rank, default_hooks.allreduce_hook, training.make_model(), advise_every=0)
    untraced = training.train(rank, training.passthrough(default_hooks.allreduce_hook), steps=2)
    allreduce["equal to untraced"] = all(torch.equal(a, b) for a, b in zip(allreduce.pop("params"), untraced))
    allreduce["on copies"] = {step: _arithmetic_on_copies(allreduce, step) for step in (0, 1)}
    allreduce["svd"] = {name: _svd_bound(allreduce, 1, rank_k) for name, rank_k in POWERSGD_RANKS.items()}
    out["allreduce"], out["advise_every=0"] = allreduce, quiet
    out["rank one"] = _advised_run(rank, default_hooks.allreduce_hook, training.make_model(), batch=1)

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    powersgd = _advised_run(rank, powerSGD_hook, training.make_model(), state=state, steps=4)
    powersgd["on copies"] = {step: _arithmetic_on_copies(powersgd, step) for step in range(4)}
    out["powersgd"] = powersgd

    overflow = _advised_run(rank, default_hooks.allreduce_hook, training.make_model(), steps=1, lr=0.0, loss_scale=1e9)
    overflow["expected fp16"] = sum(
        int((~torch.isfinite(c.to(torch.float16).div_(world_size))).sum() - (~torch.isfinite(c)).sum())
        for c in overflow["copies"].values()
    )
    out["overflow"] = overflow
    out["join"] = {"advised steps": _advice_under_join(rank)}
    for result in out.values():  # what the tests read, as plain data
        for tensors in ("copies", "layouts", "params"):
            result.pop(tensors, None)
    return out


@pytest.fixture(scope="module")
def ranked() -> list[dict]:
    return run_ranks(advice_cases, WORLD_SIZE, timeout=600)


def _advice(span: dict, candidate: str) -> tuple[float | None, float, int]:
    return (span.get(Attr.ADVICE_ERROR_RATIO.format(candidate=candidate)), span[Attr.ADVICE_WIRE_RATIO.format(candidate=candidate)],
            span[Attr.ADVICE_NONFINITE.format(candidate=candidate)])


@pytest.mark.parametrize("case, candidate", [("fp16", Candidate.FP16), ("bf16", Candidate.BF16), ("float16 model", Candidate.FP16)])
def test_cast_candidates_equal_what_the_casting_hooks_measure_on_the_same_gradients(ranked: list[dict], case: str,
                                                                                     candidate: str) -> None:
    for result in ranked:
        run = result[case]
        assert sorted(run["advice"]) == [0, 1]
        for step, span in run["advice"].items():
            assert span[Attr.ADVICE_BUCKETS] == 1
            error, wire, nonfinite = _advice(span, candidate)
            assert error == run["hook errors"][(step, 0)]  # bit for bit: the same pass on the same bits
            assert wire == (1.0 if case == "float16 model" else 0.5) and nonfinite == 0
        assert run["gauges"][("error", candidate)] == _advice(run["advice"][1], candidate)[0]


def test_the_advice_of_a_float16_model(ranked: list[dict]) -> None:
    for result in ranked:
        run = result["float16 model"]
        for step, span in run["advice"].items():
            assert _advice(span, Candidate.FP16) == (0.0, 1.0, 0)  # the cast is the bucket itself
            bf16_error, bf16_wire, _ = _advice(span, Candidate.BF16)
            assert bf16_wire == 1.0 and bf16_error == pytest.approx(run["bf16 expected"][step], rel=1e-4)
            assert 1e-4 < bf16_error < 0.02  # bfloat16 keeps 3 fewer mantissa bits than float16
            for candidate in POWERSGD_RANKS:
                error, wire, nonfinite = _advice(span, candidate)
                assert 0 < error <= 1 and 0 < wire < 0.1 and nonfinite == 0


def test_powersgd_candidates_lie_between_the_best_rank_k_error_and_the_whole_norm(ranked: list[dict]) -> None:
    for result in ranked:
        run = result["allreduce"]
        span = run["advice"][1]
        errors = [_advice(span, candidate)[0] for candidate in POWERSGD_RANKS]
        for candidate, error in zip(POWERSGD_RANKS, errors):
            assert run["svd"][candidate] * (1 - 1e-4) <= error <= 1.0, (candidate, error, run["svd"][candidate])
        assert errors[0] > errors[1] > errors[2]  # the ranks share their first columns: more is better


def test_powersgd_candidates_vanish_on_gradients_of_rank_one(ranked: list[dict]) -> None:
    for result in ranked:
        for span in result["rank one"]["advice"].values():  # batch of one: every weight gradient is an outer product
            for candidate in POWERSGD_RANKS:
                # ~0 up to float32 products: P = M·q sums 256 terms, with cancellation where q is
                # nearly orthogonal to M's rows (1e-5 at worst here, against 0.3-0.9 at batch 8).
                assert _advice(span, candidate)[0] < 1e-4


@pytest.mark.parametrize("case", ["allreduce", "powersgd"])
def test_the_advice_is_of_the_buckets_as_ddp_handed_them_over(ranked: list[dict], case: str) -> None:
    # allreduce_hook divides the bucket in place before its collective, PowerSGD adds its error
    # feedback in place from its second compressing step (step 3): the advice must not see either.
    for result in ranked:
        run = result[case]
        assert sorted(run["advice"]) == sorted(run["on copies"])
        for step, span in run["advice"].items():
            assert {c: _advice(span, c) for c in Candidate.ALL} == run["on copies"][step]
        assert run["copies alive"] == 0, "bucket copies outlived the flush"


def test_the_advice_leaves_gradients_and_random_streams_as_they_were(ranked: list[dict]) -> None:
    for result in ranked:
        advised, quiet = result["allreduce"], result["advise_every=0"]
        assert advised["equal to untraced"]
        assert advised["random after"] == quiet["random after"]


def test_advise_every_0_records_nothing(ranked: list[dict]) -> None:
    for result in ranked:
        quiet = result["advise_every=0"]
        assert quiet["advice"] == {} and set(quiet["gauges"].values()) == {None}
        assert result["allreduce"]["gauges"][("wire", Candidate.FP16)] == 0.5  # where advised, the gauges exist


def test_iterations_shadowed_inside_join_are_not_advised(ranked: list[dict]) -> None:
    # Rank 0's steps 2 and 3 are rank 1's, shadowed; the advice thread was idle when they came.
    assert [result["join"]["advised steps"] for result in ranked] == [[0, 1], [0, 1, 2, 3]]


def test_fp16_overflow_is_counted_and_bf16_has_none(ranked: list[dict]) -> None:
    for result in ranked:
        run = result["overflow"]
        error, _, nonfinite = _advice(run["advice"][0], Candidate.FP16)
        assert nonfinite == run["expected fp16"] > 0
        assert error is None and run["gauges"][("error", Candidate.FP16)] == float("inf")
        assert run["gauges"][("nonfinite", Candidate.FP16)] == nonfinite
        assert _advice(run["advice"][0], Candidate.BF16)[2] == 0 == run["gauges"][("nonfinite", Candidate.BF16)]


# -- without ranks ------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_the_powersgd_candidates_compress_what_powersgd_hook_compresses(rank: int) -> None:
    shapes = [(256, 256), (256,), (10, 10), (8, 3, 3, 3), (3, 100), (40, 7), (1000, 9), (64, 1, 5, 5), ()]
    gradients = [torch.zeros(shape) for shape in shapes]
    state = PowerSGDState(process_group=None, matrix_approximation_rank=rank, use_error_feedback=False, warm_start=False)
    compressed, _ = _split_layers(state, gradients)
    expected = [tuple(matrix.shape) for matrix in compressed]
    ours = []
    for gradient in gradients:
        rows = gradient.shape[0] if gradient.dim() else 1
        if compresses(rows, gradient.numel() // rows, rank):
            ours.append((rows, gradient.numel() // rows))
    assert ours == expected and 0 < len(ours) < len(shapes)


class _Bucket:
    """What the advice reads of a GradBucket: its flat buffer and the gradients' views into it."""

    def __init__(self, shapes: list[tuple[int, ...]], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self._gradients = [torch.randn(shape, generator=generator) for shape in shapes]
        self._buffer = torch.cat([g.reshape(-1) for g in self._gradients])
        offsets = [0]
        for g in self._gradients:
            offsets.append(offsets[-1] + g.numel())
        self._views = [self._buffer[o : o + g.numel()].view(g.shape) for o, g in zip(offsets, self._gradients)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views


def _take(advisor: Advisor, metrics: TensorplayMetrics, model: ModelSteps, step: int, index: int, last: bool,
          tracer: Any = None) -> None:
    bucket = _Bucket([(64, 32), (64,)], seed=step * 10 + index)
    layout = BucketLayout(bucket.buffer())
    place = CallPlace(KnownBucket(model, index, last, layout), step, index == 0, None)
    record = BucketRecord(hook="allreduce_hook", reports_collectives=True, step=step, rank=0, world_size=2, bucket_index=index,
                          layout=layout, sample_error=False, span=OwnedSpan(), metrics=metrics, previous_step_end=None,
                          step_start=None)
    advisor.take(bucket, place, record, tracer)


def test_an_iteration_is_not_advised_while_the_previous_one_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real_sums = advisor_module.bucket_sums

    def gated(*args: Any) -> dict[str, CandidateSums]:
        assert gate.wait(30), "the test never opened the gate"
        return real_sums(*args)

    monkeypatch.setattr(advisor_module, "bucket_sums", gated)
    metrics = TensorplayMetrics(CollectorRegistry())
    advisor, model = Advisor(every=1), ModelSteps(0)
    _take(advisor, metrics, model, step=0, index=0, last=False)
    _take(advisor, metrics, model, step=0, index=1, last=True)
    _take(advisor, metrics, model, step=1, index=0, last=False)  # step 0 is still being computed
    _take(advisor, metrics, model, step=1, index=1, last=True)
    assert advisor.iterations_advised == 1
    assert not flush(0.2), "flush returned while an advised iteration was being computed"
    gate.set()
    assert flush(30)
    labels = {"rank": "0", "hook": "allreduce_hook", "candidate": Candidate.FP16}
    assert metrics.registry.get_sample_value(METRICS["wire"], labels) == 0.5
    _take(advisor, metrics, model, step=2, index=0, last=False)  # computed: the next one is advised
    _take(advisor, metrics, model, step=2, index=1, last=True)
    assert flush(30) and advisor.iterations_advised == 2
    gc.collect()
    assert sum(type(o) is advisor_module._BucketCopy for o in gc.get_objects()) == 0


def test_the_span_reader_reads_the_advice_span(tmp_path: Path) -> None:
    sink = memory_sink(JsonLinesSpanExporter(str(tmp_path / "spans-rank0.jsonl")))
    tracer = sink.provider.get_tracer("tensorplay")
    advisor, model = Advisor(every=1), ModelSteps(0)
    _take(advisor, sink.metrics, model, step=0, index=0, last=False, tracer=tracer)
    _take(advisor, sink.metrics, model, step=0, index=1, last=True, tracer=tracer)
    assert flush(30)
    hook_span = {Attr.HOOK: "allreduce_hook", Attr.RANK: 0, Attr.STEP: 0, Attr.BUCKET_INDEX: 0, Attr.BUCKET_BYTES: 8,
                 Attr.BUCKET_WIRE_BYTES: 8, Attr.COMPRESSION_NONFINITE: 0, Attr.ALLREDUCE_LATENCY_MS: 1.0}
    tracer.start_span(HOOK_SPAN_NAME, attributes=hook_span).end()  # a run's file holds hook spans too
    spans = read_spans(tmp_path)
    assert spans.problems == [] and len(spans.hooks) == 1
    (advice,) = spans.advice
    assert (advice.rank, advice.model, advice.step, advice.hook) == (0, 0, 0, "allreduce_hook")
    assert advice.bucket_bytes == 2 * (64 * 32 + 64) * 4 and advice.start_s <= advice.end_s
    for candidate in Candidate.ALL:
        labels = {"rank": "0", "hook": "allreduce_hook", "candidate": candidate}
        figures = [sink.sample(METRICS[figure], **labels) for figure in ("error", "wire", "nonfinite")]
        assert advice.candidates[candidate] == tuple(figures)


class _StandInEvent:
    """Stands in for a ``torch.cuda.Event`` that completes after a number of queries (it has no way to wait)."""

    def __init__(self, queries_until_done: int) -> None:
        self.left = queries_until_done

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_device_figures_are_read_once_their_event_happened_and_never_waited_for() -> None:
    sums = {name: CandidateSums(torch.tensor(0.25 * i), torch.tensor(4.0 + i), torch.tensor(i), 100 * i)
            for i, name in enumerate(Candidate.ALL)}
    packed = device_figures(sums)
    sleeps: list[float] = []
    when_happened(Stamp(0, 0, _StandInEvent(5)), sleep=sleeps.append)
    assert len(sleeps) == 5 and sleeps == sorted(sleeps) and sleeps[-1] > sleeps[0]
    read = figures_from(sums, packed.to("cpu", non_blocking=True).tolist())
    assert read == {name: [0.25 * i, 4.0 + i, float(i), 100 * i] for i, name in enumerate(Candidate.ALL)}


def test_pooled_error_says_what_is_undefined() -> None:
    assert pooled_error(0.0, 0.0) == 0.0  # all-zero gradients: nothing to lose
    assert pooled_error(1.0, 4.0) == 0.5
    assert pooled_error(float("inf"), 4.0) == float("inf")  # the candidate overflowed finite gradients
    nan = float("nan")
    assert pooled_error(nan, nan) != pooled_error(nan, nan)  # the gradients were not finite
    assert pooled_error(1.0, float("inf")) != pooled_error(1.0, float("inf"))
