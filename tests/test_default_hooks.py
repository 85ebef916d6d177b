"""tensorplay's default hooks give torch's gradients bit for bit, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks

from .parity_cases import compare_default_hooks
from .ranks import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_hooks_equal_torch_bit_for_bit(world_size: int) -> None:
    reports = run_ranks(compare_default_hooks, world_size)
    for rank, report in enumerate(reports):
        assert report.pop("buckets") >= 3, f"rank {rank}: the model must span several buckets"
        failed = [name for name, equal in report.items() if not equal]
        assert not failed, f"rank {rank}: differs from torch: {failed}"


def test_wrapper_rejects_what_is_not_a_hook() -> None:
    with pytest.raises(TypeError, match="fp16_compress_wrapper.*communication hook"):
        default_hooks.fp16_compress_wrapper(42)
    with pytest.raises(TypeError, match="bf16_compress_wrapper.*must accept \\(state, bucket\\)"):
        default_hooks.bf16_compress_wrapper(lambda bucket: bucket)


class _FakeBucket:
    """Just enough of a GradBucket for argument checks that fail before any collective."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor


def test_hook_rejects_a_state_of_the_wrong_type() -> None:
    bucket = _FakeBucket(torch.ones(4))
    with pytest.raises(TypeError, match="fp16_compress_hook: state must be a torch.distributed.ProcessGroup or None.*dict"):
        default_hooks.fp16_compress_hook({"not": "a group"}, bucket)
    with pytest.raises(TypeError, match="allreduce_hook: state must be"):
        default_hooks.allreduce_hook("world", bucket)


def _integer_bucket(rank: int, world_size: int) -> str:
    bucket = _FakeBucket(torch.ones(4, dtype=torch.int64))
    try:
        default_hooks.bf16_compress_hook(None, bucket)
    except ValueError as error:
        return str(error)
    return "no error"


def test_hook_rejects_a_bucket_dtype_it_cannot_handle() -> None:
    (message,) = run_ranks(_integer_bucket, 1)
    assert "bf16_compress_hook: cannot handle a bucket of dtype torch.int64" in message


def test_wrappers_keep_torch_names_and_compose_display_names() -> None:
    from tensorplay.telemetry.probe import hook_name

    wrapped = default_hooks.bf16_compress_wrapper(default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook))
    assert wrapped.__name__ == "bf16_compress_wrapper_hook"
    assert hook_name(wrapped) == "bf16_compress_wrapper(fp16_compress_wrapper(allreduce_hook))"
    assert hook_name(default_hooks.fp16_compress_hook) == "fp16_compress_hook"


def _registry_matches_torch(rank: int, world_size: int) -> dict:
    from torch.distributed.algorithms import ddp_comm_hooks as torch_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tensorplay.distributed.algorithms import ddp_comm_hooks as our_hooks

    from .training import BUCKET_CAP_MB, make_model, rank_batch

    def trained(module: object, member: str) -> object:
        model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        try:
            module.register_ddp_comm_hook(getattr(module.DDPCommHookType, member), model, None)
        except TypeError as error:  # torch's DDP refuses bf16 hooks without CUDA/NCCL
            return f"TypeError: {error}"
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            optimizer.zero_grad()
            model(rank_batch(rank, step)).square().mean().backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    report = {}
    for member in our_hooks.DDPCommHookType.__members__:
        ours, theirs = trained(our_hooks, member), trained(torch_hooks, member)
        if isinstance(ours, str) or isinstance(theirs, str):
            report[member] = ours == theirs
        else:
            report[member] = all(torch.equal(a, b) for a, b in zip(ours, theirs))
    return report


def test_register_ddp_comm_hook_matches_torch_for_every_type() -> None:
    for report in run_ranks(_registry_matches_torch, 2):
        assert set(report) == {
            "ALLREDUCE", "FP16_COMPRESS", "BF16_COMPRESS", "POWER_SGD", "POWER_SGD_RANK2",
            "BATCHED_POWER_SGD", "BATCHED_POWER_SGD_RANK2", "NOOP",
        }
        assert all(report.values()), report


def test_register_ddp_comm_hook_rejects_what_is_not_a_type() -> None:
    from tensorplay.distributed.algorithms.ddp_comm_hooks import register_ddp_comm_hook

    with pytest.raises(TypeError, match="comm_hook_type must be a DDPCommHookType"):
        register_ddp_comm_hook("ALLREDUCE", None)
