"""A small OTLP trace collector for the tests, over both protocols tensorplay ships.

It is built on the protocol's own messages (``opentelemetry-proto``): the gRPC side is a
``TraceServiceServicer`` served by ``grpcio``, the HTTP side decodes each ``POST /v1/traces`` body
as an ``ExportTraceServiceRequest``. A test drives it the way a real collector misbehaves: it
can start after the job (its port is chosen up front), stop mid-run, and answer "unavailable"
(HTTP 503, gRPC ``UNAVAILABLE``, both retryable for the exporters) for as long as the test wants::

    with OtlpReceiver("grpc", answering=False) as collector:   # refuses every export
        ...                                                     # the job's exports fail
        collector.answering = True                              # now it takes them
        collector.wait_until(lambda: collector.accepted)
        names = [span.name for span in collector.spans()]

Not a test module: test files import it.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from .ranks import free_port

__all__ = ["OtlpReceiver", "ReceivedSpan"]


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector received it, with the Resource it came under."""

    name: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: list[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class OtlpReceiver:
    """An OTLP trace collector on 127.0.0.1 speaking ``protocol`` (``"http/protobuf"`` or ``"grpc"``).

    Arguments:
        protocol: ``"http/protobuf"`` (``POST /v1/traces``) or ``"grpc"`` (``TraceService/Export``).
        answering: whether exports are taken from the start; while False every export is
            answered "unavailable" (and counted in :attr:`refused`).
    """

    def __init__(self, protocol: str, answering: bool = True) -> None:
        if protocol not in ("http/protobuf", "grpc"):
            raise ValueError(f"unknown OTLP protocol {protocol!r}")
        self.protocol = protocol
        self.port = free_port()
        self.answering = answering
        self.accepted = 0
        """Export requests taken (answered OK)."""
        self.refused = 0
        """Export requests answered "unavailable"."""
        self._requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        self._stop: Callable[[], None] | None = None

    @property
    def endpoint(self) -> str:
        """What ``configure_tracing(endpoint=...)`` takes for this collector."""
        return f"http://127.0.0.1:{self.port}"

    def receive(self, request: trace_service_pb2.ExportTraceServiceRequest) -> bool:
        """Take ``request`` if answering; return whether it was taken."""
        with self._lock:
            if not self.answering:
                self.refused += 1
                return False
            self._requests.append(request)
            self.accepted += 1
            return True

    def spans(self) -> list[ReceivedSpan]:
        """Every span taken so far, in arrival order."""
        with self._lock:
            requests = list(self._requests)
        return [
            ReceivedSpan(span.name, _attributes(span.attributes), _attributes(resource_spans.resource.attributes))
            for request in requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "OtlpReceiver":
        """Listen on :attr:`port` (the same port every time, so a job configured earlier finds it)."""
        if self._stop is not None:
            return self
        self._stop = self._start_grpc() if self.protocol == "grpc" else self._start_http()
        return self

    def stop(self) -> None:
        """Stop listening (a collector gone mid-run); safe to call twice."""
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def wait_until(self, predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
        """Poll ``predicate`` until it returns something truthy; return it, or raise after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.protocol} collector: timed out after {timeout:.0f} s waiting for {what} "
                    f"({self.accepted} exports taken, {self.refused} refused)"
                )
            time.sleep(0.05)

    def _start_grpc(self) -> Callable[[], None]:
        receiver = self

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC's name
                if not receiver.receive(request):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the test collector is not answering yet")
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
        if server.add_insecure_port(f"127.0.0.1:{self.port}") != self.port:
            raise OSError(f"the gRPC collector could not listen on 127.0.0.1:{self.port}")
        server.start()
        return lambda: server.stop(grace=None).wait()

    def _start_http(self) -> Callable[[], None]:
        receiver = self

        connections: set[socket.socket] = set()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keeps connections open between exports, as collectors do

            def setup(self) -> None:
                super().setup()
                connections.add(self.connection)

            def finish(self) -> None:
                connections.discard(self.connection)
                super().finish()

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self._answer(404, b"")
                    return
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                if receiver.receive(request):
                    self._answer(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString())
                else:
                    self._answer(503, b"")

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, name="otlp-http-collector", daemon=True)
        thread.start()

        def stop() -> None:
            server.shutdown()
            server.server_close()
            for connection in list(connections):  # a collector that goes away closes its connections too
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            thread.join(10)

        return stop
