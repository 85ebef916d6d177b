"""``wait_until``: the one polling loop of the tests, bounded, never a bare sleep.

A test waits for something another process does (a server ready, a scrape, a file written) by
polling a predicate. The wait ends as soon as the predicate answers, fails after ``timeout`` with
what it waited for, and fails at once when ``gave_up`` says the thing waited on cannot happen any
more (the process that would do it exited).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

__all__ = ["WaitFailed", "wait_until"]

T = TypeVar("T")


class WaitFailed(AssertionError):
    """What a test waited for did not happen (in time, or at all)."""


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.2,
    gave_up: Callable[[], str | None] = lambda: None,
    details: Callable[[], str] = lambda: "",
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Arguments:
        predicate: asked first at once, then every ``interval`` seconds.
        timeout: seconds after which the wait fails.
        what: what is waited for, for the failure message.
        gave_up: returns why waiting is pointless now (e.g. "prometheus exited with 1"), else None;
            asked after each unsuccessful try.
        details: what to add to a failure message (a log's tail, a process's output).

    Raises :class:`WaitFailed` (an ``AssertionError``: the test fails) on timeout or give-up.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        reason = gave_up()
        if reason is None and time.monotonic() > deadline:
            reason = f"timed out after {timeout:.0f} s"
        if reason is not None:
            extra = details()
            raise WaitFailed(f"{reason} waiting for {what}" + (f":\n{extra}" if extra else ""))
        time.sleep(interval)
