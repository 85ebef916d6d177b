"""The replica fingerprint's sample and hash, on CPU tensors (the CUDA copy is in test_cuda_path.py)."""

import pytest
import torch

from tensorplay.telemetry.fingerprint import SAMPLE_ELEMENTS, Sample, sample_indices, take_sample


def _fingerprint(parameters: list[torch.Tensor]) -> int:
    return take_sample(parameters, [sample_indices(p.numel(), p.device) for p in parameters]).value()


def test_the_sample_is_every_element_of_a_small_tensor_and_64_evenly_strided_ones_of_a_large_one() -> None:
    assert sample_indices(10).tolist() == list(range(10))
    assert sample_indices(SAMPLE_ELEMENTS).tolist() == list(range(SAMPLE_ELEMENTS))
    large = sample_indices(1000).tolist()
    assert large == [k * 1000 // 64 for k in range(64)] and large[0] == 0 and len(set(large)) == 64
    huge = sample_indices(10**12).tolist()  # no overflow: a trillion-element tensor's last index
    assert huge[-1] == 63 * 10**12 // 64


def test_equal_parameters_give_one_fingerprint_below_2_53_and_a_sampled_difference_another() -> None:
    torch.manual_seed(0)
    parameters = [torch.randn(300, 7), torch.randn(5), torch.randn(2, 3, 4).to(torch.bfloat16)]
    copies = [p.clone() for p in parameters]
    value = _fingerprint(parameters)
    assert value == _fingerprint(copies) and 0 <= value < 2**53
    sampled = sample_indices(parameters[0].numel())[5].item()
    copies[0].view(-1)[sampled] += 1e-6  # one sampled element, one ulp-sized change
    assert _fingerprint(copies) != value
    copies = [p.clone() for p in parameters]
    copies[2].view(-1)[0] = -copies[2].view(-1)[0]  # bfloat16: its own bits are hashed
    assert _fingerprint(copies) != value
    assert _fingerprint(list(reversed(parameters))) != value  # the order is part of it


def test_an_element_outside_the_sample_is_not_seen() -> None:
    """The documented limit: 64 elements per tensor. A divergence from gradients touches every element."""
    parameter = torch.zeros(1000)
    value = _fingerprint([parameter])
    parameter[1] = 1.0  # index 1 is not a multiple of 1000/64
    assert 1 not in sample_indices(1000).tolist() and _fingerprint([parameter]) == value


def test_a_strided_parameter_is_sampled_in_its_logical_order() -> None:
    torch.manual_seed(1)
    base = torch.randn(40, 30)
    transposed = base.t()
    assert not transposed.is_contiguous()
    assert _fingerprint([transposed]) == _fingerprint([transposed.contiguous()])


class _Event:
    """Stands in for a CUDA event: it has happened once the test says so."""

    def __init__(self) -> None:
        self.happened = False

    def query(self) -> bool:
        return self.happened


def test_a_sample_copied_by_a_device_is_ready_once_every_event_happened() -> None:
    chunks = take_sample([torch.arange(100.0)], [sample_indices(100)]).chunks
    events = [_Event(), _Event()]
    sample = Sample(chunks, events)
    assert not sample.ready()
    events[0].happened = True
    assert not sample.ready()
    events[1].happened = True
    assert sample.ready() and sample.value() == Sample(chunks).value()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_every_dtype_is_hashed_by_its_bytes(dtype: torch.dtype) -> None:
    values = (torch.arange(200) % 3).to(dtype)
    assert _fingerprint([values]) == _fingerprint([values.clone()])
