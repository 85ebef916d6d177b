"""Open a page in Debian's headless Chromium and report what happened, over the DevTools protocol.

Chromium is started with ``--remote-debugging-pipe``: it reads DevTools commands from fd 3 and
writes replies and events to fd 4, each message JSON ended by a NUL byte, so no websocket client
is needed. The page is loaded in a fresh profile; what the tests need comes back in one
:class:`PageVisit`: uncaught exceptions and console or log errors, every URL the page requested,
each image's decoded size, and a full-page screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PageVisit", "visit", "chromium_path"]

_IMAGES = """JSON.stringify([...document.images].map(image => ({
    alt: image.alt, complete: image.complete, width: image.naturalWidth, height: image.naturalHeight,
    shown: image.getBoundingClientRect().width * image.getBoundingClientRect().height})))"""


def chromium_path() -> str | None:
    """Debian's ``chromium`` (what ``.ci/run`` installs), if it is on PATH."""
    return shutil.which("chromium")


@dataclass
class PageVisit:
    """What loading one page did."""

    errors: list[str] = field(default_factory=list)
    """Uncaught exceptions, console errors and browser log errors, as text."""
    requests: list[str] = field(default_factory=list)
    """Every URL the page requested, itself included."""
    images: list[dict[str, Any]] = field(default_factory=list)
    """Per ``<img>``: alt, complete, natural width and height, shown area in CSS pixels."""
    screenshot: bytes = b""
    """PNG of the whole page."""


class _DevTools:
    """One DevTools connection over the pipe: commands with ids, events collected on the way."""

    def __init__(self, commands: int, replies: int, timeout_s: float) -> None:
        self._commands, self._replies = commands, replies
        self._buffer = b""
        self._next_id = 0
        self._deadline = time.monotonic() + timeout_s
        self.events: list[dict[str, Any]] = []

    def _message(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = self._deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise ConnectionError("Chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send a command and wait for its reply; events that arrive meanwhile are kept."""
        self._next_id += 1
        command: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            command["sessionId"] = session
        os.write(self._commands, json.dumps(command).encode() + b"\0")
        while True:
            message = self._message()
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def close_browser(self) -> None:
        """Ask Chromium to exit; it may close the pipe before it answers."""
        try:
            self.call("Browser.close")
        except (ConnectionError, TimeoutError):
            pass

    def wait_for(self, method: str) -> dict[str, Any]:
        """Wait for the first event named ``method`` (it may have arrived already)."""
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            message = self._message()
            self.events.append(message)
            if message.get("method") == method:
                return message


def _errors(events: list[dict[str, Any]]) -> list[str]:
    errors = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            errors.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            texts = (str(arg.get("value", arg.get("description"))) for arg in params["args"])
            errors.append("console: " + " ".join(texts))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            errors.append("log: " + params["entry"].get("text", ""))
    return errors


def visit(page: Path, width: int = 1200, height: int = 900, timeout_s: float = 60.0) -> PageVisit:
    """Load ``page`` (a local file) in headless Chromium and return what it did and how it looks."""
    executable = chromium_path()
    if executable is None:
        raise FileNotFoundError("chromium is not on PATH (Debian's package: apt-get install chromium)")
    commands_read, commands_write = os.pipe()
    replies_read, replies_write = os.pipe()
    with tempfile.TemporaryDirectory(prefix="tensorplay-chromium-") as profile, tempfile.TemporaryFile() as log:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                 "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}", "about:blank"]
        # bash (dash takes one-digit fds only) hands Chromium the pipe ends as the fds 3 and 4 it expects.
        process = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{commands_read} 4>&{replies_write}', executable, *flags],
            pass_fds=(commands_read, replies_write), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
        )
        os.close(commands_read)
        os.close(replies_write)
        try:
            return _load(_DevTools(commands_write, replies_read, timeout_s), page, width, height)
        except (ConnectionError, TimeoutError) as error:
            process.kill()
            process.wait()
            log.seek(0)
            raise RuntimeError(f"{error}; Chromium's stderr:\n{log.read().decode(errors='replace')[-3000:]}") from error
        finally:
            os.close(commands_write)
            os.close(replies_read)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _load(devtools: _DevTools, page: Path, width: int, height: int) -> PageVisit:
    target = devtools.call("Target.createTarget", url="about:blank")["targetId"]
    session = devtools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    for domain in ("Runtime", "Log", "Network", "Page"):
        devtools.call(f"{domain}.enable", session)
    devtools.call("Emulation.setDeviceMetricsOverride", session, width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
    devtools.call("Page.navigate", session, url=page.resolve().as_uri())
    devtools.wait_for("Page.loadEventFired")
    images = json.loads(devtools.call("Runtime.evaluate", session, expression=_IMAGES,
                                      returnByValue=True)["result"]["value"])
    content = devtools.call("Page.getLayoutMetrics", session)["cssContentSize"]
    shot = devtools.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": content["width"], "height": content["height"], "scale": 1})
    visit_ = PageVisit(
        errors=_errors(devtools.events),
        requests=[event["params"]["request"]["url"] for event in devtools.events
                  if event.get("method") == "Network.requestWillBeSent"],
        images=images,
        screenshot=base64.b64decode(shot["data"]),
    )
    devtools.close_browser()
    return visit_
