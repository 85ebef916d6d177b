"""The CUDA path of traced hooks: timing from CUDA events, nothing synchronizes the device.

Runs only where a GPU and NCCL are present; on CPU machines it is skipped with that reason.
"""

import pytest
import torch
import torch.distributed as dist
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.telemetry import TensorplayMetrics, flush
from tensorplay.telemetry.names import Attr

from .ranks import free_port

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA GPU and NCCL; the CPU path is covered by test_traced.py",
)


def test_traced_hook_on_cuda_never_synchronizes_and_times_with_events() -> None:
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        metrics = TensorplayMetrics(CollectorRegistry())
        torch.manual_seed(0)
        model = DDP(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda(), bucket_cap_mb=4)
        hook = default_hooks.fp16_compress_hook
        model.register_comm_hook(None, traced(hook, error_every=1, metrics=metrics, tracer_provider=provider))
        batch = torch.randn(32, 1024, device="cuda")
        for _ in range(4):
            loss = model(batch).square().mean()
            torch.cuda.set_sync_debug_mode("error")  # any device synchronization on the hot path raises
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert flush(60)
        spans = [dict(s.attributes) for s in exporter.get_finished_spans()]
        assert spans and all(s[Attr.ALLREDUCE_LATENCY_MS] > 0 for s in spans)
        assert all(0 < s[Attr.COMPRESSION_RELATIVE_ERROR] < 0.05 for s in spans)
        assert all(s[Attr.COMPRESSION_NONFINITE] == 0 for s in spans)
        assert metrics.registry.get_sample_value(
            "tensorplay_step_compute_seconds_count", {"rank": "0"}
        ) == 3
    finally:
        dist.destroy_process_group()
