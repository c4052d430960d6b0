#!/usr/bin/env python3
"""A probe of `qkv serve` from outside, on loopback only: starts `qkv serve --port 0` on
127.0.0.1, throws at it what a hostile or broken client might (bad Host headers, slow clients,
idle keep-alive connections, bursts of simultaneous connections, NUL bytes, oversize bodies,
malformed JSON) and checks that every rejection is a clear JSON error, that a normal request
still gets through quickly meanwhile, and that the server neither crashes nor hangs. Exits 1 on
any failure, printing each one.

    python3 tests/serve/probe_server.py --qkv build/release/qkv              # the CI size
    python3 tests/serve/probe_server.py --qkv build/release/qkv --scale 4    # 4x the clients

ctest runs it as serve_probe at scale 1 (tests/serve/serve.cmake). Every socket has a timeout,
every loop a bound; the whole probe takes a few seconds at scale 1.
"""
import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

TIMEOUT_S = 10  # any single exchange; beyond it is a hang


class Probe:
    def __init__(self, qkv):
        self.process = subprocess.Popen([qkv, "serve", "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", self.process.stdout.readline())
        if not match:
            self.process.kill()
            sys.exit(f"probe: qkv serve printed no URL: {self.process.stderr.read()}")
        self.port = int(match.group(1))
        self.failures = []
        self.checks = 0

    def fail(self, what):
        self.failures.append(what)
        print(f"FAIL {what}", flush=True)

    def exchange(self, raw):
        """Sends raw bytes on a fresh connection; (status, headers bytes, body bytes), or None for
        no answer (then a failure is recorded by the caller)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT_S) as s:
            try:
                s.sendall(raw)
            except OSError:
                pass  # the server may answer and close before reading everything (413)
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except ConnectionResetError:
                pass
        head, _, body = data.partition(b"\r\n\r\n")
        match = re.match(rb"HTTP/1\.1 (\d{3}) ", head)
        return (int(match.group(1)), head, body) if match else None

    def expect_error(self, name, raw, status):
        """One request that must be refused with `status` and a JSON {"error": text}."""
        self.checks += 1
        try:
            answer = self.exchange(raw)
        except OSError as e:
            return self.fail(f"{name}: {type(e).__name__} {e}")
        if answer is None:
            return self.fail(f"{name}: no HTTP answer")
        got, head, body = answer
        try:
            error = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            return self.fail(f"{name}: HTTP {got} without a JSON error: {body[:80]!r}")
        if got != status or not isinstance(error, str) or not error or any(ord(c) < 0x20 for c in error):
            return self.fail(f"{name}: HTTP {got} {error!r}, expected {status} with a printable message")

    def alive_and_quick(self, name, bound_s=1.0):
        """A normal request on a fresh connection answers 200 within bound_s; its time in ms."""
        self.checks += 1
        body = json.dumps({"text": "The cat sat on the mat", "heads": 2, "embed": 16}).encode()
        start = time.monotonic()
        try:
            answer = self.exchange(post(body))
        except OSError as e:
            answer = e
        seconds = time.monotonic() - start
        if self.process.poll() is not None:
            self.fail(f"{name}: the server exited with {self.process.returncode}")
        elif not isinstance(answer, tuple) or answer[0] != 200 or seconds > bound_s:
            self.fail(f"{name}: a normal request got {answer!r:.80} after {seconds:.2f} s")
        return round(seconds * 1000, 1)

    def stop(self):
        if self.process.poll() is not None:
            self.fail(f"the server exited by itself with {self.process.returncode}: {self.process.stderr.read()[-500:]}")
            return
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.fail("the server did not stop within 20 s of Ctrl-C")
        if code != 0:
            self.fail(f"the server exited {code} after Ctrl-C")


def post(body, host=b"127.0.0.1", extra=b""):
    return (b"POST /api/attention HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json\r\n" + extra +
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


def bad_requests(probe):
    """Bad Hosts, NUL bytes, oversize bodies, malformed JSON: each a clear JSON error."""
    ok = json.dumps({"text": "a b"}).encode()
    for host in [b"attacker.example", b"127.attacker.example", b"127.0.0.1.evil", b"[::1]evil", b"127.0.0.1:80@evil",
                 b"localhost.", b"127.1", b"127.0.0.1:1", b"a\x00b", b"x" * 2000]:
        probe.expect_error(f"Host {host[:30]!r}", post(ok, host=host), 403)
    for body in [b'{"text": "a b", "mask": "causal\\u0000"}', b'{"text": "a", "x\\u0000y": 1}',
                 b'{"text": "a", "model": "\\u0000"}', b"\x00" * 100, b'{"text": "a\x00b"}']:
        probe.expect_error(f"NUL body {body[:30]!r}", post(body), 400)
    for body in [b"{", b'{"text": }', b"[1,2", b'{"text": "a"} x', b"\xff\xfe", b"[" * 20000,
                 b'{"text": "a", "heads": 1e999}']:
        probe.expect_error(f"malformed {body[:20]!r}", post(body), 400)
    probe.expect_error("a 20 KB body", post(b'{"text": "' + b"a " * 10000 + b'"}'), 400)
    probe.expect_error("a 100 KB body", post(b"x" * 100_000), 413)
    probe.expect_error("a 1 GB Content-Length", b"POST /api/attention HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Content-Length: 1000000000\r\n\r\n", 413)
    probe.expect_error("a path with NUL", b"GET /a%00b HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", 404)


class Holders:
    """Connections that hold the server's threads: `slow` sending a header a byte at a time
    (slowloris) and `idle` kept alive after one request."""

    def __init__(self, probe, slow, idle):
        self.stop_event = threading.Event()
        self.slow = [socket.create_connection(("127.0.0.1", probe.port), timeout=TIMEOUT_S) for _ in range(slow)]
        self.idle = []
        for _ in range(idle):
            s = socket.create_connection(("127.0.0.1", probe.port), timeout=TIMEOUT_S)
            s.sendall(b"GET /api/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            s.recv(65536)
            self.idle.append(s)
        self.thread = threading.Thread(target=self._trickle)
        self.thread.start()

    def _trickle(self):
        header = b"POST /api/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
        for i in range(len(header)):
            for s in self.slow:
                try:
                    s.send(header[i:i + 1])
                except OSError:
                    pass
            if self.stop_event.wait(0.5):
                return

    def close(self):
        self.stop_event.set()
        self.thread.join()
        for s in self.slow + self.idle:
            s.close()


def burst(probe, count):
    """`count` connections at once, one request each; how many failed (reset, timeout, not 200)."""
    failed = []
    barrier = threading.Barrier(count)

    def one():
        barrier.wait()
        try:
            answer = probe.exchange(b"GET /api/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            if answer is None or answer[0] != 200:
                failed.append(repr(answer)[:60])
        except OSError as e:
            failed.append(type(e).__name__)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * TIMEOUT_S)
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qkv", required=True, help="the qkv binary")
    parser.add_argument("--scale", type=int, default=1,
                        help="clients per phase: 16 x scale slow and idle, 100 x scale at once")
    args = parser.parse_args()
    if not 1 <= args.scale <= 4:
        sys.exit("probe: --scale must be between 1 and 4 (the server serves 256 connections at once)")
    probe = Probe(args.qkv)
    figures = {}
    try:
        bad_requests(probe)
        figures["alone_ms"] = probe.alive_and_quick("alone")
        holders = Holders(probe, 16 * args.scale, 16 * args.scale)
        try:
            time.sleep(0.3)
            figures["beside_slow_and_idle_ms"] = [probe.alive_and_quick("beside slow and idle clients") for _ in range(3)]
        finally:
            holders.close()
        for round_ in range(2):
            probe.checks += 1
            failed = burst(probe, 100 * args.scale)
            if failed:
                probe.fail(f"burst {round_}: {len(failed)} of {100 * args.scale} connections failed: {failed[:5]}")
        figures["after_bursts_ms"] = probe.alive_and_quick("after the bursts")
    finally:
        probe.stop()
    print(f"probe: {probe.checks} checks, {len(probe.failures)} failures; {json.dumps(figures)}")
    return 1 if probe.failures else 0


if __name__ == "__main__":
    sys.exit(main())
