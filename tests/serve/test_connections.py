"""How `qkv serve` holds its connections (tools/qkv/serve_connections.hpp), against a real server
on 127.0.0.1 (conftest.py): slow and idle clients cannot lock out a new one, idle keep-alive
connections are closed after a short time, answers on a kept-alive connection do not wait for
delayed ACKs (TCP_NODELAY), a burst of simultaneous connections is queued rather than reset, and
a second server cannot bind the port of the first. Loopback only, every loop bounded in count
and time; the figures measured are printed.
"""
import http.client
import json
import os
import socket
import statistics
import subprocess
import threading
import time

import pytest

from conftest import QKV_BIN, Server

REQUEST = json.dumps({"text": "The cat sat on the mat", "heads": 2, "embed": 16}).encode()

# The server's limits (ConnectionLimits, tools/qkv/serve_connections.hpp), which the time bounds
# below are written against, and the margin they allow over a timeout: more under ASan + UBSan
# (QKV_SANITIZED=1, the sanitizer build, run beside other tests), yet less than the 3 s by which
# the earlier 5 s timeouts went over these, so that both builds still catch their return.
READ_TIMEOUT = 2.0  # the longest pause within a request
KEEP_ALIVE = 2.0  # the longest idle time between two requests
SANITIZED = os.environ.get("QKV_SANITIZED") == "1"
MARGIN = 2.9 if SANITIZED else 2.0


def port_of(server):
    return int(server.url.rsplit(":", 1)[1])


def timed_request(port, body=REQUEST, timeout=10):
    """(seconds, status) of one POST /api/attention on a fresh connection."""
    start = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/api/attention", body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        reply.read()
        return time.monotonic() - start, reply.status
    finally:
        connection.close()


class SlowClients:
    """`count` connections each sending a request's header one byte every `interval` s, never
    finishing it (slowloris), until stopped."""

    def __init__(self, port, count, interval=0.5):
        self.stop_event = threading.Event()
        self.sockets = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]
        self.thread = threading.Thread(target=self._trickle, args=(interval,))
        self.thread.start()

    def _trickle(self, interval):
        header = b"POST /api/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
        for i in range(len(header)):
            for s in self.sockets:
                try:
                    s.send(header[i:i + 1])
                except OSError:
                    pass  # the server closed it: fine
            if self.stop_event.wait(interval):
                return

    def stop(self):
        self.stop_event.set()
        self.thread.join()
        for s in self.sockets:
            s.close()


def idle_keep_alive_clients(port, count):
    """`count` connections that made one request each and now stay open, idle."""
    connections = []
    for _ in range(count):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/api/models")
        reply = connection.getresponse()
        reply.read()
        assert reply.status == 200 and reply.getheader("Connection", "").lower() != "close"
        connections.append(connection)
    return connections


def test_slow_and_idle_clients_leave_room_for_a_new_one(server):
    port = port_of(server)
    timed_request(port)  # the server's first computation warms the library up (~0.1 s), not measured
    slow = SlowClients(port, 16)
    idle = idle_keep_alive_clients(port, 16)
    try:
        time.sleep(0.3)  # the slow clients' first bytes are in
        figures = [timed_request(port) for _ in range(5)]
    finally:
        slow.stop()
        for connection in idle:
            connection.close()
    seconds = [s for s, _ in figures]
    print(f"\n16 slow + 16 idle clients: a new client's request took {[round(s * 1000, 1) for s in seconds]} ms")
    assert all(status == 200 for _, status in figures), figures
    # A client locked out behind the others waits for one of them to time out: the idle ones'
    # keep-alive runs out 1.7 s after the 0.3 s above (1.68 s measured with 24 workers), the slow
    # ones never.
    assert max(seconds) < (KEEP_ALIVE - 0.3) * (0.75 if SANITIZED else 0.6), seconds


def test_idle_keep_alive_connections_are_closed_after_a_short_time(server):
    connection = idle_keep_alive_clients(port_of(server), 1)[0]
    start = time.monotonic()
    connection.sock.settimeout(10)
    assert connection.sock.recv(1) == b""  # the server's close, not data
    seconds = time.monotonic() - start
    connection.close()
    print(f"\nan idle keep-alive connection was closed after {seconds:.2f} s")
    assert seconds < KEEP_ALIVE + MARGIN, seconds


def test_a_request_that_pauses_too_long_is_dropped(server):
    """A header begun and then left: the server answers 400 (as JSON) and closes the connection
    after two read timeouts of 2 s (httplib waits once for the line and once more); it took 10 s
    with the earlier 5 s timeout."""
    s = socket.create_connection(("127.0.0.1", port_of(server)), timeout=10)
    s.sendall(b"GET /api/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    start = time.monotonic()
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    seconds = time.monotonic() - start
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and "error" in json.loads(body), data
    print(f"\na stalled request was answered and closed after {seconds:.2f} s")
    assert seconds < 2 * READ_TIMEOUT + MARGIN, seconds


def test_keep_alive_answers_do_not_wait_for_delayed_acks(server):
    """With Nagle's algorithm on, each answer on a kept-alive connection waited ~40 ms for the
    client's delayed ACK (44 ms measured, against 1.8 ms on fresh connections). The same request
    is timed on the kept-alive connection and on fresh ones, interleaved so that both see the same
    load and build (ASan runs this too): a kept-alive answer may not be 20 ms slower in the median,
    half the smallest delayed-ACK stall, however slow the computation itself."""
    port = port_of(server)
    timed_request(port)  # the server's first computation warms the library up, not measured
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    kept, fresh = [], []
    for _ in range(20):
        start = time.monotonic()
        connection.request("POST", "/api/attention", REQUEST, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        reply.read()
        kept.append(time.monotonic() - start)
        assert reply.status == 200
        seconds, status = timed_request(port)
        fresh.append(seconds)
        assert status == 200
    connection.close()
    kept_median, fresh_median = statistics.median(kept), statistics.median(fresh)
    print(f"\nmedian of 20: keep-alive {kept_median * 1000:.1f} ms, fresh connections {fresh_median * 1000:.1f} ms")
    assert kept_median < fresh_median + 0.020, (kept, fresh)


def burst(port, count):
    """`count` connections opened at once, each sending one request; the answers' statuses, or
    the exception's name for a connection that failed."""
    results = [None] * count
    barrier = threading.Barrier(count)

    def one(i):
        barrier.wait()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
                s.sendall(b"GET /api/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            results[i] = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else repr(data[:40])
        except OSError as e:
            results[i] = type(e).__name__

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_a_burst_of_simultaneous_connections_is_served_not_reset(server):
    results = burst(port_of(server), 100)
    failed = [r for r in results if r != 200]
    assert not failed, f"{len(failed)} of 100 failed: {failed[:5]}"


def test_a_second_server_cannot_take_the_same_port(server):
    try:  # with SO_REUSEPORT the second bound too and served forever, taking half the connections
        result = subprocess.run([QKV_BIN, "serve", "--port", str(port_of(server))], capture_output=True, text=True,
                                timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("a second qkv serve bound the port of the first and kept running")
    assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{port_of(server)}" in result.stderr, result
