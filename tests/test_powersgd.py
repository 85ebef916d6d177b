"""tensorplay's PowerSGD hooks: torch's gradients bit for bit, any number of buckets, observable.

The comparisons with torch's hooks (and why torch's run one bucket at a time) are
tests/parity_cases.py's, shared with tests/test_cuda_path.py.
"""

import math
import pickle
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.overrides import TorchFunctionMode

from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)
from tensorplay.telemetry.probe import hook_name, install_recorder, uninstall_recorder

from .parity_cases import compare_powersgd
from .ranks import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_hooks_equal_torch_bit_for_bit_on_many_buckets(world_size: int) -> None:
    reports = run_ranks(compare_powersgd, world_size, world_size == 2, timeout=150)
    for rank, report in enumerate(reports):
        assert report.pop("buckets") >= 3, f"rank {rank}: the model must span several buckets"
        failed = [name for name, ok in report.items() if not ok]
        assert not failed, f"rank {rank}: differs from torch: {failed}"


# -- direct calls with hand-made buckets: what the probe receives, pickling --


class _Bucket:
    """Just enough of a GradBucket: a flat buffer holding gradients of the given shapes."""

    def __init__(self, index: int, count: int, shapes: list[tuple[int, ...]], seed: int, dtype: torch.dtype = torch.float32) -> None:
        self._index, self._count, self._shapes = index, count, shapes
        generator = torch.Generator().manual_seed(seed)
        self._buffer = torch.randn(sum(math.prod(s) for s in shapes), generator=generator).to(dtype)

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for shape in self._shapes:
            views.append(self._buffer[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        return views


# Bucket 0: a 32x16 weight (compressed: P 32, Q 16), its bias (uncompressed), a 16x16 weight
# (P 16, Q 16). Bucket 1: a 24x24 weight (P 24, Q 24).
SHAPES = [[(32, 16), (32,), (16, 16)], [(24, 24)]]
P_NUMEL, Q_NUMEL, UNCOMPRESSED_NUMEL = [48, 24], [32, 24], [32, 0]


class _Recorder:
    """A HookRecorder that keeps copies of everything it is told."""

    def __init__(self, wants_error: bool) -> None:
        self.wants_error = wants_error
        self.launched: list[int] = []
        self.watched: list[bool] = []
        self.inputs: list[torch.Tensor] = []
        self.compressions: list[dict[str, Any]] = []

    def collective_launching(self, tensor: torch.Tensor, watch_nonfinite: bool = False) -> Any:
        self.launched.append(tensor.numel())
        self.watched.append(watch_nonfinite)
        return len(self.launched)

    def collective_launched(self, token: Any, future: torch.futures.Future) -> torch.futures.Future:
        assert token == len(self.launched)
        return future

    def wants_compression_error(self) -> bool:
        return self.wants_error

    def compression_input(self, kind: str, tensor: torch.Tensor) -> None:
        self.inputs.append(_copy(tensor))

    def compression(
        self,
        kind: str,
        original: Optional[torch.Tensor],
        approximation: Optional[torch.Tensor] = None,
        *,
        scale: float = 1.0,
        residual: Optional[torch.Tensor] = None,
        carried: Optional[torch.Tensor] = None,
        reduced: bool = False,
    ) -> None:
        figure = None if residual is None else (residual.norm() / original.norm()).item()
        self.compressions.append(
            {
                "kind": kind, "original": _copy(original), "approximation": _copy(approximation),
                "residual": _copy(residual), "carried": _copy(carried), "reduced": reduced, "figure": figure,
            }
        )


def _copy(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # Not clone(): _CountClones counts the hook's copies, not ours.
    return None if tensor is None else torch.empty_like(tensor).copy_(tensor)


class _CountClones(TorchFunctionMode):
    """Count tensor copies made on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.clones = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.clone, torch.clone):
            self.clones += 1
        return func(*args, **(kwargs or {}))


def _call(hook: Callable, state: PowerSGDState, bucket: _Bucket, recorder: Optional[_Recorder]) -> tuple[torch.futures.Future, int]:
    """Call ``hook`` as a traced hook would (recorder installed) and count the copies it made."""
    token = install_recorder(recorder) if recorder is not None else None
    try:
        with _CountClones() as counter:
            future = hook(state, bucket)
    finally:
        if token is not None:
            uninstall_recorder(token)
    return future, counter.clones


def _iteration(rank: int, step: int, hook: Callable, state: PowerSGDState, wants_error: Optional[bool]) -> dict[str, Any]:
    """Run both buckets of one iteration; return per bucket its input, result, recorder, copies."""
    out: dict[str, Any] = {"inputs": [], "recorders": [], "clones": [], "previous launched once next called": []}
    futures = []
    for index, shapes in enumerate(SHAPES):
        bucket = _Bucket(index, len(SHAPES), shapes, seed=100 * rank + 10 * step + index)
        recorder = None if wants_error is None else _Recorder(wants_error)
        out["inputs"].append(bucket.buffer().clone())
        future, clones = _call(hook, state, bucket, recorder)
        if out["recorders"] and out["recorders"][-1] is not None:
            out["previous launched once next called"].append(list(out["recorders"][-1].launched))
        futures.append(future)
        out["recorders"].append(recorder)
        out["clones"].append(clones)
    out["results"] = [f.wait().clone() for f in futures]
    return out


def _check_error_feedback_reports(rank: int, facts: dict[str, Any]) -> None:
    state = PowerSGDState(None, start_powerSGD_iter=2)
    for step in range(2):
        it = _iteration(rank, step, powerSGD_hook, state, wants_error=False)
        facts[f"iteration {step} plain allreduce"] = all(
            r.launched == [i.numel()] and r.watched == [False] and not r.compressions and not r.inputs
            for r, i in zip(it["recorders"], it["inputs"])
        )
    errors_before: dict[int, torch.Tensor] = {}
    for step in (2, 3):
        errors_before = {k: v.clone() for k, v in state.error_dict.items()}
        it = _iteration(rank, step, powerSGD_hook, state, wants_error=False)
        expected = [[n for n in (u, p, q) if n] for u, p, q in zip(UNCOMPRESSED_NUMEL, P_NUMEL, Q_NUMEL)]
        facts[f"iteration {step} collectives"] = [r.launched for r in it["recorders"]] == expected
        facts[f"iteration {step} collectives watched"] = all(r.watched and all(r.watched) for r in it["recorders"])
        # What the hook guarantees, unlike whether bucket 0's future is still pending then (a race):
        # a hook call launches nothing before the previous bucket's second round is out.
        facts[f"iteration {step} bucket 0's rounds are out once bucket 1's call returns"] = (
            it["previous launched once next called"] == [expected[0]]
        )
        reports = [r.compressions for r in it["recorders"]]
        facts[f"iteration {step} one report per bucket"] = all(len(c) == 1 and c[0]["kind"] == "powersgd" for c in reports)
        for index, (report,) in enumerate(reports):
            previous = errors_before.get(index, torch.zeros_like(it["inputs"][index]))
            facts[f"iteration {step} bucket {index} original"] = torch.equal(report["original"], it["inputs"][index] + previous)
            facts[f"iteration {step} bucket {index} carried"] = torch.equal(report["carried"], previous) and report["reduced"]
            facts[f"iteration {step} bucket {index} approximation"] = torch.equal(report["approximation"], it["results"][index])
            facts[f"iteration {step} bucket {index} residual"] = torch.equal(
                report["residual"], state.error_dict[index]
            ) and torch.equal(report["residual"], report["original"] - report["approximation"])
            direct = ((report["original"] - report["approximation"]).norm() / report["original"].norm()).item()
            facts[f"iteration {step} bucket {index} figure"] = 0 < report["figure"] < 10 and math.isclose(
                report["figure"], direct, rel_tol=1e-6
            )
        facts[f"iteration {step} error feedback copies once"] = it["clones"] == [1, 1]
    _check_pickling(rank, state, facts)


def _check_sampling(rank: int, facts: dict[str, Any]) -> None:
    arguments = {"start_powerSGD_iter": 0, "use_error_feedback": False, "warm_start": False}
    for label, wants in (("no recorder", None), ("error not sampled", False), ("error sampled", True)):
        it = _iteration(rank, 0, powerSGD_hook, PowerSGDState(None, **arguments), wants_error=wants)
        facts[f"{label}: copies"] = it["clones"] == ([1, 1] if wants else [0, 0])
        if wants is None:
            continue
        reports = [r.compressions for r in it["recorders"]]
        facts[f"{label}: one report per bucket"] = all(len(c) == 1 and c[0]["residual"] is None for c in reports)
        for index, ((report,), recorder) in enumerate(zip(reports, it["recorders"])):
            facts[f"{label}: bucket {index} result"] = torch.equal(report["approximation"], it["results"][index])
            if wants:
                facts[f"{label}: bucket {index} input copied"] = torch.equal(report["original"], it["inputs"][index])
            else:  # no copy: the input is reported before decompression overwrites it
                facts[f"{label}: bucket {index} input reported"] = report["original"] is None and len(recorder.inputs) == 1
                facts[f"{label}: bucket {index} input as handed over"] = torch.equal(recorder.inputs[0], it["inputs"][index])


def _check_batched_reports(rank: int, facts: dict[str, Any]) -> None:
    state = PowerSGDState(None, start_powerSGD_iter=2)
    for step in range(3):
        it = _iteration(rank, step, batched_powerSGD_hook, state, wants_error=False)
    for index, ((report,), recorder) in enumerate(zip((r.compressions for r in it["recorders"]), it["recorders"])):
        length = it["inputs"][index].numel()
        side = math.ceil(math.sqrt(length))
        facts[f"batched bucket {index} collectives"] = recorder.launched == [side, side]
        facts[f"batched bucket {index} padded original"] = report["original"].numel() == side * side and torch.equal(
            report["original"][:length], it["inputs"][index]
        )
        facts[f"batched bucket {index} result"] = torch.equal(report["approximation"][:length], it["results"][index])
        facts[f"batched bucket {index} residual"] = torch.equal(
            report["residual"], report["original"] - report["approximation"]
        ) and torch.equal(report["residual"], state.error_dict[index])


def _check_pickling(rank: int, state: PowerSGDState, facts: dict[str, Any]) -> None:
    """Pickle ``state`` while a bucket's second round is still pending, then finish the iteration."""
    first = _Bucket(0, len(SHAPES), SHAPES[0], seed=rank)
    pending = powerSGD_hook(state, first)
    blob = pickle.dumps(state)
    last = _Bucket(1, len(SHAPES), SHAPES[1], seed=rank)
    powerSGD_hook(state, last).wait()
    pending.wait()
    restored = pickle.loads(blob)
    facts["pickle: no process group or pending work"] = not {"process_group", "_second_round"} & set(state.__getstate__())
    facts["pickle: torch's checkpoint keys"] = set(state.__getstate__()) == set(
        torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2).__getstate__()
    )
    facts["pickle: default group"] = restored.process_group is dist.distributed_c10d._get_default_group()
    facts["pickle: hyperparameters"] = all(
        getattr(restored, name) == getattr(state, name)
        for name in ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "use_error_feedback", "warm_start")
    )
    facts["pickle: iteration"] = restored.iter == state.iter - 1
    copy = pickle.loads(blob)
    facts["pickle: random stream"] = restored.rng.randint(1000) == copy.rng.randint(1000)
    facts["pickle: restored state trains on"] = _resumes(rank, restored)


def _resumes(rank: int, state: PowerSGDState) -> bool:
    """One more iteration with a restored state, through the whole two-round path."""
    futures = [powerSGD_hook(state, _Bucket(i, len(SHAPES), shapes, seed=rank + 50)) for i, shapes in enumerate(SHAPES)]
    return all(torch.isfinite(f.wait()).all().item() for f in futures)


def _probe_and_pickle(rank: int, world_size: int) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    _check_error_feedback_reports(rank, facts)
    _check_sampling(rank, facts)
    _check_batched_reports(rank, facts)
    return facts


def test_probe_reports_and_pickling() -> None:
    for rank, facts in enumerate(run_ranks(_probe_and_pickle, 2, timeout=90)):
        failed = [name for name, ok in facts.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


# -- argument checks: no process group needed --


def test_hooks_reject_a_state_that_is_not_ours() -> None:
    bucket = _Bucket(0, 1, [(4, 4)], seed=0)
    with pytest.raises(TypeError, match="powerSGD_hook: state must be a tensorplay PowerSGDState.*NoneType"):
        powerSGD_hook(None, bucket)
    torch_state = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=10)
    with pytest.raises(TypeError, match="batched_powerSGD_hook: .*torch.distributed.algorithms.ddp_comm_hooks"):
        batched_powerSGD_hook(torch_state, bucket)


def test_hooks_reject_an_integer_bucket() -> None:
    bucket = _Bucket(0, 1, [(4, 4)], seed=0, dtype=torch.int64)
    with pytest.raises(ValueError, match="powerSGD_hook: cannot handle a bucket of dtype torch.int64"):
        powerSGD_hook(PowerSGDState(None, start_powerSGD_iter=10), bucket)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"matrix_approximation_rank": 0}, ValueError, "matrix_approximation_rank must be at least 1, got 0"),
        ({"matrix_approximation_rank": 1.5}, TypeError, "matrix_approximation_rank must be an int, got float"),
        ({"start_powerSGD_iter": -1, "use_error_feedback": False, "warm_start": False}, ValueError, "start_powerSGD_iter must be at least 0"),
        ({"start_powerSGD_iter": 1}, ValueError, "start_powerSGD_iter must be at least 2 when use_error_feedback or warm_start"),
        ({"start_powerSGD_iter": 0, "use_error_feedback": False}, ValueError, "start_powerSGD_iter must be at least 2 when"),
        ({"min_compression_rate": -1}, ValueError, "min_compression_rate must be a non-negative number, got -1"),
        ({"orthogonalization_epsilon": float("nan")}, ValueError, "orthogonalization_epsilon must be a non-negative"),
        ({"orthogonalization_epsilon": "1e-8"}, TypeError, "orthogonalization_epsilon must be a number, got str"),
        ({"process_group": "world"}, TypeError, "process_group must be a torch.distributed.ProcessGroup or None"),
    ],
)
def test_state_rejects_bad_arguments(arguments: dict, error: type, message: str) -> None:
    arguments = {"process_group": None, **arguments}
    with pytest.raises(error, match=f"PowerSGDState: {message}"):
        PowerSGDState(**arguments)


def test_state_without_error_feedback_or_warm_start_may_start_at_once() -> None:
    state = PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)
    assert state.compression_stats() == (0, 0, 0)


def test_hooks_keep_torch_names_and_are_described() -> None:
    assert powerSGD_hook.__name__ == "powerSGD_hook"
    assert hook_name(batched_powerSGD_hook) == "batched_powerSGD_hook"
    assert hook_name(default_hooks.bf16_compress_wrapper(powerSGD_hook)) == "bf16_compress_wrapper(powerSGD_hook)"
