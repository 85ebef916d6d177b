"""Trace and span IDs stay unique across ranks and runs when the script seeds Python's ``random``.

Lightning's ``seed_everything``, Accelerate's ``set_seed`` and ``random.seed`` all seed the global
``random``, which OpenTelemetry's default ID generator draws from: every rank, and every run with
the same seed, would make the same IDs, and every span would advance the script's random sequence.
Each run here seeds ``random`` with 0 on every rank, as such a script does, then trains with a
traced hook inside tensorplay's ``Join``. The user-provider cases run in this process.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay.distributed.algorithms.join import Join
from tensorplay.telemetry import SystemRandomIdGenerator, configure_tracing, enable_metrics, flush
from tensorplay.telemetry.tracing import tracer

from .ranks import free_base_port, run_ranks
from .training import BUCKET_CAP_MB, make_model, rank_batch


def _train_seeded(rank: int) -> None:
    """Seed ``random`` as the script would, then train a few uneven steps with a traced hook in a Join."""
    random.seed(0)
    model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    model.register_comm_hook(None, traced(allreduce_hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for step in range(2 + rank):  # uneven: rank 0 joins early, so each rank has a join span
            optimizer.zero_grad()
            model(rank_batch(rank, step)).square().mean().backward()
            optimizer.step()
    flush(30)


def _seeded_runs(rank: int, world_size: int, span_dir: str, metrics_port: int) -> dict[str, Any]:
    """Two seeded runs on this rank; return each run's IDs and whether tensorplay moved ``random``.

    The second run seeds ``random`` again, which puts OpenTelemetry's default generator exactly
    where a fresh process with the same seed would put it.
    """
    random.seed(0)
    untouched = random.getstate()
    span_file = Path(f"{span_dir}/spans-rank{rank}.jsonl")
    provider = configure_tracing(span_file=f"{span_dir}/spans-rank{{rank}}.jsonl", otlp=False)  # the advice, as written
    enable_metrics(port=metrics_port, addr="127.0.0.1")
    same_state = random.getstate() == untouched
    runs = []
    for _ in range(2):
        _train_seeded(rank)
        provider.force_flush()
        same_state = same_state and random.getstate() == untouched
        spans = [json.loads(line) for line in span_file.read_text().splitlines()]
        span_file.unlink()
        runs.append(
            {
                "span ids": [s["context"]["span_id"] for s in spans],
                "trace ids": [s["context"]["trace_id"] for s in spans],
                "names": {s["name"] for s in spans},
            }
        )
    return {"runs": runs, "random untouched": same_state, "generator": type(provider.id_generator).__name__}


@pytest.fixture(scope="module")
def seeded_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_seeded_runs, 2, str(tmp_path_factory.mktemp("spans")), free_base_port(2))


def test_ids_are_unique_across_ranks_and_runs_whatever_the_seed(seeded_ranks: list[dict[str, Any]]) -> None:
    for kind in ("span ids", "trace ids"):
        seen: dict[str, tuple[int, int]] = {}
        for rank, outcome in enumerate(seeded_ranks):
            for run, spans in enumerate(outcome["runs"]):
                assert spans["names"] == {"tensorplay.comm_hook", "tensorplay.join"}
                ids = spans[kind]
                assert len(ids) >= 5 and all(int(i, 16) != 0 for i in ids)  # W3C: never all zeros
                for value in set(ids):
                    assert value not in seen, f"{kind[:-1]} {value} of rank {rank} run {run} repeats {seen[value]}"
                    seen[value] = (rank, run)
        assert len(seen) >= 20


def test_tensorplay_neither_reads_nor_advances_random(seeded_ranks: list[dict[str, Any]]) -> None:
    """Tracing, metrics, traced hooks and Join: the script's seeded sequence is where it left it."""
    assert [outcome["random untouched"] for outcome in seeded_ranks] == [True, True]
    assert {outcome["generator"] for outcome in seeded_ranks} == {"SystemRandomIdGenerator"}


def test_configure_tracing_leaves_the_applications_provider_and_its_seeded_ids_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The application's tracers keep following ``random.seed``; tensorplay's own draw from the OS."""
    provider = TracerProvider()  # the application's, set before configure_tracing runs
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    assert configure_tracing(span_file=str(tmp_path / "spans.jsonl"), otlp=False) is provider
    assert type(provider.id_generator) is RandomIdGenerator
    application_tracer = provider.get_tracer("my.training")

    def seeded_ids() -> list[int]:
        random.seed(0)
        return [application_tracer.start_span("train_step").get_span_context().span_id for _ in range(3)]

    assert seeded_ids() == seeded_ids()  # the same seed, the same IDs: as the application set it up
    random.seed(0)
    state = random.getstate()
    tensorplay_span = tracer(provider).start_span("tensorplay.comm_hook")
    assert random.getstate() == state and tensorplay_span.get_span_context().span_id not in seeded_ids()


class _CountingIds(IdGenerator):
    """An application's own ID scheme (say, X-Ray's), which tensorplay must leave alone."""

    def __init__(self) -> None:
        self.calls = 0

    def generate_span_id(self) -> int:
        self.calls += 1
        return self.calls

    def generate_trace_id(self) -> int:
        self.calls += 1
        return self.calls


def test_a_chosen_generator_is_kept_and_used_for_tensorplays_spans() -> None:
    own = _CountingIds()
    provider = TracerProvider(id_generator=own)
    tensorplay_tracer = tracer(provider)
    tensorplay_tracer.start_span("tensorplay.comm_hook").end()
    assert provider.id_generator is own and own.calls == 2


def test_a_providers_default_generator_never_draws_from_random_for_tensorplay() -> None:
    provider = TracerProvider()  # traced(tracer_provider=...) with the SDK's default generator
    random.seed(0)
    state = random.getstate()
    tensorplay_tracer = tracer(provider)
    spans = [tensorplay_tracer.start_span("tensorplay.comm_hook") for _ in range(3)]
    assert random.getstate() == state
    assert len({s.get_span_context().span_id for s in spans}) == 3
    assert type(provider.id_generator) is RandomIdGenerator  # the application's own spans: its choice


def test_system_random_ids_are_valid_and_random() -> None:
    ids = SystemRandomIdGenerator()
    spans = {ids.generate_span_id() for _ in range(1000)}
    traces = {ids.generate_trace_id() for _ in range(1000)}
    assert len(spans) == len(traces) == 1000
    assert all(0 < s < 2**64 for s in spans) and all(0 < t < 2**128 for t in traces)
    assert max(traces) >= 2**120 and max(spans) >= 2**56  # the high bits are drawn too
    assert ids.is_trace_id_random()
