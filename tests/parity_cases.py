"""torch's gradients bit for bit: the comparisons of tensorplay's hooks with torch's that the CPU
tests and tests/test_cuda_path.py run alike (on the device ``training.make_model`` builds on).

torch 2.13's own PowerSGD hooks cannot run this model as is: ``powerSGD_hook`` launches
collectives from future callbacks, so with several buckets the ranks disagree on their order and
gloo hangs, and ``batched_powerSGD_hook`` asserts on its first compressing step. The references
therefore run torch's hooks one bucket at a time (:func:`_in_turn`), and the batched one with its
orthogonalization given the batch it expects (:func:`batched_orthogonalization`).
"""

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks as torch_debugging
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from tensorplay.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ours_powersgd
from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)

from . import training
from .training import count_buckets, passthrough, train

__all__ = ["PAIRS", "LAYER_CASES", "BATCHED_CASES", "compare_default_hooks", "compare_powersgd", "compare_case",
           "batched_orthogonalization"]

# (name, tensorplay hook, torch hook); bf16 names go through a pass-through, see training.py.
PAIRS = [
    ("allreduce_hook", default_hooks.allreduce_hook, torch_default.allreduce_hook),
    ("fp16_compress_hook", default_hooks.fp16_compress_hook, torch_default.fp16_compress_hook),
    ("bf16_compress_hook", passthrough(default_hooks.bf16_compress_hook), passthrough(torch_default.bf16_compress_hook)),
    (
        "fp16_compress_wrapper(allreduce_hook)",
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
        torch_default.fp16_compress_wrapper(torch_default.allreduce_hook),
    ),
    (
        "bf16_compress_wrapper(allreduce_hook)",
        passthrough(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)),
        passthrough(torch_default.bf16_compress_wrapper(torch_default.allreduce_hook)),
    ),
    ("noop_hook", debugging_hooks.noop_hook, torch_debugging.noop_hook),
]


def compare_default_hooks(rank: int, world_size: int) -> dict:
    """Each default hook of ours against torch's: {name: same parameters bit for bit}, and the bucket count."""
    report = {"buckets": count_buckets(rank)}
    for name, ours, theirs in PAIRS:
        mine = train(rank, ours)
        reference = train(rank, theirs)
        report[name] = all(torch.equal(a, b) for a, b in zip(mine, reference))
    no_hook = train(rank, None)
    with_hook = train(rank, default_hooks.allreduce_hook)
    if world_size & (world_size - 1) == 0:
        report["allreduce_hook == no hook"] = all(torch.equal(a, b) for a, b in zip(with_hook, no_hook))
    else:
        # Without a hook DDP multiplies by 1/world_size instead of dividing (torch's own
        # allreduce_hook differs from it the same way): equal to rounding, not bit for bit.
        report["allreduce_hook ~= no hook"] = all(
            torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(with_hook, no_hook)
        )
    # The compression must actually change something, or the comparison proves nothing.
    report["fp16 differs from fp32"] = not all(
        torch.equal(a, b) for a, b in zip(train(rank, default_hooks.fp16_compress_hook), no_hook)
    )
    return report


# name: (state arguments, training steps, wrapper); ours and torch's get the same of each.
LAYER_CASES: dict[str, tuple[dict, int, str]] = {
    "error feedback + warm start, rank 1": ({"start_powerSGD_iter": 2}, 10, ""),
    "neither, compressing from iteration 0": (
        {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0, "use_error_feedback": False, "warm_start": False},
        5,
        "",
    ),
    "rank 4 (QR), same shapes batched, epsilon": (
        {
            "matrix_approximation_rank": 4,
            "start_powerSGD_iter": 3,
            "warm_start": False,
            "batch_tensors_with_same_shape": True,
            "orthogonalization_epsilon": 1e-8,
            "random_seed": 7,
        },
        6,
        "",
    ),
    "warm start only, min_compression_rate 0.5": (
        {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2, "use_error_feedback": False, "min_compression_rate": 0.5},
        6,
        "",
    ),
    "fp16 wrapper": ({"start_powerSGD_iter": 2}, 6, "fp16"),
    "bf16 wrapper": ({"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}, 6, "bf16"),
}
BATCHED_CASES: dict[str, tuple[dict, int, str]] = {
    "error feedback + warm start, rank 1": ({"start_powerSGD_iter": 2}, 6, ""),
    "neither, rank 3 (QR)": (
        {"matrix_approximation_rank": 3, "start_powerSGD_iter": 1, "use_error_feedback": False, "warm_start": False},
        5,
        "",
    ),
    "fp16 wrapper": ({"start_powerSGD_iter": 2}, 5, "fp16"),
}


def _in_turn(hook: Callable) -> Callable:
    """Wait for each bucket's future before DDP moves on: torch's collectives then keep one order."""

    def powersgd_in_turn(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        future.wait()
        return future

    return powersgd_in_turn


@contextlib.contextmanager
def batched_orthogonalization() -> Iterator[None]:
    """Have torch's module hand its orthogonalization a batch of one where it passes a matrix."""
    orthogonalize = torch_powersgd._orthogonalize

    def orthogonalize_batch(matrices: torch.Tensor, epsilon: float = 0) -> None:
        orthogonalize(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    torch_powersgd._orthogonalize = orthogonalize_batch
    try:
        yield
    finally:
        torch_powersgd._orthogonalize = orthogonalize


def _wrap(hook: Callable, wrapper: str, wrappers: Any) -> Callable:
    if wrapper == "fp16":
        return wrappers.fp16_compress_wrapper(hook)
    if wrapper == "bf16":  # torch's DDP refuses the bf16 name on CPU builds
        return passthrough(wrappers.bf16_compress_wrapper(hook))
    return hook


def _jittered(hook: Callable, rank: int) -> Callable:
    """Delay every other hook call, differently on each rank, to shuffle collective timing."""

    def jittered_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if (bucket.index() + rank) % 2:
            time.sleep(0.003)
        return hook(state, bucket)

    return jittered_hook


def _same_state(ours: PowerSGDState, theirs: Any) -> bool:
    """Whether two states carry the same counters and per-bucket tensors."""
    if (ours.iter, ours.compression_stats()) != (theirs.iter, theirs.compression_stats()):
        return False
    for mine, reference in (
        (ours.error_dict, theirs.error_dict),
        (ours.p_memory_dict, theirs.p_memory_dict),
        (ours.q_memory_dict, theirs.q_memory_dict),
    ):
        if mine.keys() != reference.keys() or not all(torch.equal(mine[k], reference[k]) for k in mine):
            return False
    return True


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def compare_case(rank: int, hooks: tuple[Callable, Callable], case: tuple[dict, int, str], jitter: bool) -> bool:
    arguments, steps, wrapper = case
    ours_hook, torch_hook = hooks
    ours_state = PowerSGDState(None, **arguments)
    hook = _wrap(ours_hook, wrapper, default_hooks)
    mine = train(rank, _jittered(hook, rank) if jitter else hook, ours_state, steps=steps)
    torch_state = torch_powersgd.PowerSGDState(None, **arguments)
    reference = train(rank, _wrap(_in_turn(torch_hook), wrapper, torch_default), torch_state, steps=steps)
    compressed = ours_state.compression_stats()[0] > 1  # or the comparison proves little
    return compressed and _equal(mine, reference) and _same_state(ours_state, torch_state)


def _compare_waited(rank: int, hooks: tuple[Callable, Callable], case: tuple[dict, int, str]) -> bool:
    """Ours and torch's hook, each waited for inside the same wrapper: same parameters and state."""
    arguments, steps, _ = case
    ours_hook, torch_hook = hooks
    ours_state = PowerSGDState(None, **arguments)
    mine = train(rank, _in_turn(ours_hook), ours_state, steps=steps)
    torch_state = torch_powersgd.PowerSGDState(None, **arguments)
    reference = train(rank, _in_turn(torch_hook), torch_state, steps=steps)
    return ours_state.compression_stats()[0] > 1 and _equal(mine, reference) and _same_state(ours_state, torch_state)


def _train_finding_unused(rank: int, hook: Callable, state: Any, steps: int) -> list[torch.Tensor]:
    """Train with ``find_unused_parameters``: DDP then allreduces a map right after the last bucket."""
    model = DDP(training.make_model(), bucket_cap_mb=training.BUCKET_CAP_MB, find_unused_parameters=True)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        model(training.rank_batch(rank, step)).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _full_rank_is_allreduce(rank: int, hook: Callable) -> bool:
    """With a rank as large as the matrices, PowerSGD must reproduce plain averaging (to rounding)."""
    state = PowerSGDState(
        None,
        matrix_approximation_rank=100_000,
        start_powerSGD_iter=0,
        use_error_feedback=False,
        warm_start=False,
        min_compression_rate=0,
    )
    compressed = train(rank, hook, state, steps=4)
    averaged = train(rank, default_hooks.allreduce_hook, steps=4)
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(compressed, averaged))


@contextlib.contextmanager
def one_operation_changed() -> Iterator[None]:
    """Have tensorplay's Gram-Schmidt multiply by the reciprocal of each column's norm instead of dividing by it.

    One rounding step differs from torch's arithmetic: a comparison that cannot see this would
    prove nothing (the sentinel of :func:`compare_powersgd`).
    """

    def gram_schmidt_by_reciprocal(matrices: torch.Tensor, epsilon: float) -> None:
        columns = matrices.shape[2]
        for i in range(columns):
            column = matrices[:, :, i : i + 1]
            column *= 1 / (torch.norm(column, dim=1, keepdim=True) + epsilon)
            if i + 1 < columns:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(column * rest, dim=1, keepdim=True) * column

    original = ours_powersgd._gram_schmidt
    ours_powersgd._gram_schmidt = gram_schmidt_by_reciprocal
    try:
        yield
    finally:
        ours_powersgd._gram_schmidt = original


def compare_powersgd(rank: int, world_size: int, full: bool) -> dict[str, Any]:
    """Both PowerSGD hooks of ours against torch's on the cases above (all of them if ``full``)."""
    report: dict[str, Any] = {"buckets": count_buckets(rank)}
    layer_hooks = (powerSGD_hook, torch_powersgd.powerSGD_hook)
    batched_hooks = (batched_powerSGD_hook, torch_powersgd.batched_powerSGD_hook)
    layer_cases = LAYER_CASES if full else dict(list(LAYER_CASES.items())[:3])
    batched_cases = BATCHED_CASES if full else dict(list(BATCHED_CASES.items())[:1])
    for name, case in layer_cases.items():
        report[f"powerSGD_hook: {name}"] = compare_case(rank, layer_hooks, case, jitter=False)
    with batched_orthogonalization():
        for name, case in batched_cases.items():
            report[f"batched_powerSGD_hook: {name}"] = compare_case(rank, batched_hooks, case, jitter=False)
    # A wrapper that waits for the future inside the hook, as torch's tests and timing wrappers do:
    # each future must complete without the next hook call (it used to hang here).
    report["powerSGD_hook: waited inside a wrapper"] = _compare_waited(rank, layer_hooks, LAYER_CASES["error feedback + warm start, rank 1"])
    with batched_orthogonalization():
        report["batched_powerSGD_hook: waited inside a wrapper"] = _compare_waited(
            rank, batched_hooks, BATCHED_CASES["error feedback + warm start, rank 1"]
        )
    with one_operation_changed():
        report["a changed operation differs from torch"] = not compare_case(
            rank, layer_hooks, LAYER_CASES["error feedback + warm start, rank 1"], jitter=False
        )
    if full:
        report["powerSGD_hook: jittered timing"] = compare_case(
            rank, layer_hooks, LAYER_CASES["error feedback + warm start, rank 1"], jitter=True
        )
        arguments = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
        mine = _train_finding_unused(rank, powerSGD_hook, PowerSGDState(None, **arguments), steps=5)
        reference = _train_finding_unused(
            rank, _in_turn(torch_powersgd.powerSGD_hook), torch_powersgd.PowerSGDState(None, **arguments), steps=5
        )
        report["powerSGD_hook: find_unused_parameters"] = _equal(mine, reference)
        report["powerSGD_hook: full rank == allreduce"] = _full_rank_is_allreduce(rank, powerSGD_hook)
        report["batched_powerSGD_hook: full rank == allreduce"] = _full_rank_is_allreduce(rank, batched_powerSGD_hook)
    return report
