"""A small HTTP endpoint that serves one registry on ``/metrics`` and nothing else.

One thread serves every connection, each socket non-blocking: a client that connects and sends
nothing, trickles its request, or reads the answer slowly holds an open socket, never a thread,
so it cannot keep a scrape waiting (a thread per connection, at most 16 of them, each held up to
15 s by a client that sent nothing, is how 16 idle connections used to lock every scraper out).
No client holds anything for good either: a request must arrive whole within
``REQUEST_TIMEOUT_S`` of the connection (a client that sends nothing, or trickles a byte at a
time, is closed then), each write of the answer must be taken within as long again, and at
most ``MAX_CONNECTIONS`` are open at once: one more closes the oldest, so a flood of connections
costs the rank a bounded number of sockets and a scraper, which asks at once, is still answered.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Any, Callable
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["MetricsServer", "ScrapeLog", "REQUEST_TIMEOUT_S", "MAX_CONNECTIONS"]

_logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 15.0
"""How long a connection may take to send its whole request, and then at most between two writes of the answer.

Prometheus sends its request at once and reads the answer within its scrape timeout (10 s by
default), so only a client that connects and stalls, or trickles, ever meets this limit.
"""

MAX_CONNECTIONS = 64
"""Connections open at once (a socket each, no thread): scrapers, an HA pair, a person's curl, with
room; one more closes the oldest."""

_MAX_REQUEST_BYTES = 65536
"""A scrape's request line and headers are a few hundred bytes; more is no scrape."""

_POLL_S = 0.5
"""The longest the serving thread sleeps between two looks at its deadlines and at :meth:`MetricsServer.close`."""


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


class _Connection:
    """One client: the request head read so far, then the answer left to send."""

    __slots__ = ("sock", "address", "deadline", "head", "answer", "on_sent")

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.deadline = deadline
        self.head = b""
        self.answer: memoryview | None = None
        self.on_sent: Callable[[], None] | None = None


def _request(head: bytes, address: Any) -> dict[str, Any] | None:
    """The WSGI environ of a request head (a GET has no body), or None if it is no HTTP request."""
    request_line, *header_lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None
    method, target, protocol = parts
    path, _, query = target.partition("?")
    environ = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path, "latin-1"), "QUERY_STRING": query,
               "SERVER_PROTOCOL": protocol, "REMOTE_ADDR": str(address[0]) if address else ""}
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon:
            return None
        environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
    return environ


def _answer(status: str, headers: list[tuple[str, str]], body: bytes) -> memoryview:
    """An HTTP response that closes the connection once sent."""
    lines = [f"HTTP/1.1 {status}", *(f"{name}: {value}" for name, value in headers),
             f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return memoryview("\r\n".join(lines).encode("latin-1") + body)


class _Exposition:
    """What ``/metrics`` answers, and the notes on Prometheus' scrapes that :class:`ScrapeLog` keeps."""

    def __init__(self, registry: CollectorRegistry, scrapes: ScrapeLog) -> None:
        self._app = make_wsgi_app(registry)  # text or OpenMetrics, gzip, name[] as prometheus_client serves them
        self._scrapes = scrapes

    def answer(self, environ: dict[str, Any] | None) -> tuple[memoryview, Callable[[], None] | None]:
        """The response to ``environ``, and what to call once all of it is sent (a Prometheus scrape completed)."""
        if environ is None:
            return _answer("400 Bad Request", [("Content-Type", "text/plain")], b"not an HTTP request\n"), None
        if environ["PATH_INFO"] != "/metrics":
            return _answer("404 Not Found", [("Content-Type", "text/plain")], b"tensorplay serves /metrics only\n"), None
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
            return _answer("405 Method Not Allowed", [("Allow", "GET, HEAD")], b""), None
        timeout = environ.get("HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS")
        scrape = None if timeout is None else self._scrapes.started(
            (environ["REMOTE_ADDR"], environ.get("HTTP_USER_AGENT", ""), timeout))
        started: list[Any] = []
        try:
            body = b"".join(self._app(environ, lambda status, headers, exc_info=None: started.extend((status, headers))))
        except Exception:  # a collector that raised: this scrape fails, the endpoint goes on
            _logger.warning("tensorplay: /metrics could not be rendered", exc_info=True)
            return _answer("500 Internal Server Error", [("Content-Type", "text/plain")], b"see the rank's log\n"), None
        status, headers = started
        on_sent = None if scrape is None else (lambda: self._scrapes.completed(scrape))
        return _answer(status, headers, body), on_sent


class MetricsServer:
    """Serve ``registry`` on ``http://addr:port/metrics`` from one daemon thread.

    The exposition is rendered on that thread, one request at a time, as Prometheus scrapes a
    target (a scrape takes milliseconds; a client that is slow to ask or to read waits in its own
    socket meanwhile). Raises OSError when the address cannot be bound (the caller decides how to
    carry on).
    """

    def __init__(
        self, registry: CollectorRegistry, addr: str, port: int, request_timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        self.scrapes = ScrapeLog()
        self._exposition = _Exposition(registry, self.scrapes)
        self._timeout_s = request_timeout_s
        self._listener = _listening_socket(addr, port)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._open: dict[socket.socket, _Connection] = {}  # in the order they connected: the oldest first
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="tensorplay-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) actually bound."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    def close(self) -> None:
        """Stop serving and release the port (at once if the serving thread is stuck in a collector)."""
        self._closing = True
        self._thread.join(timeout=5)
        self._listener.close()

    def abandon(self) -> None:
        """In a forked child, whose copy of the serving thread does not exist: just release the sockets.

        Closed, never shut down: the parent's connections share them and go on.
        """
        for sock in [self._listener, *self._open]:
            try:
                sock.close()
            except OSError:
                pass
        self._selector.close()

    def _serve(self) -> None:
        try:
            while not self._closing:
                now = time.monotonic()
                wake_s = min([_POLL_S, *(c.deadline - now for c in self._open.values())])
                for key, _ in self._selector.select(max(wake_s, 0.0)):
                    connection = key.data
                    if connection is None:
                        self._accept()
                    elif connection.sock in self._open:  # not closed earlier in this turn (the oldest, making room)
                        (self._read if connection.answer is None else self._write)(connection)
                now = time.monotonic()
                for late in [c for c in self._open.values() if c.deadline <= now]:
                    self._drop(late)
        finally:
            for connection in list(self._open.values()):
                self._drop(connection)
            self._selector.close()

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError:  # gone before it was taken, or the listener closed
            return
        if len(self._open) >= MAX_CONNECTIONS:  # the oldest has had the longest to ask: it makes room
            oldest = next(iter(self._open.values()))
            _logger.debug("tensorplay: %d metrics connections open; closed the oldest, from %s",
                          MAX_CONNECTIONS, oldest.address)
            self._drop(oldest)
        sock.setblocking(False)
        connection = _Connection(sock, address, time.monotonic() + self._timeout_s)
        self._open[sock] = connection
        self._selector.register(sock, selectors.EVENT_READ, connection)

    def _read(self, connection: _Connection) -> None:
        try:
            piece = connection.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:  # reset
            piece = b""
        connection.head += piece
        if b"\r\n\r\n" in connection.head:
            connection.answer, connection.on_sent = self._exposition.answer(_request(connection.head, connection.address))
            connection.deadline = time.monotonic() + self._timeout_s
            self._selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
            self._write(connection)  # an answer that fits in the socket's buffer goes at once
        elif not piece or len(connection.head) >= _MAX_REQUEST_BYTES:  # gone before asking, or no scrape
            self._drop(connection)

    def _write(self, connection: _Connection) -> None:
        answer = connection.answer or memoryview(b"")
        try:
            sent = connection.sock.send(answer)
        except BlockingIOError:
            return
        except OSError:  # the client went away: its scrape is not complete
            self._drop(connection)
            return
        connection.answer = answer[sent:]
        connection.deadline = time.monotonic() + self._timeout_s
        if not connection.answer:
            self._drop(connection)
            if connection.on_sent is not None:
                connection.on_sent()

    def _drop(self, connection: _Connection) -> None:
        """Close a connection: what was sent goes first (FIN after the data), then the socket."""
        del self._open[connection.sock]
        self._selector.unregister(connection.sock)
        try:
            connection.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        connection.sock.close()


def _listening_socket(addr: str, port: int) -> socket.socket:
    """A non-blocking socket listening on ``addr:port`` (an IPv6 address if it has a colon), reusable at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server: a restarted rank binds again
        sock.bind((addr, port))
        sock.listen(MAX_CONNECTIONS)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
