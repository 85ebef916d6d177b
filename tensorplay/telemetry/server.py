"""A small HTTP endpoint that serves one registry on ``/metrics`` and nothing else."""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["MetricsServer"]


class _QuietHandler(WSGIRequestHandler):
    """Keep scrapes out of the training job's stderr."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _IPv6ThreadingServer(_ThreadingServer):
    address_family = socket.AF_INET6


def _only_metrics(app: Callable) -> Callable:
    def serve(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"tensorplay serves /metrics only\n"]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        return app(environ, start_response)

    return serve


class MetricsServer:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread.

    Raises OSError when the address cannot be bound (the caller decides how to carry on).
    """

    def __init__(self, registry: CollectorRegistry, addr: str, port: int) -> None:
        server_class = _IPv6ThreadingServer if ":" in addr else _ThreadingServer
        self._httpd = make_server(
            addr, port, _only_metrics(make_wsgi_app(registry)), server_class, handler_class=_QuietHandler
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
