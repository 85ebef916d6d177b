"""Hang detection for ``tensorplay demo``: which rank the job is stuck on, told while it hangs.

Each rank runs a :class:`RankStateWriter`, a thread that keeps ``state-rank<r>.json`` current
from tensorplay's own live figures (the collective in flight, the latest hook call), so it goes
on while the training thread is blocked. The launcher runs a :class:`HangWatch`: once no rank has
made progress for ``--stall-timeout-s`` seconds, it prints the hang report (with each rank's pid and
where the stuck rank's training thread is) while the ranks are still up, then stops every rank.
The attribution is :func:`tensorplay.analysis.hang.attribute_hang`, the rule of the
``TensorplayRankStalled`` / ``TensorplayJobHung`` alerts.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tensorplay.analysis.hang import attribute_hang
from tensorplay.telemetry import TensorplayMetrics
from tensorplay.telemetry.names import Metric

from .rundir import RunDir, read_json, write_json

__all__ = ["RankStateWriter", "HangWatch", "HangReport", "EXIT_HUNG"]

EXIT_HUNG = 3
_WRITE_EVERY_S = 0.25
_STACK_FRAMES = 12  # the innermost frames of a stalled training thread: where it is stuck
_JOIN_TIMEOUT_S = 5.0  # a thread stuck on a slow filesystem must not keep the rank from finishing


class RankStateWriter:
    """One rank's side: rewrite its state file from the live telemetry, off the training thread."""

    def __init__(self, run_dir: RunDir, rank: int, metrics: TensorplayMetrics) -> None:
        self._path = run_dir.state(rank)
        self._rank = rank
        self._metrics = metrics
        self._steps_done = 0
        self._finished = False
        self._activity_unix = time.time()
        self._last_seen: tuple[Any, ...] = ()
        self._training_thread = threading.get_ident()  # made on the training thread
        self._stop = threading.Event()
        self._writing = threading.Lock()  # the thread and finished() on the training thread both write
        self._thread = threading.Thread(target=self._run, name="tensorplay-demo-state", daemon=True)
        self._thread.start()

    def step_done(self, steps: int) -> None:
        """Note that the training thread finished ``steps`` batches."""
        self._steps_done = steps

    def finished(self) -> None:
        """Training is over on this rank: it waits for no one any more.

        The writer thread is stopped first: two writers of one state file would race on its
        temporary file, and the loser's rename fails.
        """
        self._stop.set()
        self._thread.join(_JOIN_TIMEOUT_S)  # still writing after that: the lock below keeps the writes apart
        self._finished = True
        self._write()

    def _run(self) -> None:
        while not self._stop.wait(_WRITE_EVERY_S):
            self._write()

    def _write(self) -> None:
        with self._writing:
            self._write_now()

    def _write_now(self) -> None:
        rank = str(self._rank)
        waiting = self._metrics.collectives_in_flight.oldest(rank)
        last_hook = self._metrics.registry.get_sample_value(Metric.LAST_STEP_TIMESTAMP, {"rank": rank})
        seen = (self._steps_done, last_hook, waiting)
        stalled = seen == self._last_seen
        if not stalled:  # a hook call, a finished batch or a collective completing
            self._last_seen = seen
            self._activity_unix = time.time()
        write_json(self._path, {
            "rank": self._rank,
            "pid": os.getpid(),
            # Taken only while nothing moves, so it costs nothing while training runs, and the hang
            # report can show where a stuck rank is before the demo stops it.
            "stack": self._training_stack() if stalled else None,
            "steps_done": self._steps_done,
            "finished": self._finished,
            "activity_unix": self._activity_unix,
            "last_hook_call_unix": last_hook,
            "waiting": None if waiting is None else {
                "since_unix": waiting.since_unix, "step": waiting.step, "bucket": waiting.bucket,
            },
        })

    def _training_stack(self) -> str | None:
        frame = sys._current_frames().get(self._training_thread)
        return None if frame is None else "".join(traceback.format_stack(frame, limit=_STACK_FRAMES))


@dataclass
class HangReport:
    """Who the job is stuck on, and who waits for it."""

    stalled_s: float
    never_arrived: list[dict]
    waiting: list[dict]

    def render(self, now_unix: float | None = None) -> str:
        """The report as the demo prints it, while the ranks are still up: their pids, and the stacks
        of the ranks the job is stuck on."""
        now = time.time() if now_unix is None else now_unix
        lines = [f"tensorplay demo: the job hangs: no rank made progress for {self.stalled_s:.0f} s"]
        for state in self.never_arrived:
            lines.append(f"  rank {state['rank']}: in no collective after {state['steps_done']} batches "
                         f"(latest hook call {_ago(state.get('last_hook_call_unix'), now)}): "
                         f"it never arrived; the others wait for it{_pid(state)}")
        for state in self.waiting:
            waiting = state["waiting"]
            where = "Join's all-reduce" if waiting["step"] is None else f"step {waiting['step']}, bucket {waiting['bucket']}"
            since = datetime.fromtimestamp(waiting["since_unix"]).strftime("%H:%M:%S")
            lines.append(f"  rank {state['rank']}: waiting inside a collective since {since} "
                         f"({now - waiting['since_unix']:.1f} s), {where}{_pid(state)}")
        if self.never_arrived:
            culprits = ", ".join(str(s["rank"]) for s in self.never_arrived)
            lines.append(f"stuck on rank {culprits} (TensorplayRankStalled)")
            for state in self.never_arrived:
                if state.get("stack"):
                    lines.append(f"rank {state['rank']}'s training thread, innermost frames last:")
                    lines += ["  " + line for line in state["stack"].rstrip("\n").splitlines()]
        else:
            lines.append("every rank waits inside a collective: no rank to blame (TensorplayJobHung): "
                         "network, NCCL, or ranks that launched different collectives")
        lines.append("on a job of your own, a hung rank's every thread and native frame: py-spy dump --native --pid PID")
        return "\n".join(lines)


def _pid(state: dict) -> str:
    return f"; pid {state['pid']}" if state.get("pid") is not None else ""


def _ago(unix: float | None, now: float) -> str:
    return "none" if unix is None else f"{now - unix:.1f} s ago"


class HangWatch:
    """The launcher's side: once no rank progressed for ``timeout_s``, report the hang and stop the ranks.

    Stopping goes through the elastic agent's own signal handling (SIGTERM to this process), the
    path Ctrl-C takes, so every rank is stopped and reaped.
    """

    def __init__(self, run_dir: RunDir, world_size: int, timeout_s: float, poll_s: float = 0.5) -> None:
        self._run_dir = run_dir
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self.report: HangReport | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorplay-demo-hang-watch", daemon=True)

    def __enter__(self) -> HangWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(_JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            states = [read_json(self._run_dir.state(rank)) for rank in range(self._world_size)]
            known = [s for s in states if s is not None]
            if len(known) < self._world_size:
                continue  # still starting: rendezvous and process-group timeouts cover that phase
            if all(s["finished"] for s in known):
                return
            stalled_s = time.time() - max(s["activity_unix"] for s in known)
            if stalled_s >= self._timeout_s:
                self.report = HangReport(stalled_s, *attribute_hang(known))
                print("\n" + self.report.render(), flush=True)  # while every rank is still up
                os.kill(os.getpid(), signal.SIGTERM)
                return
