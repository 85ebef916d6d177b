"""Spans over OTLP, both protocols tensorplay ships, to a real collector that misbehaves at the edges.

One traced training process exports to two test collectors at once (``tests/otlp_receiver.py``:
OTLP/HTTP and OTLP/gRPC, built on ``opentelemetry-proto``). The job's first exports fail (the
HTTP collector is not started yet, the gRPC one answers ``UNAVAILABLE``); then the collectors
answer, and the job trains its last steps inside ``Join`` and exits. Every span from the moment
they answer reaches both, the last step's and the ``tensorplay.join`` span included, under a
Resource that names the service, the rank and the world size. A collector that stops mid-run
and never comes back costs the exit one failed attempt, not the exporter's retry back-off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from .otlp_receiver import OtlpReceiver, ReceivedSpan
from .ranks import ONE_BLAS_THREAD, free_port

pytestmark = pytest.mark.timeout(240)

_ROOT = Path(__file__).parent.parent

_JOB = r'''
import atexit, os, sys, time
atexit.register(lambda: print("exit hooks done", time.monotonic(), flush=True))  # runs last
import torch
import torch.distributed as dist
from opentelemetry import trace
from torch.nn.parallel import DistributedDataParallel as DDP
from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay.distributed.algorithms.join import Join
from tensorplay.telemetry import configure_tracing, flush
from tests.training import BUCKET_CAP_MB, make_model, rank_batch

http_endpoint, grpc_endpoint, store_port, go_file = sys.argv[1:]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=0, world_size=1)
configure_tracing(service_name="edges-job", endpoint=http_endpoint, protocol="http/protobuf")
configure_tracing(endpoint=grpc_endpoint, protocol="grpc")
model = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
model.register_comm_hook(None, traced(allreduce_hook))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(index):
    optimizer.zero_grad()
    model(rank_batch(0, index)).square().mean().backward()
    optimizer.step()


for index in range(2):
    step(index)
flush(30)
trace.get_tracer_provider().force_flush(60_000)
print("first exports done", flush=True)
while not os.path.exists(go_file):  # the test changes the collectors now
    time.sleep(0.05)
with Join([model]):
    for index in range(2, 5):
        step(index)
flush(30)
print("training done", time.monotonic(), flush=True)
'''
"""Two steps and an export the test watches; then, once told, three steps in a Join and the exit."""

LAST_STEPS = {2, 3, 4}


def _run_job(
    collectors: tuple[OtlpReceiver, OtlpReceiver],
    between: Callable[[], None],
    tmp_path: Path,
    export_timeout_s: int,
) -> tuple[subprocess.CompletedProcess, float]:
    """Run the job against the HTTP and gRPC ``collectors``; call ``between`` after its first exports.

    Return the finished process and how long its exit took, from the end of training to the last
    exit hook.
    """
    go_file = tmp_path / "go"
    job = subprocess.Popen(
        [sys.executable, "-c", _JOB, collectors[0].endpoint, collectors[1].endpoint, str(free_port()), str(go_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_ROOT,
        env={
            **os.environ, "GLOO_SOCKET_IFNAME": "lo", **ONE_BLAS_THREAD,
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(export_timeout_s),
            "OTEL_BSP_SCHEDULE_DELAY": "600000",  # spans leave only when flushed, or at exit
        },
    )
    try:
        assert job.stdout is not None
        first = job.stdout.readline()
        assert first == "first exports done\n", first + (job.stderr.read() if job.poll() is not None else "")
        between()
        go_file.touch()
        out, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    run = subprocess.CompletedProcess(job.args, job.returncode, first + out, err)
    assert run.returncode == 0, run.stderr[-3000:]
    times = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.strip()}
    return run, times["exit hooks done"] - times["training done"]


def _steps(spans: list[ReceivedSpan]) -> set[int]:
    return {s.attributes["tensorplay.step"] for s in spans if s.name == "tensorplay.comm_hook"}


def test_a_collector_that_comes_back_gets_every_span_from_then_on(tmp_path: Path) -> None:
    http = OtlpReceiver("http/protobuf")  # not started yet: nothing listens on its port
    grpc = OtlpReceiver("grpc", answering=False).start()  # answers UNAVAILABLE
    try:

        def collectors_come_back() -> None:
            assert http.accepted == grpc.accepted == 0 and grpc.refused > 0  # the first exports failed
            http.start()
            grpc.answering = True

        run, _ = _run_job((http, grpc), collectors_come_back, tmp_path, export_timeout_s=2)
        for collector in (http, grpc):
            spans = collector.spans()
            assert LAST_STEPS <= _steps(spans), (collector.protocol, sorted(_steps(spans)))
            assert [s.attributes["tensorplay.rank"] for s in spans if s.name == "tensorplay.join"] == [0]
            assert {(s.resource["service.name"], s.resource["tensorplay.rank"], s.resource["tensorplay.world_size"])
                    for s in spans} == {("edges-job", 0, 1)}
    finally:
        http.stop()
        grpc.stop()


def test_a_collector_that_never_comes_back_costs_the_exit_one_attempt(tmp_path: Path) -> None:
    """Both collectors take the first exports, then the HTTP one stops and the gRPC one refuses.

    The exports' timeout is 10 s here: an exit that waited out the exporters' retries would take
    about 7 s per exporter.
    """
    http = OtlpReceiver("http/protobuf").start()
    grpc = OtlpReceiver("grpc").start()
    try:

        def collectors_go_away() -> None:
            assert http.accepted > 0 and grpc.accepted > 0
            http.stop()
            grpc.answering = False

        run, exit_s = _run_job((http, grpc), collectors_go_away, tmp_path, export_timeout_s=10)
        assert exit_s < 5.0, f"the exit took {exit_s:.1f} s"
        assert grpc.refused > 0  # the final export was tried
        assert not LAST_STEPS & (_steps(http.spans()) | _steps(grpc.spans()))
        warnings = [line for line in run.stderr.splitlines() if "cannot export spans" in line]
        assert len(warnings) == 1 and "retrying in" not in warnings[0], run.stderr[-3000:]
    finally:
        http.stop()
        grpc.stop()
