"""Live progress: each rank rewrites a small file every step; the launcher polls and shows them."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from .rundir import RunDir, read_json, write_json

__all__ = ["ProgressWriter", "ProgressDisplay"]


class ProgressWriter:
    """One rank's side: record the step it finished, its batch count and latest loss.

    ``not_served`` says why the rank serves no metrics (None when it does); the launcher shows it.
    """

    def __init__(self, run_dir: RunDir, rank: int, batches: int, metrics_url: str | None,
                 not_served: str | None = None) -> None:
        self._path = run_dir.progress(rank)
        self._state = {"rank": rank, "step": 0, "batches": batches, "loss": None, "metrics_url": metrics_url,
                       "not_served": not_served}
        write_json(self._path, self._state)

    def step_done(self, step: int, loss: float) -> None:
        """Note that ``step`` batches are done; ``loss`` is the latest one."""
        self._state.update(step=step, loss=loss)
        write_json(self._path, self._state)


class ProgressDisplay:
    """The launcher's side: a status line, redrawn in place on a terminal, sparse lines otherwise;
    and once per rank, a line saying why it serves no metrics, if it does not."""

    def __init__(self, run_dir: RunDir, world_size: int, stream: TextIO = sys.stderr, interval_s: float = 0.25) -> None:
        self._run_dir = run_dir
        self._world_size = world_size
        self._stream = stream
        self._interval_s = interval_s
        self._live = stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorplay-demo-progress", daemon=True)
        self._last_quarter = -1
        self._width = 0
        self._told_not_served: set[int] = set()

    def __enter__(self) -> ProgressDisplay:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._status()  # a rank that ended before the next tick still gets its not-served line
        if self._live and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._show(self._status())

    def _status(self) -> tuple[str, float] | None:
        states = [read_json(self._run_dir.progress(rank)) for rank in range(self._world_size)]
        started = [s for s in states if s is not None]
        for state in started:
            if state.get("not_served") and state["rank"] not in self._told_not_served:
                self._told_not_served.add(state["rank"])
                self._line(f"tensorplay demo: rank {state['rank']}: {state['not_served']}")
        if not started:
            return None
        done = sum(s["step"] for s in started)
        total = sum(s["batches"] for s in started) or 1
        ranks = "  ".join(f"r{s['rank']} {s['step']}/{s['batches']}" for s in started)
        losses = [s["loss"] for s in started if s["loss"] is not None]
        loss = f"  loss {sum(losses) / len(losses):.4f}" if losses else ""
        waiting = self._world_size - len(started)
        pending = f"  ({waiting} rank{'s' if waiting > 1 else ''} starting)" if waiting else ""
        return f"training {100 * done / total:3.0f}%  {ranks}{loss}{pending}", done / total

    def _line(self, text: str) -> None:
        """A line of its own, above the status line on a terminal."""
        if self._live:
            self._stream.write("\r" + " " * self._width + "\r")
        self._stream.write(text + "\n")
        self._stream.flush()

    def _show(self, status: tuple[str, float] | None) -> None:
        if status is None:
            return
        line, fraction = status
        if self._live:
            self._stream.write("\r" + line.ljust(self._width))
            self._width = max(self._width, len(line))
        else:
            quarter = int(fraction * 4)
            if quarter == self._last_quarter:
                return
            self._last_quarter = quarter
            self._stream.write(line + "\n")
        self._stream.flush()
