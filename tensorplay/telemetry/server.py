"""A small HTTP endpoint that serves one registry on ``/metrics`` and nothing else.

A connection that sends nothing (or stops mid-request) is closed after ``REQUEST_TIMEOUT_S``, so
no client can hold one of the training process's threads for good.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["MetricsServer", "ScrapeLog", "REQUEST_TIMEOUT_S"]

_logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 15.0
"""How long a connection may stay silent (waiting for its request, or for a read) before it is closed.

Prometheus sends its request at once and reads the answer within its scrape timeout (10 s by
default), so only a client that connects and stalls ever meets this limit.
"""


class _QuietHandler(WSGIRequestHandler):
    """Keep scrapes out of the training job's stderr, and give every connection a time limit."""

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # type: ignore[attr-defined]
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_timeout_s = REQUEST_TIMEOUT_S

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away is no news for the training job's stderr."""
        _logger.debug("tensorplay: a metrics request from %s ended early", client_address, exc_info=True)


class _IPv6ThreadingServer(_ThreadingServer):
    address_family = socket.AF_INET6


class ScrapeLog:
    """When Prometheus read ``/metrics``: enough to wait for one more scrape that sees the final values.

    Only scrapes that carry Prometheus' ``X-Prometheus-Scrape-Timeout-Seconds`` header count
    (Prometheus, and the agents built on its scraper, send it); a person's curl does not.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._started = 0
        self._latest_completed = 0
        self._completed_at: list[float] = []  # the last two completion times

    def started(self) -> int:
        with self._changed:
            self._started += 1
            return self._started

    def completed(self, sequence: int) -> None:
        with self._changed:
            self._latest_completed = max(self._latest_completed, sequence)
            self._completed_at = [*self._completed_at[-1:], time.monotonic()]
            self._changed.notify_all()

    def seen(self) -> int:
        """How many of the last two scrapes were seen (0, 1 or 2)."""
        with self._changed:
            return len(self._completed_at)

    def interval_s(self) -> float | None:
        """Seconds between the last two scrapes, or None before two were seen."""
        with self._changed:
            if len(self._completed_at) < 2:
                return None
            return self._completed_at[1] - self._completed_at[0]

    def wait_for_next(self, timeout_s: float) -> bool:
        """Wait until a scrape that started after this call has completed; False on timeout."""
        with self._changed:
            after = self._started
            return self._changed.wait_for(lambda: self._latest_completed > after, timeout_s)


def _only_metrics(app: Callable, scrapes: ScrapeLog) -> Callable:
    def serve(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"tensorplay serves /metrics only\n"]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if "HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS" not in environ:
            return app(environ, start_response)
        sequence = scrapes.started()
        body = app(environ, start_response)  # the exposition is rendered here, in full
        return _CompletedOnceSent(body, lambda: scrapes.completed(sequence))

    return serve


class _CompletedOnceSent:
    """A response body that reports, once the server has written all of it, that the scrape completed.

    The WSGI server iterates the body, writing each piece to the socket, then calls ``close()``;
    a body iterated to its end had every piece written. A client that went away mid-body leaves
    the scrape uncompleted.
    """

    def __init__(self, body: Iterable[bytes], on_sent: Callable[[], None]) -> None:
        self._body = body
        self._on_sent = on_sent
        self._sent = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self._body
        self._sent = True

    def __len__(self) -> int:  # one piece: the server then sends a Content-Length
        return len(self._body)  # type: ignore[arg-type]

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            if self._sent:
                self._on_sent()


class MetricsServer:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread.

    Raises OSError when the address cannot be bound (the caller decides how to carry on).
    """

    def __init__(
        self, registry: CollectorRegistry, addr: str, port: int, request_timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        server_class = _IPv6ThreadingServer if ":" in addr else _ThreadingServer
        self.scrapes = ScrapeLog()
        self._httpd = make_server(
            addr, port, _only_metrics(make_wsgi_app(registry), self.scrapes), server_class, handler_class=_QuietHandler
        )
        self._httpd.request_timeout_s = request_timeout_s  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="tensorplay-metrics", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) actually bound."""
        host, port = self._httpd.server_address[:2]
        return host, port

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def abandon(self) -> None:
        """In a forked child, whose copy of the serving thread does not exist: just release the socket."""
        try:
            self._httpd.socket.close()
        except OSError:
            pass
