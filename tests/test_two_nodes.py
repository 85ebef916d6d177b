"""Beyond one node: two torchrun agents on this machine, as two nodes of one job of 4 ranks.

Each agent runs ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 2`` with a c10d
rendezvous on 127.0.0.1 and its own ``TENSORPLAY_METRICS_PORT``, so every rank serves on its
agent's base port + ``LOCAL_RANK``, as on separate nodes. c10d assigns the node ranks in the
order the agents join, so the test learns from the ranks' result files (each agent has its own
run dir) which agent became node 1. One run, with uneven inputs and a straggler on node 1, shows:

- every series of every endpoint carries the global rank of the process serving it
  (``GROUP_RANK * 2 + LOCAL_RANK``), never its local rank;
- the straggler is named by its global rank: in rank 0's report (gathered over the process group)
  and in the metrics (highest mean step compute, served on node 1's port);
- ``Join`` across the nodes exports each rank's join time, shadowed iterations, wait and last joiner.

The endpoints are scraped over HTTP as soon as a rank's result file says its figures are final,
while the ranks linger.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorplay.demo.rundir import RunDir, read_json
from tensorplay.demo.train import batch_count
from tensorplay.telemetry.names import Metric

from .demo_runs import Demo, scrape
from .ranks import ONE_BLAS_THREAD, free_base_port, free_port
from .waiting import wait_until

pytestmark = pytest.mark.timeout(120)

NODES, NPROC = 2, 2
WORLD_SIZE = NODES * NPROC
STEPS = 6  # uneven: ranks 0..3 train 6, 7, 8, 9 batches
STRAGGLER = 2  # node 1, local rank 0: a rank labelled by LOCAL_RANK would claim to be rank 0
STRAGGLER_DELAY_MS = "100"
LINGER_S = "2"  # time to scrape a rank between its result file and its exit (the test takes ~0.1 s)
RUN_TIMEOUT_S = 90.0


@dataclass
class Agent:
    """One torchrun agent (a "node"): its base metrics port, run dir, process and output files."""

    base_port: int
    run_dir: RunDir
    process: subprocess.Popen
    stdout: Path
    stderr: Path

    def output(self) -> str:
        return f"--- {self.stdout}:\n{self.stdout.read_text()}\n--- {self.stderr}:\n{self.stderr.read_text()[-4000:]}"


def _start_agent(tmp_path: Path, node: str, base_port: int, rdzv_port: int, run_id: str) -> Agent:
    run_dir = RunDir(tmp_path / f"run-{node}")
    stdout, stderr = tmp_path / f"agent-{node}.stdout", tmp_path / f"agent-{node}.stderr"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(NPROC),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1", "--max-restarts", "0",
        "-m", "tensorplay.demo.train", "--steps", str(STEPS), "--uneven",
        "--straggler-rank", str(STRAGGLER), "--straggler-delay-ms", STRAGGLER_DELAY_MS,
        "--metrics-addr", "127.0.0.1", "--run-dir", str(run_dir.path), "--linger-s", LINGER_S,
    ]
    env = {**os.environ, "TENSORPLAY_METRICS_PORT": str(base_port), "GLOO_SOCKET_IFNAME": "lo",
           **ONE_BLAS_THREAD}
    with open(stdout, "w") as out, open(stderr, "w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    return Agent(base_port, run_dir, process, stdout, stderr)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun starts each worker in a session of its own)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _stop(agent: Agent) -> None:
    """Stop an agent that is still running: SIGTERM (it stops its workers), then SIGKILL every group."""
    if agent.process.poll() is not None:
        return
    groups = [agent.process.pid, *_children(agent.process.pid)]
    os.killpg(agent.process.pid, signal.SIGTERM)
    try:
        agent.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.process.wait(timeout=15)


def _disjoint_base_ports() -> tuple[int, int]:
    first = free_base_port(NPROC)
    second = free_base_port(NPROC)
    while abs(second - first) < NPROC:
        second = free_base_port(NPROC)
    return first, second


def _scrape_final(agents: list[Agent]) -> tuple[dict[int, dict], dict[int, str]]:
    """Each rank's result (with the agent it ran under) and what its endpoint served after training."""
    results: dict[int, dict] = {}
    bodies: dict[int, str] = {}

    def scraped_every_rank() -> bool:
        for agent in agents:
            for rank in range(WORLD_SIZE):
                result = None if rank in bodies else read_json(agent.run_dir.result(rank))
                if result is None:
                    continue
                port = agent.base_port + result["local_rank"]
                body = scrape(port)  # final: the rank flushed its telemetry before writing its result
                assert body is not None, f"rank {rank} (port {port}) stopped serving before the test scraped it"
                results[rank], bodies[rank] = {**result, "agent": agent}, body
        return len(bodies) == WORLD_SIZE

    def gave_up() -> str | None:
        failed = [agent for agent in agents if agent.process.poll() not in (None, 0)]
        if failed:
            return f"an agent failed ({failed[0].process.returncode})"
        if all(agent.process.poll() is not None for agent in agents) and not scraped_every_rank():
            return "the agents exited, some ranks left no result,"  # after one more look at their files
        return None

    wait_until(scraped_every_rank, RUN_TIMEOUT_S, "the ranks' results", interval=0.1, gave_up=gave_up,
               details=lambda: "\n".join(agent.output() for agent in agents))
    return results, bodies


def _samples(body: str) -> dict[str, list]:
    """Every sample in a Prometheus text exposition, by sample name."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples: dict[str, list], name: str) -> float:
    (sample,) = samples[name]
    return sample.value


def test_two_nodes_global_ranks_straggler_and_join(tmp_path: Path) -> None:
    started = time.time()
    run_id = f"tensorplay-two-nodes-{uuid.uuid4().hex[:8]}"
    rdzv_port = free_port()
    agents = [_start_agent(tmp_path, node, port, rdzv_port, run_id)
              for node, port in zip("ab", _disjoint_base_ports())]
    try:
        results, bodies = _scrape_final(agents)
        for agent in agents:
            agent.process.wait(timeout=RUN_TIMEOUT_S)
    finally:
        for agent in agents:
            _stop(agent)
    for agent in agents:
        assert agent.process.returncode == 0, agent.output()
    scraped_at = time.time()

    # Which agent became which node: c10d decides; the ranks' results tell.
    node_of = {id(r["agent"]): r["group_rank"] for r in results.values()}
    assert sorted(node_of.values()) == list(range(NODES)), results
    nodes = {node_of[id(agent)]: agent for agent in agents}
    for rank, result in results.items():
        assert result["rank"] == rank == result["group_rank"] * NPROC + result["local_rank"]
        assert result["agent"] is nodes[result["group_rank"]]
        assert result["metrics_url"] == f"http://127.0.0.1:{result['agent'].base_port + result['local_rank']}/metrics"

    # Every series of every endpoint carries the global rank of its process.
    samples = {rank: _samples(body) for rank, body in bodies.items()}
    expected_metrics = {f"{Metric.ALLREDUCE_LATENCY}_count", f"{Metric.STEP_COMPUTE}_sum", Metric.JOIN_TIMESTAMP,
                        Metric.JOIN_SHADOW_ITERATIONS, f"{Metric.JOIN_WAIT}_sum", Metric.JOIN_LAST_JOINER,
                        f"{Metric.JOINS}_total"}
    for rank, by_name in samples.items():
        assert expected_metrics <= by_name.keys(), f"rank {rank} lacks {expected_metrics - by_name.keys()}"
        labels = {sample.labels.get("rank") for series in by_name.values() for sample in series}
        assert labels == {str(rank)}, f"the endpoint of rank {rank} serves rank labels {labels}"

    # The straggler on node 1, by its global rank: rank 0's report and the metrics agree.
    report = Demo(0, nodes[0].stdout.read_text(), "", nodes[0].run_dir.path)
    assert f"tensorplay demo: {WORLD_SIZE} ranks on {NODES} nodes, hook traced(" in report.stdout, report.stdout
    assert nodes[0].run_dir.report.read_text() in report.stdout
    assert report.verdict().startswith(f"straggler: rank {STRAGGLER} "), report.stdout
    assert f"injected: rank {STRAGGLER} sleeps {STRAGGLER_DELAY_MS} ms per step (found)" in report.stdout
    compute_mean = {rank: _value(s, f"{Metric.STEP_COMPUTE}_sum") / _value(s, f"{Metric.STEP_COMPUTE}_count")
                    for rank, s in samples.items()}
    assert max(compute_mean, key=compute_mean.get) == STRAGGLER, compute_mean
    straggler = results[STRAGGLER]
    assert (straggler["group_rank"], straggler["local_rank"]) == (1, 0)
    assert straggler["metrics_url"].endswith(f":{nodes[1].base_port}/metrics")

    # Join across the nodes: every rank's timing, from its own endpoint and in rank 0's report.
    joined = [_value(samples[r], Metric.JOIN_TIMESTAMP) for r in range(WORLD_SIZE)]
    waits = [_value(samples[r], f"{Metric.JOIN_WAIT}_sum") for r in range(WORLD_SIZE)]
    assert started < joined[0] < joined[1] < joined[2] < joined[3] < scraped_at, joined  # fewest batches first
    last = WORLD_SIZE - 1
    for rank in range(WORLD_SIZE):
        shadowed = batch_count(last, STEPS, True) - batch_count(rank, STEPS, True)
        assert _value(samples[rank], Metric.JOIN_SHADOW_ITERATIONS) == shadowed
        assert _value(samples[rank], f"{Metric.JOIN_WAIT}_count") == 1 == _value(samples[rank], f"{Metric.JOINS}_total")
        assert _value(samples[rank], Metric.JOIN_LAST_JOINER) == (1 if rank == last else 0)
        # A rank sees everyone joined once the last one has, and not long after.
        assert joined[last] - 0.05 <= joined[rank] + waits[rank] <= joined[last] + 5.0, (rank, joined, waits)
    rows = report.table()
    assert [row["rank"] for row in rows] == [str(r) for r in range(WORLD_SIZE)]
    assert [row["shadowed"] for row in rows] == [str(int(_value(samples[r], Metric.JOIN_SHADOW_ITERATIONS)))
                                                for r in range(WORLD_SIZE)]
    assert [row["last joiner"] for row in rows] == ["no"] * last + ["yes"]
    for rank, row in enumerate(rows):  # the join span and the metric carry the same wait
        assert abs(float(row["join wait"].removesuffix(" ms")) - 1e3 * waits[rank]) <= 1.0, (row, waits[rank])
