"""A server binary run for a test (Prometheus, Alertmanager): found, started on a free loopback
port, ready when ``/-/ready`` answers, stopped at the end.

A missing binary is an error, never a skip: CI installs them (``.ci/run``). The port is probed
free and then bound by the server, so another process can take it in between: the start is then
tried again on another port, at most three times.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from .ranks import free_port
from .waiting import WaitFailed, wait_until

__all__ = ["ServerFailed", "ServerProcess", "answers_ready", "find_binary", "log_tail"]

START_TIMEOUT_S = 30.0
_PORT_TAKEN = "address already in use"


class ServerFailed(RuntimeError):
    """The server is not installed, or did not start."""


def find_binary(*names: str, env: str | None = None, install_hint: str) -> str:
    """The path of the first of ``names`` on PATH (or of ``$env`` if set); raise if none is installed."""
    path = (os.environ.get(env) if env else None) or next((found for name in names if (found := shutil.which(name))), None)
    if not path or not os.access(path, os.X_OK):
        raise ServerFailed(f"{' / '.join(names)} is not installed ({install_hint})")
    return path


def answers_ready(url: str) -> bool:
    """Whether ``GET url/-/ready`` answers 200 now.

    Before the server listens, a connection to its port can be a TCP self-connection that reads
    back its own request: that is "not ready", like a refused connection.
    """
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=1) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):
        return False


def log_tail(path: Path, chars: int = 4000) -> str:
    """The end of a log file, for error messages."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


class ServerProcess:
    """One server process on ``127.0.0.1:<port>``, its output appended to ``log_path``.

    Arguments:
        name: for messages ("prometheus").
        argv: the command line for a given port.
        log_path: where stdout and stderr go; its tail is in every failure message.
        cwd: the working directory of the process.
    """

    def __init__(self, name: str, argv: Callable[[int], Sequence[str]], log_path: Path, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.cwd = cwd
        self.port: int | None = None
        self._process: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        if self.port is None:
            raise ServerFailed(f"{self.name} is not started")
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = START_TIMEOUT_S) -> "ServerProcess":
        """Start the server and wait until it is ready; raise :class:`ServerFailed` if it does not come up."""
        for _attempt in range(3):
            self.port = free_port()
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
            logged_before = self._log.tell()
            self._process = subprocess.Popen(
                list(self.argv(self.port)), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.cwd
            )
            try:
                wait_until(lambda: answers_ready(self.url), timeout, f"{self.name} to be ready", interval=0.1,
                           gave_up=self._exited, details=self.log_tail)
                return self
            except WaitFailed as error:
                self.stop()
                if _PORT_TAKEN not in self.log_path.read_bytes()[logged_before:].decode(errors="replace"):
                    raise ServerFailed(str(error)) from None
        raise ServerFailed(f"{self.name} found its port taken three times:\n{self.log_tail()}")

    def _exited(self) -> str | None:
        process = self._process
        if process is not None and process.poll() is not None:
            return f"{self.name} exited with {process.returncode}"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``); safe to call twice."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log, for error messages."""
        return log_tail(self.log_path, chars)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
