"""Runs a future's continuation on tensorplay's own thread when it would run on the training thread.

``future.then(fn)`` runs ``fn`` at once, on the calling thread, when ``future`` has already
completed; otherwise on the thread that completes it (gloo's, on CPU). A collective that
completes before its hook chains on it (one rank, a tiny bucket) would so put the recorder's
figures, and the hook's decompression chained after them, on the training thread. This module
runs them on a daemon thread instead, which is where they run when the collective takes longer.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Callable

import torch

__all__ = ["then_off_this_thread"]

_logger = logging.getLogger(__name__)

_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def then_off_this_thread(
    future: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]
) -> torch.futures.Future:
    """Like ``future.then(fn)``, but ``fn`` never runs on the calling thread.

    If ``future`` is still pending, this is ``future.then(fn)``; if it has completed, ``fn`` runs
    on tensorplay's thread and the returned future completes there, with ``fn``'s value or error.
    """
    if not future.done():
        return future.then(fn)
    result: torch.futures.Future = torch.futures.Future()

    def job() -> None:
        try:
            value = fn(future)
        except BaseException as error:  # handed to whoever waits, as then() would
            result.set_exception(error)
            return
        result.set_result(value)

    _start()
    _jobs.put(job)
    return result


def _start() -> None:
    global _thread
    if _thread is not None:
        return
    with _start_lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="tensorplay-continuations", daemon=True)
            _thread.start()


def _run() -> None:
    while True:
        job = _jobs.get()
        try:
            job()
        except Exception:  # a job sets its own future; nothing may stop the thread
            _logger.warning("tensorplay: a continuation failed off the training thread", exc_info=True)
        # Let go of the job before waiting for the next: it holds its record (and the bucket's
        # tensors) alive for as long as the thread idles otherwise.
        del job


def _start_afresh_after_fork() -> None:
    """A forked child has the parent's thread object but not its thread: start a new one when needed."""
    global _jobs, _thread, _start_lock
    _jobs = queue.SimpleQueue()
    _thread = None
    _start_lock = threading.Lock()


os.register_at_fork(after_in_child=_start_afresh_after_fork)
