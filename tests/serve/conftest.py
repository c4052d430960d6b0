"""pytest setup for the explorer's tests (tests/serve): run by ctest (serve.cmake) with
QKV_BIN=<the qkv binary>, QKV_MODEL=<a model `qkv train --save` wrote> and QKV_OUT=<a build dir>.

Every server is a real `qkv serve --port 0` on 127.0.0.1 (loopback only); it prints its URL,
which the fixture reads, and is stopped with SIGINT, which must end it cleanly (exit 0).
"""
import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.request

import pytest

QKV_BIN = os.environ.get("QKV_BIN", "")
QKV_MODEL = os.environ.get("QKV_MODEL", "")
QKV_OUT = os.environ.get("QKV_OUT", "")


class Server:
    """A running `qkv serve` and helpers to talk to it."""

    def __init__(self, args):
        if not QKV_BIN or not os.path.exists(QKV_BIN):
            pytest.fail(f"QKV_BIN={QKV_BIN!r} is not the qkv binary; run these tests through ctest")
        self.process = subprocess.Popen([QKV_BIN, "serve", "--host", "127.0.0.1", "--port", "0", *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        if not match:
            self.process.kill()
            pytest.fail(f"qkv serve printed no URL: {line!r} {self.process.stderr.read()!r}")
        self.url = f"http://127.0.0.1:{match.group(1)}"

    def request(self, path, body=None, method=None, headers=None):
        """(status, parsed JSON or text, headers) of one request; HTTP errors are answers too."""
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})} if data is not None else headers or {}
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                status, raw, reply_headers = reply.status, reply.read(), reply.headers
        except urllib.error.HTTPError as e:
            status, raw, reply_headers = e.code, e.read(), e.headers
        text = raw.decode()
        if reply_headers.get("Content-Type", "").startswith("application/json"):
            return status, json.loads(text), reply_headers
        return status, text, reply_headers

    def attention(self, body):
        status, answer, _ = self.request("/api/attention", body)
        return status, answer

    def stop(self, sig=signal.SIGINT):
        """Stops the server with `sig`; returns (exit code, stdout, stderr)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            out, err = self.process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            pytest.fail(f"qkv serve did not stop within 20 s of signal {sig}: {err}")
        return self.process.returncode, out, err


@pytest.fixture
def server():
    """A server with the model of QKV_MODEL loaded; it must stop cleanly on Ctrl-C afterwards."""
    if not QKV_MODEL or not os.path.exists(QKV_MODEL):
        pytest.fail(f"QKV_MODEL={QKV_MODEL!r} is not a model file; ctest's serve_model_train makes it")
    s = Server(["--model", QKV_MODEL])
    yield s
    code, out, err = s.stop()
    assert code == 0, f"qkv serve exited {code} after Ctrl-C: {err}"
    assert "stopped (Ctrl-C)" in out
