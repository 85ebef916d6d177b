"""A small HTTP endpoint that serves one registry on ``/metrics`` and nothing else.

No client can hold one of the training process's threads for good: a request must arrive whole
within ``REQUEST_TIMEOUT_S`` of the connection (a client that sends nothing, or trickles a byte at
a time, is closed then), each write of the answer must be taken within as long again, and at most
``MAX_CONNECTIONS`` connections are served at once (one more is closed at once, unanswered).
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["MetricsServer", "ScrapeLog", "REQUEST_TIMEOUT_S", "MAX_CONNECTIONS"]

_logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 15.0
"""How long a connection may take to send its whole request, and then to take the answer.

Prometheus sends its request at once and reads the answer within its scrape timeout (10 s by
default), so only a client that connects and stalls, or trickles, ever meets this limit.
"""

MAX_CONNECTIONS = 16
"""Connections served at once (a thread each): scrapers, an HA pair, a person's curl, with room."""

_MAX_REQUEST_BYTES = 65536
"""A scrape's request line and headers are a few hundred bytes; more is no scrape."""


class _QuietHandler(WSGIRequestHandler):
    """Keep scrapes out of the training job's stderr, and give every request one deadline."""

    def setup(self) -> None:
        super().setup()
        self._deadline = time.monotonic() + self.server.request_timeout_s  # type: ignore[attr-defined]
        stream, self.rfile = self.rfile, io.BytesIO(self._read_request_head())
        stream.close()  # the socket stays open: the server closes it once the answer is sent

    def _read_request_head(self) -> bytes:
        """Read up to the end of the headers before the deadline (a GET has no body); else b"".

        The socket's own timeout applies to each read, so a client sending a byte a second would
        never meet it: the time left to the deadline is set before every read instead.
        """
        head = b""
        while b"\r\n\r\n" not in head and len(head) < _MAX_REQUEST_BYTES:
            left = self._deadline - time.monotonic()
            if left <= 0:
                return b""
            self.connection.settimeout(left)
            try:
                piece = self.connection.recv(4096)
            except OSError:  # timed out, or reset
                return b""
            if not piece:
                break
            head += piece
        return head

    def handle(self) -> None:
        """Answer the request read in :meth:`setup`; each write of the answer gets the timeout in full."""
        self.connection.settimeout(self.server.request_timeout_s)  # type: ignore[attr-defined]
        super().handle()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_timeout_s = REQUEST_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own if a slot is free; else close it at once."""
        if not self._slots.acquire(blocking=False):
            _logger.debug("tensorplay: %d metrics connections open; closed one from %s", MAX_CONNECTIONS, client_address)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away is no news for the training job's stderr."""
        _logger.debug("tensorplay: a metrics request from %s ended early", client_address, exc_info=True)


class _IPv6ThreadingServer(_ThreadingServer):
    address_family = socket.AF_INET6


class _Scraper:
    """What one scraper's scrapes of this rank looked like: enough to wait for its next one.

    Its interval is taken from when its scrapes *started*: Prometheus starts them on a fixed
    schedule, while when one completes depends on how busy this rank is. On a loaded host a
    scrape can be in Prometheus' database before this rank has noted it complete.
    """

    def __init__(self) -> None:
        self.started = 0
        self.latest_completed = 0
        self.started_at: list[float] = []  # the last two start times (monotonic)
        self.completed_at: list[float] = []  # the last two completion times (monotonic)

    def interval_s(self) -> float | None:
        return None if len(self.started_at) < 2 else self.started_at[1] - self.started_at[0]

    def still_scraping(self, now: float, patience_s: float) -> bool:
        """Whether it scraped lately: started one within two of its intervals, or ``patience_s`` if
        it started one only; a scraper that never completed a scrape is not waited for."""
        if not self.completed_at:
            return False
        interval = self.interval_s()
        return now - self.started_at[-1] <= (patience_s if interval is None else 2 * interval + 1.0)

    def wait_s(self, patience_s: float) -> float:
        """How long its next scrape may take to come and complete: 1.5 intervals and a second, at
        most ``patience_s``."""
        interval = self.interval_s()
        return patience_s if interval is None else min(1.5 * interval + 1.0, patience_s)


class ScrapeLog:
    """When each scraper read ``/metrics``: enough to wait until every one has seen the final values.

    Only scrapes that carry Prometheus' ``X-Prometheus-Scrape-Timeout-Seconds`` header count
    (Prometheus, and the agents built on its scraper, send it); a person's curl does not. A
    scraper is told apart by its address, user agent and scrape timeout: two replicas of an HA
    pair (two pods), or Prometheus and an agent, are two scrapers. Two alike in all three (same
    host, version and configuration) count as one. At most ``MAX_SCRAPERS`` are remembered.
    """

    MAX_SCRAPERS = 8
    PATIENCE_S = 60.0
    """How long a scraper seen to start one scrape only counts as still scraping; the longest wait."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._scrapers: dict[tuple[str, ...], _Scraper] = {}

    def started(self, scraper: tuple[str, ...]) -> tuple[_Scraper, int]:
        """Note that ``scraper`` began a scrape; return what :meth:`completed` takes."""
        with self._changed:
            found = self._scrapers.pop(scraper, None) or _Scraper()
            self._scrapers[scraper] = found  # the latest to scrape last: the oldest go first
            while len(self._scrapers) > self.MAX_SCRAPERS:
                del self._scrapers[next(iter(self._scrapers))]
            found.started += 1
            found.started_at = [*found.started_at[-1:], time.monotonic()]
            return found, found.started

    def completed(self, scrape: tuple[_Scraper, int]) -> None:
        scraper, sequence = scrape
        with self._changed:
            scraper.latest_completed = max(scraper.latest_completed, sequence)
            scraper.completed_at = [*scraper.completed_at[-1:], time.monotonic()]
            self._changed.notify_all()

    def seen(self) -> int:
        """How many of its last two scrapes the busiest scraper completed (0, 1 or 2)."""
        with self._changed:
            return max((len(s.completed_at) for s in self._scrapers.values()), default=0)

    def _still_scraping(self) -> list[_Scraper]:
        now = time.monotonic()
        return [s for s in self._scrapers.values() if s.still_scraping(now, self.PATIENCE_S)]

    def final_wait_s(self) -> float | None:
        """The longest :meth:`wait_for_next` waits by default now; None when no scraper is still scraping.

        It is the longest of the waits of the scrapers still scraping: 1.5 times a scraper's
        interval plus a second, or ``PATIENCE_S`` for one seen to start a single scrape (and
        never more).
        """
        with self._changed:
            scrapers = self._still_scraping()
            return self._longest_wait_s(scrapers) if scrapers else None

    def _longest_wait_s(self, scrapers: list[_Scraper]) -> float:
        return max(s.wait_s(self.PATIENCE_S) for s in scrapers)

    def wait_for_next(self, timeout_s: float | None = None) -> bool:
        """Wait until every scraper still scraping completed a scrape that started after this call.

        At most ``timeout_s``, by default :meth:`final_wait_s` (both read from one look at the
        scrapers). False when the time ran out first (one of them went away), or at once when
        none is scraping.
        """
        with self._changed:
            waited_for = self._still_scraping()
            if not waited_for:
                return False
            if timeout_s is None:
                timeout_s = self._longest_wait_s(waited_for)
            after = [(s, s.started) for s in waited_for]
            return self._changed.wait_for(lambda: all(s.latest_completed > n for s, n in after), timeout_s)


def _only_metrics(app: Callable, scrapes: ScrapeLog) -> Callable:
    def serve(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"tensorplay serves /metrics only\n"]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        timeout = environ.get("HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS")
        if timeout is None:
            return app(environ, start_response)
        scrape = scrapes.started((environ.get("REMOTE_ADDR", ""), environ.get("HTTP_USER_AGENT", ""), timeout))
        body = app(environ, start_response)  # the exposition is rendered here, in full
        return _CompletedOnceSent(body, lambda: scrapes.completed(scrape))

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
