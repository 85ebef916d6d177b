"""Join's per-rank timing as Prometheus serves it: read over HTTP from every rank's /metrics."""

import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.distributed.algorithms.join import Join
from tensorplay.telemetry import enable_metrics, flush

from .ranks import free_base_port, run_ranks
from .sink import memory_sink
from .training import BUCKET_CAP_MB, make_model, rank_batch

BASE_INPUTS = 4
OFFSET = 3  # rank r trains on BASE_INPUTS + r * OFFSET batches


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def _uneven_training(rank: int, world_size: int, base_port: int) -> dict:
    enable_metrics(port=base_port, addr="127.0.0.1")
    model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    model.register_comm_hook(None, traced(default_hooks.allreduce_hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    started = time.time()
    for context in range(2):  # two Join contexts: the counter counts both
        with Join([model]):
            for step in range(BASE_INPUTS + rank * OFFSET):
                optimizer.zero_grad()
                model(rank_batch(rank, step)).square().mean().backward()
                optimizer.step()
    flush(30)
    samples = _samples(f"http://127.0.0.1:{base_port + rank}/metrics")
    return {"samples": samples, "started": started, "ended": time.time()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_timing_served_per_rank(world_size: int) -> None:
    base = free_base_port(world_size)
    outcomes = run_ranks(_uneven_training, world_size, base)
    most = BASE_INPUTS + (world_size - 1) * OFFSET
    joined_at = []
    for rank, outcome in enumerate(outcomes):
        samples = outcome["samples"]
        label = (("rank", str(rank)),)
        own = BASE_INPUTS + rank * OFFSET
        assert samples[("tensorplay_join_shadow_iterations", label)] == most - own
        assert samples[("tensorplay_join_last_joiner", label)] == (1.0 if own == most else 0.0)
        assert samples[("tensorplay_joins_total", label)] == 2
        assert samples[("tensorplay_join_wait_seconds_count", label)] == 2
        joined = samples[("tensorplay_join_timestamp_seconds", label)]
        assert outcome["started"] <= joined <= outcome["ended"]
        joined_at.append(joined)
        # Shadowed iterations are not this rank's own work: one compute observation per own
        # iteration that follows a completed one, in each of the two contexts.
        assert samples[("tensorplay_step_compute_seconds_count", label)] == 2 * own - 1
        # The end-of-step wait counts the same steps: its own, after the first (which has no
        # previous step to start from); never the shadowed ones, where it waits for its peers.
        hooked = (("hook", "allreduce_hook"), *label)
        assert samples[("tensorplay_steps_total", hooked)] == 2 * own - 1
        waited, stepped = samples[("tensorplay_step_wait_seconds_total", hooked)], samples[("tensorplay_step_seconds_total", hooked)]
        assert 0 < waited < stepped < outcome["ended"] - outcome["started"]
        # Busy time and exposed communication over the same steps: each step lies between its busy
        # time and its busy time plus exposed communication, so the sums do too.
        busy = samples[("tensorplay_step_busy_seconds_total", hooked)]
        exposed = samples[("tensorplay_step_exposed_communication_seconds_total", hooked)]
        assert 0 < busy <= stepped <= busy + exposed
    assert joined_at == sorted(joined_at), "ranks with fewer inputs join first"


def _join_span(rank: int, world_size: int) -> dict:
    """An application that set up the OpenTelemetry SDK itself gets a join span per rank."""
    from opentelemetry import trace

    sink = memory_sink()
    trace.set_tracer_provider(sink.provider)
    model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    with Join([model]):
        for step in range(2 + 2 * rank):
            model(rank_batch(rank, step)).square().mean().backward()
    assert flush(30)  # the span is ended on tensorplay's thread, never inline in Join.__exit__
    return {span.name: dict(span.attributes) for span in sink.finished()}


def test_join_span_when_the_application_configured_the_sdk() -> None:
    for rank, spans in enumerate(run_ranks(_join_span, 2)):
        assert spans["tensorplay.join"]["tensorplay.rank"] == rank
        assert spans["tensorplay.join"]["tensorplay.join.shadow_iterations"] == (2 if rank == 0 else 0)
        assert spans["tensorplay.join"]["tensorplay.join.last_joiner"] == (rank == 1)
        assert spans["tensorplay.join"]["tensorplay.world_size"] == 2


LATE_INPUTS = 24  # rank 1's batches; rank 0 has 2, so it shadows 22 rounds while rank 1 trains


def _long_join(rank: int, world_size: int, base_port: int) -> dict:
    """Rank 1 scrapes rank 0 while rank 0 shadows inside Join, then once more after the Join."""
    enable_metrics(port=base_port, addr="127.0.0.1")
    model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    model.register_comm_hook(None, traced(default_hooks.allreduce_hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[tuple[int, float | None, float | None]] = []
    with Join([model]):
        for step in range(2 if rank == 0 else LATE_INPUTS):
            optimizer.zero_grad()
            model(rank_batch(rank, step)).square().mean().backward()
            optimizer.step()
            if rank == 1 and step in (6, 14, 22):  # rank 0 has joined, rank 1 has not
                samples = _samples(f"http://127.0.0.1:{base_port}/metrics")
                label = (("rank", "0"),)
                seen.append((step, samples.get(("tensorplay_join_timestamp_seconds", label)),
                             samples.get(("tensorplay_join_shadow_iterations", label))))
    return {"seen": seen, "time": time.time()}


def test_join_figures_are_live_while_a_rank_shadows() -> None:
    base = free_base_port(2)
    early, late = run_ranks(_long_join, 2, base)
    joined = [joined_at for _, joined_at, _ in late["seen"]]
    shadowed = [count for _, _, count in late["seen"]]
    assert all(joined_at is not None and 1.7e9 < joined_at <= late["time"] for joined_at in joined), late["seen"]
    assert len(set(joined)) == 1, "one join time: the moment rank 0 ran out of inputs"
    # Rank 0 shadows one round per step of rank 1 after its own 2: the count grows with them.
    assert shadowed[0] >= 3 and shadowed == sorted(shadowed) and len(set(shadowed)) == 3, late["seen"]
    assert all(count <= step - 1 for step, _, count in late["seen"]), late["seen"]
