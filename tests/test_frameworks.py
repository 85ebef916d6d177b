"""tensorplay inside PyTorch Lightning and Hugging Face Accelerate, as their users run it: 2 CPU processes, gloo.

The scripts under ``tests/frameworks/`` are ordinary user scripts; this module runs each once,
all side by side, with the framework's own launcher (Lightning's default launcher and its spawn
launcher) or ``accelerate launch``, and the tests read what the ranks left behind: final parameters, span
files, and each rank's own ``/metrics`` as it served them over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from .ranks import ONE_BLAS_THREAD, free_base_port, free_port

SCRIPTS = Path(__file__).parent / "frameworks"
ROOT = Path(__file__).parent.parent
RANKS = (0, 1)
IMPORTS_PROBE = (
    "import sys, tensorplay, tensorplay.telemetry, tensorplay.integrations, tensorplay.distributed.algorithms.join;"
    "print(sorted({'pytorch_lightning', 'lightning', 'accelerate'} & set(sys.modules)))"
)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class _Run:
    """A user script started in its own directory, with metrics on (the torchrun way) and gloo on 127.0.0.1.

    The scripts start together and run side by side (their imports alone take seconds per
    process); each test waits only for the one it reads. It runs in a session of its own, so
    whatever it launched (Lightning's rank 1, spawn workers, Accelerate's ranks) goes with it if a
    test ends before it does.
    """

    def __init__(self, command: list[str], out_dir: Path, ports: set[int]) -> None:
        env = dict(os.environ)
        env.update(
            TENSORPLAY_METRICS_PORT=str(_unused(ports, lambda: free_base_port(2), span=2)),
            TENSORPLAY_METRICS_ADDR="127.0.0.1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_unused(ports, free_port)),
            GLOO_SOCKET_IFNAME="lo",
            **ONE_BLAS_THREAD,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        self.command, self.out_dir = command, out_dir
        with open(out_dir / "stdout.txt", "w") as stdout, open(out_dir / "stderr.txt", "w") as stderr:
            self.process = subprocess.Popen(command, cwd=out_dir, env=env, stdout=stdout, stderr=stderr,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def finished(self, timeout: float = 300) -> Path:
        """Wait for the script and return its directory; a bad exit or a hang fails the test."""
        try:
            returncode = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            returncode = None
        output = (self.out_dir / "stdout.txt").read_text()[-4000:] + (self.out_dir / "stderr.txt").read_text()[-8000:]
        assert returncode == 0, f"{self.command} exited {returncode}\n{output}"
        return self.out_dir

    def stop(self) -> None:
        """End the script's session: the script, and anything it launched that is still there."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def _unused(taken: set[int], pick: Any, span: int = 1) -> int:
    """A free port (or ``span`` consecutive ones) that no other script of this module was given."""
    while True:
        port = pick()
        if taken.isdisjoint(range(port, port + span)):
            taken.update(range(port, port + span))
            return port


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Run]]:
    """Start every script of this module at once."""
    ports: set[int] = set()
    script = [sys.executable, str(SCRIPTS / "lightning_train.py")]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(_unused(ports, free_port))]
    commands: dict[str, Callable[[str], list[str]]] = {
        # Lightning's default launcher: fits with torch's bf16 hook, TracedCommHook(bf16), torch's PowerSGD.
        "lightning": lambda out_dir: [*script, out_dir],
        # DDPStrategy(start_method="spawn"): the Trainer and its TracedCommHook(powerSGD_hook) go pickled.
        "lightning-spawn": lambda out_dir: [*script, out_dir, "--spawn"],
        # README's `accelerate launch --multi_gpu --num_processes 2` on CPU, uneven inputs in tensorplay's Join.
        "accelerate": lambda out_dir: [*accelerate, "--multi_gpu", "--num_processes", "2",
                                       str(SCRIPTS / "accelerate_join.py"), out_dir],
        # `accelerate launch --cpu` starts one process, whatever --num_processes says: no DDP to hook.
        "accelerate-one-process": lambda out_dir: [*accelerate, "--cpu", "--num_processes", "2",
                                                   str(SCRIPTS / "accelerate_join.py"), out_dir],
        # Which frameworks importing tensorplay (its integrations package too) pulls in: none.
        "imports": lambda out_dir: [sys.executable, "-c", IMPORTS_PROBE],
    }
    started = {}
    try:
        for name, command in commands.items():
            out_dir = tmp_path_factory.mktemp(name)
            started[name] = _Run(command(str(out_dir)), out_dir, ports)
        yield started
    finally:
        for run in started.values():
            run.stop()


def _served(out_dir: Path, rank: int) -> Samples:
    """The samples rank ``rank`` served on its own endpoint, by (name, sorted labels)."""
    body = (out_dir / f"metrics-rank{rank}.txt").read_text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _parameters(path: Path) -> list[torch.Tensor]:
    return torch.load(path, weights_only=True)


def _equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.fixture(scope="module")
def lightning_run(runs: dict[str, _Run]) -> Path:
    return runs["lightning"].finished()


@pytest.fixture(scope="module")
def lightning_spawn_run(runs: dict[str, _Run]) -> Path:
    return runs["lightning-spawn"].finished()


@pytest.fixture(scope="module")
def accelerate_run(runs: dict[str, _Run]) -> Path:
    return runs["accelerate"].finished()


def test_lightning_traced_hook_trains_exactly_as_torchs_bf16_hook(lightning_run: Path) -> None:
    for rank in RANKS:
        traced_run = _parameters(lightning_run / f"rank{rank}-traced.pt")
        assert _equal(traced_run, _parameters(lightning_run / f"rank{rank}-torch.pt"))
        assert _equal(traced_run, _parameters(lightning_run / "rank0-traced.pt"))


def _sync_counts(samples: Samples, rank: int) -> tuple[float, float, float]:
    """(optimizer steps, gradient reductions, unreduced steps) a rank served."""
    return tuple(_value(samples, f"tensorplay_{name}_total", rank=str(rank))  # type: ignore[return-value]
                 for name in ("optimizer_steps", "gradient_reductions", "unreduced_optimizer_steps"))


def test_lightning_every_rank_serves_its_metrics(lightning_run: Path) -> None:
    for rank in RANKS:
        samples = _served(lightning_run, rank)
        assert _value(samples, "tensorplay_bucket_bytes_total", rank=str(rank), hook="bf16_compress_hook") > 0
        assert _value(samples, "tensorplay_step_compute_seconds_count", rank=str(rank)) >= 3  # 4 steps, 1 bucket
        # accumulate_grad_batches=2: 4 optimizer steps of 2 batches, the first inside no_sync(): 1 reduction each.
        assert _sync_counts(samples, rank) == (4, 4, 0)


def _assert_unique_span_ids(out_dir: Path) -> None:
    """Every rank's spans carry its own rank, and no trace or span ID repeats across ranks."""
    seen: dict[str, int] = {}
    for rank in RANKS:
        spans = [json.loads(line) for line in (out_dir / f"spans-rank{rank}.jsonl").read_text().splitlines()]
        assert len(spans) >= 4 and {s["name"] for s in spans} == {"tensorplay.comm_hook"}
        # Each traced fit's model: one reduced iteration before each of its 4 optimizer steps (the
        # last hook span of each says how many steps came before it).
        counts: dict[int, list[int]] = {}
        for s in spans:
            if "tensorplay.optimizer.steps" in s["attributes"]:
                counts.setdefault(s["attributes"]["tensorplay.optimizer.model"], []).append(
                    s["attributes"]["tensorplay.optimizer.steps"])
        assert counts and all(sorted(model) == [0, 1, 2, 3] for model in counts.values()), counts
        assert {s["resource"]["attributes"]["tensorplay.rank"] for s in spans} == {rank}  # Lightning sets no RANK
        assert {s["attributes"]["tensorplay.rank"] for s in spans} == {rank}
        for span in spans:
            for value in (span["context"]["span_id"], span["context"]["trace_id"]):
                assert value not in seen, f"rank {rank} repeats an ID of rank {seen[value]}: {value}"
                seen[value] = rank


def test_lightning_spans_have_unique_ids_under_seed_everything(lightning_run: Path) -> None:
    """The script calls seed_everything(0) before each fit, and Lightning reseeds every rank alike."""
    _assert_unique_span_ids(lightning_run)


def test_lightning_spawn_start_trains_traced_powersgd_exactly_as_torch(lightning_spawn_run: Path, lightning_run: Path) -> None:
    """Under spawn the callback is pickled to the workers; PowerSGD's state is made in each of them."""
    for rank in RANKS:
        samples = _served(lightning_spawn_run, rank)
        assert _value(samples, "tensorplay_bucket_bytes_total", rank=str(rank), hook="powerSGD_hook") > 0
        assert _value(samples, "tensorplay_compression_error_ratio_count", rank=str(rank), hook="powerSGD_hook") >= 1
        assert _sync_counts(samples, rank) == (4, 4, 0)
        traced_run = _parameters(lightning_spawn_run / f"rank{rank}-traced-powerSGD.pt")
        assert _equal(traced_run, _parameters(lightning_run / f"rank{rank}-torch-powerSGD.pt"))
        assert not _equal(traced_run, _parameters(lightning_run / f"rank{rank}-torch.pt"))  # another hook: not the same
    _assert_unique_span_ids(lightning_spawn_run)  # the spawn launcher hands every worker the main process's seeds


def test_lightning_callback_refuses_what_it_cannot_serve(lightning_spawn_run: Path) -> None:
    refusals = json.loads((lightning_spawn_run / "refusals.json").read_text())
    assert refusals["single device"].startswith("TypeError: TracedCommHook registers a DDP communication hook")
    assert "SingleDeviceStrategy" in refusals["single device"]
    assert refusals["single device, not fitting"] == ["accepted"] * 3  # validate, test, predict
    assert refusals["not a DDP model"].startswith("TypeError: TracedCommHook: the strategy's model is a Linear")
    assert refusals["strategy hook too"] == ["DDPStrategy(ddp_comm_hook=..., ddp_comm_wrapper=...) is set as well as TracedCommHook"]
    assert refusals["bad option"] == "ValueError"
    assert refusals["state twice"] == "ValueError: TracedCommHook: give the hook's state or make_state, not both"


def test_accelerate_launch_serves_every_ranks_join(accelerate_run: Path) -> None:
    """Rank r had 3 + 2r batches, 2 per optimizer step: rank 0 stepped once and shadowed rank 1's last 2
    iterations (stepping nothing), rank 1 stepped twice; one gradient reduction per step."""
    for rank in RANKS:
        samples = _served(accelerate_run, rank)
        assert _sync_counts(samples, rank) == (1 + rank, 1 + rank, 0)
        assert _value(samples, "tensorplay_joins_total", rank=str(rank)) == 1
        assert _value(samples, "tensorplay_join_shadow_iterations", rank=str(rank)) == 2 * (1 - rank)
        assert _value(samples, "tensorplay_join_wait_seconds_count", rank=str(rank)) == 1
        assert _value(samples, "tensorplay_join_last_joiner", rank=str(rank)) == rank
        assert _value(samples, "tensorplay_bucket_bytes_total", rank=str(rank), hook="bf16_compress_hook") > 0
    assert _equal(_parameters(accelerate_run / "rank0.pt"), _parameters(accelerate_run / "rank1.pt"))


def test_accelerate_on_one_process_says_what_is_wrong(runs: dict[str, _Run]) -> None:
    """Unwrapped, the model has no register_comm_hook: the script names the cause and the command instead."""
    run = runs["accelerate-one-process"]
    assert run.process.wait(300) != 0
    stderr = (run.out_dir / "stderr.txt").read_text()
    assert "DDP needs 2 or more processes, this is 1: accelerate launch --multi_gpu --num_processes 2 " in stderr
    assert "AttributeError" not in stderr


def test_importing_tensorplay_imports_no_framework(runs: dict[str, _Run]) -> None:
    out_dir = runs["imports"].finished()
    assert (out_dir / "stdout.txt").read_text().strip() == "[]"
