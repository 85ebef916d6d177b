"""A small HTTP endpoint that serves one registry on ``/metrics`` and nothing else."""

from __future__ import annotations

import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["MetricsServer", "ScrapeLog"]


class _QuietHandler(WSGIRequestHandler):
    """Keep scrapes out of the training job's stderr."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


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
        scrapes.completed(sequence)
        return body

    return serve


class MetricsServer:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread.

    Raises OSError when the address cannot be bound (the caller decides how to carry on).
    """

    def __init__(self, registry: CollectorRegistry, addr: str, port: int) -> None:
        server_class = _IPv6ThreadingServer if ":" in addr else _ThreadingServer
        self.scrapes = ScrapeLog()
        self._httpd = make_server(
            addr, port, _only_metrics(make_wsgi_app(registry), self.scrapes), server_class, handler_class=_QuietHandler
        )
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
