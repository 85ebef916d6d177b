"""Runs actions once CUDA events have completed, by polling them off the training thread.

Waiting on an event with ``synchronize()`` blocks for as long as the collective before it, and
forever when that collective hangs (pytorch#115301); ``query()`` never blocks. The watcher
polls what is pending, often while things complete and less often (down to every 10 ms) while
nothing does, so a hung collective costs almost nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

__all__ = ["EventWatcher"]

_logger = logging.getLogger(__name__)

_FIRST_POLL_S = 0.0005
_SLOWEST_POLL_S = 0.01


class EventWatcher:
    """A daemon thread that runs ``action()`` once ``ready()`` is true, for each pair handed to it."""

    def __init__(self) -> None:
        self._waiting: list[tuple[Callable[[], bool], Callable[[], None]]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def when(self, ready: Callable[[], bool], action: Callable[[], None]) -> None:
        """Run ``action`` on the watcher's thread once ``ready()`` returns true."""
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tensorplay-event-watcher", daemon=True)
                self._thread.start()
            self._waiting.append((ready, action))
            self._wake.notify()

    def waiting(self) -> int:
        """Actions still waiting for their events."""
        with self._wake:
            return len(self._waiting)

    def _run(self) -> None:
        pause = _FIRST_POLL_S
        while True:
            with self._wake:
                while not self._waiting:
                    self._wake.wait()
                batch, self._waiting = self._waiting, []
            still_waiting = []
            for ready, action in batch:
                if _is_ready(ready):
                    _run_safely(action)
                else:
                    still_waiting.append((ready, action))
            if not still_waiting:
                pause = _FIRST_POLL_S
                continue
            with self._wake:
                self._waiting[:0] = still_waiting
            progressed = len(still_waiting) < len(batch)
            pause = _FIRST_POLL_S if progressed else min(pause * 2, _SLOWEST_POLL_S)
            time.sleep(pause)


def _is_ready(ready: Callable[[], bool]) -> bool:
    try:
        return ready()
    except Exception:  # a broken event: let the action find out and report it
        _logger.debug("tensorplay: polling an event failed", exc_info=True)
        return True


def _run_safely(action: Callable[[], None]) -> None:
    try:
        action()
    except Exception:
        _logger.warning("tensorplay: finishing a CUDA record failed; training goes on", exc_info=True)
