"""tensorplay under the launchers real scripts use: spawn, fork, and a job without a collector.

* ``torch.multiprocessing.spawn`` pickles its arguments: a traced hook handed to the ranks that
  way arrives as an equivalent traced hook (same name and sampling, fresh counts), and trains;
* a child forked after the parent enabled metrics and made a traced call behaves as a fresh
  process: it serves its own metrics, and its spans end and are exported;
* ``configure_tracing()`` at an endpoint where nothing listens costs the exit no retry back-off
  and prints one tensorplay line, not the exporter's retries.
"""

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prometheus_client import CollectorRegistry

from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.telemetry import TensorplayMetrics

from .otlp_receiver import OtlpReceiver
from .ranks import ONE_BLAS_THREAD, free_port, one_blas_thread_in_children
from .training import passthrough, train

pytestmark = pytest.mark.timeout(180)

STEPS = 3


def _spawned_rank(rank: int, world_size: int, port: int, hook: Any, out: str) -> None:
    """A rank of ``mp.spawn``: it got ``hook`` by pickle, registers it, trains, and writes what it saw."""
    from tensorplay.telemetry import flush
    from tensorplay.telemetry.names import Attr

    from .sink import memory_sink

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    sink = memory_sink(install=True)
    traced_params = train(rank, hook, steps=STEPS)
    flush(30)
    plain_params = train(rank, passthrough(default_hooks.bf16_compress_hook), steps=STEPS)
    spans = sink.spans()
    result = {
        "name": hook.__name__,
        "steps": sorted({s[Attr.STEP] for s in spans}),
        "steps with error": sorted({s[Attr.STEP] for s in spans if Attr.COMPRESSION_RELATIVE_ERROR in s}),
        "calls counted in this rank's metrics": sink.sample(
            "tensorplay_allreduce_latency_seconds_count", rank=str(rank), hook="bf16_compress_hook"
        ),
        "spans": len(spans),
        "equal": all(torch.equal(a, b) for a, b in zip(traced_params, plain_params)),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_traced_hook_goes_through_spawn_and_trains(tmp_path: Path) -> None:
    hook = traced(default_hooks.bf16_compress_hook, error_every=2, metrics=TensorplayMetrics(CollectorRegistry()))
    with one_blas_thread_in_children():
        mp.spawn(_spawned_rank, args=(2, free_port(), hook, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["name"] == "traced(bf16_compress_hook)"
        assert result["steps"] == list(range(STEPS))  # counted from 0 in the rank: fresh state
        assert result["steps with error"] == [0, 2]  # error_every=2 came along
        assert result["calls counted in this rank's metrics"] == result["spans"] > 0  # its own metrics
        assert result["equal"]


_FORK_SCRIPT = r'''
import json, multiprocessing, os, sys, urllib.request
import torch, torch.distributed as dist
from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.telemetry import configure_tracing, enable_metrics, flush, served_address
from tests.training import train

parent_port, child_port, store_port, span_file, out = sys.argv[1:]


def local_hook(state, bucket):
    """A hook that needs no peer: the parent's gloo threads do not exist in the child."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class Bucket:
    def __init__(self):
        self._buffer = torch.ones(16)

    def buffer(self): return self._buffer
    def index(self): return 0
    def is_last(self): return True
    def parameters(self): return []


def child():
    outcome = {}
    try:
        metrics = enable_metrics(port=int(child_port), addr="127.0.0.1")
        outcome["served at"] = list(served_address() or ())
        hook = traced(local_hook)
        for _ in range(3):
            hook(None, Bucket()).wait()
        outcome["flushed"] = flush(10)
        from opentelemetry import trace
        outcome["exported"] = trace.get_tracer_provider().force_flush(10_000)
        body = urllib.request.urlopen(f"http://127.0.0.1:{child_port}/metrics", timeout=10).read().decode()
        outcome["served body"] = [line for line in body.splitlines() if line.startswith("tensorplay_bucket_bytes_total")]
    except Exception as error:
        outcome["error"] = repr(error)
    with open(out, "w") as sink:
        json.dump(outcome, sink)


configure_tracing(otlp=False, span_file=span_file)
enable_metrics(port=int(parent_port), addr="127.0.0.1")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=0, world_size=1)
train(0, traced(default_hooks.allreduce_hook), steps=1)  # the parent made traced calls
flush(10)
process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join(60)
print("child exit code", process.exitcode)
'''


def test_a_forked_child_serves_its_own_metrics_and_ends_its_spans(tmp_path: Path) -> None:
    span_file, out = tmp_path / "spans.jsonl", tmp_path / "child.json"
    ports = [str(free_port()) for _ in range(3)]
    run = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, *ports, str(span_file), str(out)],
        capture_output=True, text=True, timeout=150, cwd=Path(__file__).parent.parent,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", **ONE_BLAS_THREAD},
    )
    assert "child exit code 0" in run.stdout, run.stderr[-3000:]
    child = json.loads(out.read_text())
    assert "error" not in child, child
    assert child["served at"] == ["127.0.0.1", int(ports[1])]
    assert child["flushed"] and child["exported"]
    assert child["served body"] == ['tensorplay_bucket_bytes_total{hook="local_hook",rank="0"} 192.0']
    spans = [json.loads(line) for line in span_file.read_text().splitlines()]
    hooks = [s["attributes"]["tensorplay.hook"] for s in spans if s["name"] == "tensorplay.comm_hook"]
    assert hooks.count("local_hook") == 3  # the child's spans ended and reached the exporter
    assert hooks.count("allreduce_hook") >= 1  # the parent's, exported before the fork


_FORK_AFTER_OWN_REGISTRY_SCRIPT = r"""
import json, multiprocessing, os, socket, sys
import prometheus_client, torch
import torch.distributed as dist
from opentelemetry import trace
from tensorplay import traced
from tensorplay.telemetry import configure_tracing, enable_metrics, flush

collector, store_port, out = sys.argv[1:]
collector_port = int(collector.rsplit(":", 1)[1])


def local_hook(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class Bucket:
    def buffer(self): return torch.ones(16)
    def index(self): return 0
    def is_last(self): return True
    def parameters(self): return []


def train_and_export(calls):
    hook = traced(local_hook)
    for _ in range(calls):
        hook(None, Bucket()).wait()
    flush(10)
    trace.get_tracer_provider().force_flush(30_000)  # the collector refuses: a failed export


def connections_to_collector():
    found = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            found += sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getpeername()[1] == collector_port
        except OSError:
            pass
        finally:
            sock.close()
    return found


def child():
    outcome = {"connections": connections_to_collector()}
    try:
        enable_metrics(registry=prometheus_client.REGISTRY, serve=False)
        train_and_export(3)
        body = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
        outcome["served"] = [line for line in body.splitlines() if line.startswith("tensorplay_bucket_bytes_total")]
    except Exception as error:
        outcome["error"] = repr(error)
    with open(out, "w") as sink:
        json.dump(outcome, sink)


dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=0, world_size=1)
configure_tracing(endpoint=collector)
enable_metrics(registry=prometheus_client.REGISTRY, serve=False)  # served from the application's endpoint
train_and_export(1)
print("parent connections", connections_to_collector(), flush=True)
process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join(60)
print("child exit code", process.exitcode, flush=True)
"""


def test_a_child_forked_after_metrics_on_the_applications_registry_starts_afresh(tmp_path: Path) -> None:
    """The child's own metrics on the same registry, its own connections, its own one warning."""
    out = tmp_path / "child.json"
    with OtlpReceiver("http/protobuf", answering=False) as collector:  # every export fails
        run = subprocess.run(
            [sys.executable, "-c", _FORK_AFTER_OWN_REGISTRY_SCRIPT, collector.endpoint, str(free_port()), str(out)],
            capture_output=True, text=True, timeout=150, cwd=Path(__file__).parent.parent,
            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1", **ONE_BLAS_THREAD},
        )
    assert "child exit code 0" in run.stdout, run.stderr[-3000:]
    assert "parent connections 1" in run.stdout  # the exporter keeps its connection open
    child = json.loads(out.read_text())
    assert child.get("error") is None, child
    assert child["connections"] == 0  # the parent's connection is not the child's
    assert child["served"] == ['tensorplay_bucket_bytes_total{hook="local_hook",rank="0"} 192.0']  # 3 calls, its own
    warnings = [line for line in run.stderr.splitlines() if "cannot export spans" in line]
    assert len(warnings) == 2, run.stderr[-3000:]  # the parent's, and the child's own


_NO_COLLECTOR_SCRIPT = r'''
import atexit, sys, time
atexit.register(lambda: print("exit hooks done", time.monotonic(), flush=True))  # runs last
import torch.distributed as dist
from tensorplay import traced
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay.telemetry import configure_tracing
from tests.training import train

configure_tracing(endpoint=f"http://127.0.0.1:{sys.argv[1]}")  # nothing listens there
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
train(0, traced(default_hooks.fp16_compress_hook), steps=3)
dist.destroy_process_group()
print("training done", time.monotonic(), flush=True)
'''


def test_no_collector_costs_the_exit_no_retries_and_prints_one_line() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _NO_COLLECTOR_SCRIPT, str(free_port()), str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", **ONE_BLAS_THREAD},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    times = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in run.stdout.splitlines()}
    exit_s = times["exit hooks done"] - times["training done"]
    assert exit_s < 2.0, f"the exit took {exit_s:.1f} s (the exporter's retry back-off is ~5 s)"
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    tensorplay_lines = [line for line in lines if "tensorplay" in line]
    assert len(tensorplay_lines) == 1 and "cannot export spans" in tensorplay_lines[0], lines
    assert 'otlp=False, span_file="spans-rank{rank}.jsonl"' in tensorplay_lines[0]  # a file per rank, as written
    assert "retrying in" not in tensorplay_lines[0]  # it says "dropped"; the exporter's retry plan is not the news
    assert not [line for line in lines if "Transient error" in line and not line.startswith("tensorplay")], lines
