"""A bounded load test of `qkv serve` on 127.0.0.1 only: 8 clients x 200 requests at once, each
client on its own keep-alive connection, mixing the page's requests (temperatures, masks, head
counts, the trained model). Every answer must be the expected one (no error, no busy 503), the
whole run must end within its time bound, and the server's resident memory after the run must
not have grown beyond MAX_GROWTH_MIB over what it was after a warm-up (allocator arenas and the
thread pool are set up by then). The figures are printed and written to $QKV_OUT/load.json.
"""
import http.client
import json
import os
import threading
import time

from conftest import QKV_MODEL, QKV_OUT

CLIENTS = 8
REQUESTS = 200
WARM_UP = 25            # requests per client before the memory is first measured
TIME_BOUND_S = 240      # the whole measured run; generous for the sanitizer build on a shared machine
# Under AddressSanitizer (QKV_SANITIZED=1, the sanitizer build) the allocator keeps a quarantine
# and per-thread caches that grow by several MiB on their own (7.7 MiB measured); there
# LeakSanitizer, run when the server exits, is what catches a leak, and this bound only a runaway.
SANITIZED = os.environ.get("QKV_SANITIZED") == "1"
MAX_GROWTH_MIB = 32.0 if SANITIZED else 8.0

SENTENCES = ["The cat sat on the mat", "the quick brown fox jumps over the lazy dog",
             "attention is all you need", "a b c d e f g h i j k l m n o p"]
MASKS = ["none", "causal", "window(2)", "causal & window(3)", "padding(4)", "window(1, 1)"]


def request_body(client, i):
    """The i-th request of a client: mostly the untrained layer, every seventh the trained model."""
    if i % 7 == 3:
        return {"text": "b a d | b a", "model": os.path.basename(QKV_MODEL), "mask": "none"}
    return {"text": SENTENCES[(client + i) % len(SENTENCES)], "heads": [1, 2, 4, 8][i % 4], "embed": 32,
            "seed": client, "temperature": round(0.05 + (i % 50) / 10, 2), "mask": MASKS[i % len(MASKS)]}


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def run_clients(port, count, errors, deadline):
    """CLIENTS threads, each sending `count` requests on one connection; failures into `errors`."""
    def client(c):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for i in range(count):
            if time.monotonic() > deadline:
                errors.append(f"client {c}: out of time at request {i}")
                return
            body = json.dumps(request_body(c, i))
            try:
                connection.request("POST", "/api/attention", body, {"Content-Type": "application/json"})
                reply = connection.getresponse()
                answer = json.loads(reply.read())
            except Exception as e:  # a dropped connection is an error too
                errors.append(f"client {c} request {i}: {e!r}")
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                continue
            if reply.status != 200 or ("weights" not in answer and "layers" not in answer):
                errors.append(f"client {c} request {i}: HTTP {reply.status} {str(answer)[:200]}")
        connection.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_eight_clients_two_hundred_requests_each(server):
    port = int(server.url.rsplit(":", 1)[1])
    pid = server.process.pid
    errors = []
    run_clients(port, WARM_UP, errors, time.monotonic() + TIME_BOUND_S)
    assert not errors, errors[:5]
    before = rss_mib(pid)

    start = time.monotonic()
    run_clients(port, REQUESTS, errors, start + TIME_BOUND_S)
    seconds = time.monotonic() - start
    after = rss_mib(pid)

    figures = {"build": "sanitizer" if SANITIZED else "optimised", "clients": CLIENTS, "requests_per_client": REQUESTS, "errors": len(errors),
               "seconds": round(seconds, 2), "requests_per_second": round(CLIENTS * REQUESTS / seconds, 1),
               "rss_before_mib": round(before, 1), "rss_after_mib": round(after, 1),
               "rss_growth_mib": round(after - before, 1), "max_growth_mib": MAX_GROWTH_MIB}
    print("\nload test:", json.dumps(figures))
    if QKV_OUT:
        with open(os.path.join(QKV_OUT, "load.json"), "w") as out:
            json.dump(figures, out, indent=2)
    assert not errors, f"{len(errors)} errors, first: {errors[:5]}"
    assert seconds < TIME_BOUND_S
    assert after - before < MAX_GROWTH_MIB, f"RSS grew from {before:.1f} to {after:.1f} MiB"
    # Still answering, and stops cleanly afterwards (the fixture checks the exit).
    assert server.attention({"text": "still here"})[0] == 200
