"""The explorer's HTTP API, against a real `qkv serve` on a free loopback port (conftest.py)."""
import json
import math
import os
import signal

import pytest

from conftest import QKV_MODEL, Server

MODEL_NAME = os.path.basename(QKV_MODEL)


def assert_rows_sum_to_one(weights):
    # Weights travel rounded to 4 significant digits: a row sums to 1 within 1e-3.
    for head in weights:
        for row in head:
            assert math.isclose(sum(row), 1.0, abs_tol=1e-3), row


def test_page_and_its_files_are_served_with_a_strict_policy(server):
    status, page, headers = server.request("/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert 'id="temperature"' in page and '<script src="/explorer.js">' in page
    # Nothing from the internet: no absolute URL in the page, and the policy forbids other origins.
    assert "http://" not in page and "https://" not in page
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for path, kind in [("/explorer.js", "text/javascript"), ("/explorer.css", "text/css")]:
        status, body, headers = server.request(path)
        assert status == 200 and headers["Content-Type"].startswith(kind) and len(body) > 500
        # The one URL-like string allowed: the SVG namespace, a name that is never fetched.
        body = body.replace('"http://www.w3.org/2000/svg"', "")
        assert "https://" not in body and "http://" not in body


def test_default_request_gives_every_head_and_its_entropy(server):
    status, answer = server.attention({"text": "The cat sat on the mat"})
    assert status == 200, answer
    assert answer["tokens"] == ["The", "cat", "sat", "on", "the", "mat"]
    assert answer["heads"] == 8 and answer["embed"] == 64 and answer["temperature"] == 1.0
    assert len(answer["weights"]) == 8 and all(len(h) == 6 and all(len(r) == 6 for r in h) for h in answer["weights"])
    assert_rows_sum_to_one(answer["weights"])
    # entropy[h] is head h's mean row entropy, computed here from the weights themselves.
    for head, entropy in zip(answer["weights"], answer["entropy"]):
        expected = sum(-sum(w * math.log(w) for w in row if w > 0) for row in head) / len(head)
        assert math.isclose(entropy, expected, abs_tol=2e-3)  # from the weights before rounding
    assert math.isclose(answer["uniform_entropy"], math.log(6))
    average = [[sum(h[i][j] for h in answer["weights"]) / 8 for j in range(6)] for i in range(6)]
    for row, expected in zip(answer["average"], average):
        assert row == pytest.approx(expected, abs=2e-4)  # each rounded to 4 significant digits


def test_answers_are_compact_and_never_compressed(server):
    """4 significant digits a weight, a "visible" row per query, and no Brotli or gzip even for a
    client that accepts them: compressing 578 KB took 0.4-1.3 s, sending it on loopback 25 ms."""
    text = " ".join(f"w{i % 12}" for i in range(64))
    status, answer, headers = server.request("/api/attention", {"text": text, "heads": 16, "mask": "causal"},
                                             headers={"Accept-Encoding": "gzip, deflate, br"})
    assert status == 200 and "Content-Encoding" not in headers
    assert all(len(repr(w).lstrip("0.").split("e")[0].replace(".", "")) <= 4 or w == 0
               for head in answer["weights"] for row in head for w in row)
    assert answer["visible"] == ["1" * (i + 1) + "0" * (63 - i) for i in range(64)]


def test_temperature_sharpens_and_softens_as_softmax_says(server):
    """weights at T are softmax(scores / T): each row is proportional to (weights at 1) ** (1 / T)."""
    base = {"text": "The cat sat on the mat", "heads": 2, "embed": 16, "seed": 7}
    _, at_one = server.attention(base)
    for t in (0.1, 3.0):
        status, answer = server.attention({**base, "temperature": t})
        assert status == 200
        for head_one, head_t in zip(at_one["weights"], answer["weights"]):
            for row_one, row_t in zip(head_one, head_t):
                powered = [w ** (1 / t) for w in row_one]
                expected = [p / sum(powered) for p in powered]
                # Both rows are rounded to 4 significant digits (0.05% each); powered by 1 / T = 10
                # that is up to 0.5%, 1% after normalising.
                assert row_t == pytest.approx(expected, rel=1.2e-2, abs=1e-4)
    _, cold = server.attention({**base, "temperature": 0.05})
    _, hot = server.attention({**base, "temperature": 5})
    assert max(cold["entropy"]) < min(at_one["entropy"]) and min(hot["entropy"]) > max(at_one["entropy"])


@pytest.mark.parametrize("mask, visible", [
    ("causal", lambda i, j: j <= i),
    ("window(1)", lambda i, j: i - 1 <= j <= i),
    ("window(1, 2)", lambda i, j: i - 1 <= j <= i + 2),
    ("causal & window(2)", lambda i, j: i - 2 <= j <= i),
    ("padding(3)", lambda i, j: j < 3),
    ("none", lambda i, j: True),
])
def test_masks_hide_exactly_the_keys_they_say(server, mask, visible):
    status, answer = server.attention({"text": "one two three four five six", "heads": 2, "embed": 8, "mask": mask})
    assert status == 200, answer
    for head in answer["weights"]:
        for i, row in enumerate(head):
            for j, w in enumerate(row):
                assert (w > 0) == visible(i, j), (mask, i, j, w)
    assert_rows_sum_to_one(answer["weights"])


def test_models_lists_the_start_up_files_and_computes_their_layers(server):
    status, answer, _ = server.request("/api/models")
    assert status == 200
    assert [m["name"] for m in answer["models"]] == [MODEL_NAME]
    model = answer["models"][0]
    assert model["layers"] == 2 and model["heads"] == 4 and model["task"] == "copy"
    # Letters of the model's vocabulary: the text itself is run; each layer is causal.
    status, answer = server.attention({"text": "b a d c", "model": MODEL_NAME})
    assert status == 200, answer
    assert answer["tokens"] == ["b", "a", "d", "c"] and answer["note"].startswith("on your text")
    assert len(answer["layers"]) == 2
    for layer in answer["layers"]:
        assert len(layer["weights"]) == 4 and len(layer["entropy"]) == 4
        assert_rows_sum_to_one(layer["weights"])
        assert all(w == 0 for head in layer["weights"] for i, row in enumerate(head) for w in row[i + 1:])
    # Words it does not know: one example of its task instead, and the answer says so.
    status, answer = server.attention({"text": "The cat sat", "model": MODEL_NAME})
    assert status == 200 and "not your text" in answer["note"] and "|" in answer["tokens"]


@pytest.mark.parametrize("body, message", [
    (b"{not json", "malformed JSON: parse error at line 1, column 3: syntax error while parsing object key"),
    (b"[1, 2]", "the body must be a JSON object, got [1,2]"),
    ({"heads": 2}, '"text" is missing'),
    ({"text": 5}, '"text" must be a string, got 5'),
    ({"text": "a", "heads": "8"}, '"heads" must be a whole number, got "8"'),
    ({"text": "a", "heads": 0}, '"heads" must be between 1 and 16, got 0'),
    ({"text": "a", "heads": 2 ** 63}, '"heads" must be between 1 and 16'),
    ({"text": "a", "embed": 64, "heads": 3}, '"embed" (64) must be divisible by "heads" (3)'),
    ({"text": "a", "seed": -1}, '"seed" must be between 0 and'),
    ({"text": "a", "temperature": 0}, '"temperature" must be above 0 and at most 100, got 0'),
    ({"text": "a", "temperature": -1.5}, '"temperature" must be above 0 and at most 100, got -1.5'),
    ({"text": "a", "temperature": "hot"}, '"temperature" must be a number, got "hot"'),
    ({"text": "a", "mask": "causal & windw(3)"}, "mask 'causal & windw(3)': column 10, found 'windw': unknown mask"),
    ({"text": "a", "mask": "window(3"}, "mask 'window(3': column 9, found the end: expected ')'"),
    ({"text": "a b", "mask": "padding(3)"}, "padding(3) keeps more keys than the 2 tokens there are"),
    ({"text": "a", "mask": 3}, '"mask" must be a string, got 3'),
    ({"text": "a", "model": "../../etc/passwd"}, 'unknown model "../../etc/passwd"; the server was started with --model'),
    ({"text": "a", "model": MODEL_NAME, "temperature": 2}, '"temperature" applies to the untrained layer'),
    ({"text": "a", "colour": "red"}, 'unknown field "colour"'),
    ({"text": "   "}, '"text" has no tokens'),
    ({"text": "word " * 65}, '"text" has 65 tokens; the explorer shows at most 64'),
    ({"text": "x" * 2001}, '"text" has 2001 bytes; the limit is 2000'),
    ({"text": "a" * 16000 + " " * 385}, "request body has 16397 bytes; the limit is 16384"),
])
def test_bad_input_is_a_400_that_says_what_is_wrong(server, body, message):
    status, answer = server.attention(body)
    assert status == 400, answer
    assert message in answer["error"], answer["error"]


def test_the_server_survives_bad_input_and_answers_errors_as_json(server):
    status, answer, _ = server.request("/api/attention", b"x" * 100_000)  # beyond 4 x the body limit
    assert status == 413 and answer == {"error": "request body too large"}
    status, answer, _ = server.request("/no/such/page")
    assert status == 404 and "no such page or API: GET /no/such/page" in answer["error"]
    status, answer, _ = server.request("/api/attention", method="GET")
    assert status in (404, 405) and "error" in answer
    assert server.attention({"text": "still here"})[0] == 200


def raw_request(server, host_line):
    """(status, parsed JSON body) of GET /api/models sent with exactly this Host line."""
    import socket
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /api/models HTTP/1.1\r\n" + host_line + b"Connection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


@pytest.mark.parametrize("host", ["attacker.example:80", "127.attacker.example", "127.0.0.1.evil", "[::1]evil",
                                  "127.0.0.1:80@evil", "localhost.evil", "127.0.0.2", "0.0.0.0", "127.1", ""])
def test_a_host_not_on_the_list_is_refused_as_json(server, host):
    """A page elsewhere reaching the explorer through a name that resolves to 127.0.0.1."""
    status, answer = raw_request(server, f"Host: {host}\r\n".encode())
    assert status == 403 and f"Host '{host}' is not a name of this server (127.0.0.1, localhost, [::1])" in answer["error"]


def test_the_names_of_this_server_are_answered(server):
    port = server.url.rsplit(":", 1)[1]
    for host in ["127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", "[::1]", f"[::1]:{port}"]:
        assert raw_request(server, f"Host: {host}\r\n".encode())[0] == 200, host
    status, answer = raw_request(server, b"")  # no Host at all
    assert status == 403 and "Host '' is not a name of this server" in answer["error"]
    status, answer = raw_request(server, b"Host: local\x01host\r\n")
    assert status == 403 and "Host 'local\\u0001host'" in answer["error"]


def test_allow_host_adds_names():
    s = Server(["--allow-host", "my-laptop.local", "--allow-host", "10.1.2.3"])
    try:
        port = s.url.rsplit(":", 1)[1]
        for host in ["my-laptop.local", f"my-laptop.local:{port}", "10.1.2.3"]:
            assert raw_request(s, f"Host: {host}\r\n".encode())[0] == 200, host
        status, answer = raw_request(s, b"Host: evil.my-laptop.local\r\n")
        assert status == 403 and "(127.0.0.1, localhost, [::1], my-laptop.local, 10.1.2.3)" in answer["error"]
    finally:
        assert s.stop()[0] == 0


@pytest.mark.parametrize("args, message", [
    (["--host", ""], "--host is empty: give the address to listen on"),
    (["--host", "127.0.0.1:80"], "--host '127.0.0.1:80' is not a host name or an address"),
    (["--allow-host", "evil.example:80"], "--allow-host 'evil.example:80' is not a host name or an address"),
])
def test_bad_host_options_refuse_to_start(args, message):
    import subprocess
    from conftest import QKV_BIN
    result = subprocess.run([QKV_BIN, "serve", "--port", "0", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message in result.stderr, result


def test_a_nul_byte_in_a_mask_is_shown_escaped(server):
    status, answer = server.attention({"text": "a b", "mask": "causal\0 & window(1)"})
    assert status == 400
    assert answer["error"] == ("mask 'causal\\u0000 & window(1)': column 7, found '\\u0000': a control character, "
                               "not part of a mask")


def test_sigterm_also_stops_cleanly():
    s = Server([])
    assert s.request("/api/models")[1] == {"models": []}
    code, out, _ = s.stop(signal.SIGTERM)
    assert code == 0 and "stopped (SIGTERM)" in out


def test_ctrl_c_right_after_start_stops_cleanly():
    """The signal is caught from before the URL is printed, even before the server is listening."""
    for _ in range(5):
        code, out, err = Server([]).stop(signal.SIGINT)
        assert code == 0 and "stopped (Ctrl-C)" in out, (code, out, err)


def test_models_come_only_from_start_up_files_and_bad_ones_refuse_to_start():
    import subprocess
    from conftest import QKV_BIN
    result = subprocess.run([QKV_BIN, "serve", "--port", "0", "--model", "/no/such/model.qkv"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "cannot open '/no/such/model.qkv'" in result.stderr
    result = subprocess.run([QKV_BIN, "serve", "--port", "0", "--model", QKV_MODEL, "--model", QKV_MODEL],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "are both named" in result.stderr
    result = subprocess.run([QKV_BIN, "serve", "--port", "0", "--max-concurrent", "0"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "--max-concurrent must be between 1 and 64, got 0" in result.stderr


def test_garbage_never_crashes_the_server(server):
    """Random bytes, deep nesting and odd JSON values: every one a 400 with an error, then still up."""
    import random
    seed = random.randrange(2 ** 32)
    rng = random.Random(seed)
    bodies = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))) for _ in range(100)]
    bodies += [b"[" * 8000 + b"]" * 8000, b'{"text": ' + b"[" * 5000 + b"]" * 5000 + b"}",
               b'{"text": "a", "heads": 1e400}', b'{"text": "a", "temperature": NaN}', b'{"text": "\\ud800"}',
               b'{"text": "a", "seed": 18446744073709551616}', b'{"text": "a"} trailing', b"\x00" * 1000]
    for body in bodies:
        status, answer, _ = server.request("/api/attention", body)
        assert status == 400 and isinstance(answer, dict) and answer.get("error"), (seed, body[:60], status, answer)
    assert server.attention({"text": "still here"})[0] == 200


def test_another_host_is_warned_about():
    """192.0.2.1 (TEST-NET-1, documentation only) is not an address of this machine: the warning is
    printed, then binding fails with a clear error, and no socket beyond loopback is ever open."""
    import subprocess
    from conftest import QKV_BIN
    result = subprocess.run([QKV_BIN, "serve", "--host", "192.0.2.1", "--port", "0"],
                            capture_output=True, text=True, timeout=30)
    assert "warning: listening on 192.0.2.1, not loopback" in result.stderr
    assert result.returncode == 2 and "cannot listen on 192.0.2.1:0" in result.stderr


QKV_TINY = os.environ.get("QKV_TINY", "")


@pytest.fixture
def folders_server():
    """A server with qkv_make_tiny_model's gpt2 and bert folders (QKV_TINY, set by serve.cmake) beside the .qkv model."""
    if not QKV_TINY or not os.path.isdir(os.path.join(QKV_TINY, "gpt2")):
        pytest.fail(f"QKV_TINY={QKV_TINY!r} does not hold qkv_make_tiny_model's folders; run through ctest")
    s = Server(["--model", QKV_MODEL, "--model", os.path.join(QKV_TINY, "gpt2"), "--model", os.path.join(QKV_TINY, "bert")])
    yield s
    code, _, err = s.stop()
    assert code == 0, err


def test_model_folders_over_http_and_bad_input_leaves_the_server_up(folders_server):
    status, listing, _ = folders_server.request("/api/models")
    assert status == 200
    kinds = {m["name"]: m["kind"] for m in listing["models"]}
    assert kinds == {MODEL_NAME: "qkv", "gpt2": "pretrained", "bert": "pretrained"}
    status, answer = folders_server.attention({"model": "gpt2", "text": "the cat sat"})
    assert status == 200, answer
    n = len(answer["tokens"])
    assert len(answer["layers"]) == 2 and all(len(h) == n for layer in answer["layers"] for h in layer["weights"])
    for layer in answer["layers"]:
        assert_rows_sum_to_one(layer["weights"])
    assert len(answer["prediction"]["top"]) == 5
    bad = [{"model": "gpt9", "text": "a"}, {"model": "gpt2", "text": "the " * 70}, {"model": "gpt2", "ids": [1, 10**6]},
           {"model": "gpt2", "text": "a", "mask": "causal"}, {"model": "bert", "text": "a", "neuron": {"layer": 5, "head": 0, "query": 0}}]
    for body in bad:
        status, error = folders_server.attention(body)
        assert status == 400 and error["error"], (body, error)
    status, error, _ = folders_server.request("/api/attention", b'{"model": "gpt2", "text": "a\xff"}')
    assert status == 400 and "error" in error
    status, answer = folders_server.attention({"model": "bert", "text": "the [MASK] sat"})
    assert status == 200 and answer["prediction"]["masks"][0]["position"] == 2
