"""A rank's ``/metrics`` endpoint at its edges: slow clients, many clients, and two scrapers at the end.

* a client that trickles its request a byte at a time is closed at the request deadline, and a
  scrape is answered while idle and half-sent requests hold as many connections as the server
  keeps open, the oldest closed to make room, so no client locks a scraper out (real sockets
  against a real ``MetricsServer``);
* two real Prometheus servers (Debian's) scrape one rank, at different intervals: after
  ``wait_for_final_scrape()`` both hold the final counts, and when one of them is gone the wait
  is still bounded.
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tensorplay.telemetry.server import MAX_CONNECTIONS, MetricsServer

from .prometheus_server import prometheus  # noqa: F401 (fixture)
from .ranks import free_port

pytestmark = pytest.mark.timeout(180)


def _closed_by_server(client: socket.socket, wait_s: float) -> bool:
    """Whether the server closed ``client`` (end of stream, or a reset) within ``wait_s``."""
    readable, _, _ = select.select([client], [], [], wait_s)
    if not readable:
        return False
    try:
        return client.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_a_client_trickling_its_request_is_closed_at_the_request_deadline() -> None:
    """A byte every 50 ms would take 6 s to send this request; the deadline is 1 s from connecting."""
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, request_timeout_s=1.0)
    request = b"GET /metrics HTTP/1.0\r\nX-Padding: " + b"x" * 80 + b"\r\n\r\n"
    sent = 0
    closed = False
    try:
        client = socket.create_connection(server.address)
        for byte in request:
            try:
                client.sendall(bytes([byte]))
            except OSError:  # the server closed it while we were sending
                closed = True
                break
            sent += 1
            if _closed_by_server(client, 0.05):
                closed = True
                break
        client.close()
    finally:
        server.close()
    assert closed and sent < len(request), f"the server took all {sent} bytes, one at a time"


def test_a_scrape_is_answered_while_idle_and_slow_clients_hold_every_connection() -> None:
    """As many silent clients as the server keeps open, and one more that sent half a request: a
    scrape still gets its answer while they all hold their sockets, and room is made by closing the
    oldest. (The server used to give each connection one of 16 threads, held until the request
    deadline: the 17th connection on was closed unanswered, for as long as the 16 were renewed.)"""
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, request_timeout_s=60.0)  # none expires here
    url = "http://%s:%d/metrics" % server.address
    held: list[socket.socket] = []
    try:
        held = [socket.create_connection(server.address) for _ in range(MAX_CONNECTIONS)]  # silent clients
        slow = socket.create_connection(server.address)
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: rank\r\n")  # and the rest never comes
        held.append(slow)
        with urllib.request.urlopen(url, timeout=10) as response:  # the server answers in milliseconds
            status, body = response.status, response.read()
        # Every connection after the first MAX_CONNECTIONS closed the oldest: two, accepted in order
        # before the scrape was; the others are still open (their deadline is a minute away).
        closed = [_closed_by_server(client, 0.0 if i >= 2 else 10.0) for i, client in enumerate(held)]
    finally:
        for client in held:
            client.close()
        server.close()
    assert status == 200 and body == b""  # an empty registry, served
    assert closed == [True, True] + [False] * (MAX_CONNECTIONS - 1), closed


_RANK = r'''
import os, sys, time
from tensorplay.telemetry import enable_metrics, wait_for_final_scrape

port, control = int(sys.argv[1]), sys.argv[2]
steps = enable_metrics(port=port, addr="127.0.0.1").steps.labels(rank="0", hook="h")


def when_told(phase, add):
    while not os.path.exists(os.path.join(control, phase)):
        time.sleep(0.05)
    steps.inc(add)
    started = time.monotonic()
    print(phase, wait_for_final_scrape(), time.monotonic() - started, flush=True)


when_told("one gone", 7)
when_told("both back", 5)  # then the rank exits
'''
"""A rank whose counter the test moves in two phases, calling wait_for_final_scrape() after each."""

SLOW_INTERVAL_S = 3


def test_every_scraper_gets_the_final_values_and_a_gone_one_costs_a_bounded_wait(prometheus, tmp_path: Path) -> None:
    port = free_port()
    fast = prometheus([f"127.0.0.1:{port}"], scrape_interval="1s")
    slow = prometheus([f"127.0.0.1:{port}"], scrape_interval=f"{SLOW_INTERVAL_S}s")
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(port), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
    )

    def scraped_twice(server) -> bool:  # the rank then knows the server's interval
        counts = server.query("count_over_time(up[1m]) and up == 1")
        return bool(counts) and float(counts[0]["value"][1]) >= 2

    def last_steps(server) -> float | None:
        found = server.query("last_over_time(tensorplay_steps_total[5m])")
        return float(found[0]["value"][1]) if found else None

    try:
        for server in (fast, slow):
            server.wait_until(lambda: scraped_twice(server), 60, "two scrapes of the rank")
        slow.stop()
        (tmp_path / "one gone").touch()
        said = rank.stdout.readline().split()
        assert said[:2] == ["one", "gone"], said
        assert float(said[3]) < 1.5 * SLOW_INTERVAL_S + 1 + 5  # the default bound, with room for a loaded machine
        fast.wait_until(lambda: last_steps(fast) == 7, 10, "the fast server to hold 7")
        slow.start()
        slow.wait_until(lambda: scraped_twice(slow), 60, "two scrapes of the rank after the restart")
        (tmp_path / "both back").touch()
        out, err = rank.communicate(timeout=60)
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.communicate()
    assert rank.returncode == 0, err[-3000:]
    assert out.split()[:3] == ["both", "back", "True"], out
    for server in (fast, slow):  # the rank has exited: what they hold now is all they get
        server.wait_until(lambda: last_steps(server) == 12, 10, "the final count, 12")
