"""Start the demo's ranks on this machine with torch's own elastic launcher (what torchrun uses).

One node, ``world_size`` worker processes, a c10d rendezvous on 127.0.0.1 at a free port, no
restarts. Each worker runs ``python -m tensorplay.demo.train`` (the torchrun entry point) with
its stdout and stderr redirected under the run directory, so the launcher's terminal only shows
progress. Ctrl-C reaches the elastic agent, which stops every worker.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .rundir import RunDir

__all__ = ["launch_ranks", "RanksFailed", "Interrupted"]

TRAIN_MODULE = "tensorplay.demo.train"
_LOG_TAIL_LINES = 15
_AGENT_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torch.distributed.elastic.multiprocessing.api",
)


class RanksFailed(Exception):
    """Some rank exited with an error; the message names it and quotes its log."""


class Interrupted(Exception):
    """The run was stopped by a signal (Ctrl-C); every rank has been stopped."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), None)


def _worker_environment() -> None:
    """Environment the workers inherit: gloo on loopback, one compute thread each (as torchrun)."""
    loopback = _loopback_interface()
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _quiet_agent() -> None:
    """Keep the agent's log lines off the terminal: the demo reports signals and failures itself."""
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_ranks(world_size: int, train_argv: list[str], run_dir: RunDir) -> None:
    """Run ``python -m tensorplay.demo.train *train_argv`` on ``world_size`` local ranks.

    Returns once every rank succeeded. Raises :class:`RanksFailed` if one failed and
    :class:`Interrupted` on Ctrl-C or SIGTERM. Must run on the main thread: the elastic agent
    installs the signal handlers that stop the workers.
    """
    _worker_environment()
    _quiet_agent()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"tensorplay-demo-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir.logs), redirects=Std.ALL),
        shutdown_timeout=5,
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", TRAIN_MODULE, *train_argv)
    except ChildFailedError as error:
        raise RanksFailed(_failure_message(error, run_dir)) from None
    except (SignalException, KeyboardInterrupt):
        raise Interrupted() from None


def _failure_message(error: ChildFailedError, run_dir: RunDir) -> str:
    """Name the rank that failed first (the agent then stops the others) and quote its stderr's end."""
    rank, first = error.get_first_failure()
    message = f"rank {rank} failed (exit code {first.exitcode})"
    if first.exitcode < 0:  # the elastic agent reports a death by signal N as exit code -N
        name = _signal_name(-first.exitcode)
        message = f"rank {rank} was killed by {name} (exit code {first.exitcode})"
        if name == "SIGKILL":
            message += ", a signal no process can catch or log: often the kernel's out-of-memory killer (see dmesg)"
    log = run_dir.stderr_logs().get(first.local_rank)
    if log is not None:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        if tail:
            message += f"; end of {log}:\n" + "\n".join("    " + line for line in tail)
        else:
            message += f"; its log {log} is empty"
    return message


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
