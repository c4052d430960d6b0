#!/usr/bin/python3
"""ctest's smoke test of bench/peers/run.py (registered in bench/CMakeLists.txt as peers_smoke).

    /usr/bin/python3 bench/peers/smoke_test.py --qkv build/release/tools/qkv/qkv [--cache DIR]

Runs run.py on W0, one round, --offline (it downloads and builds nothing), with whichever peers
are already there: PyTorch always (make test installs python3-torch), ONNX Runtime and ggml when
a run of run.py left them in the cache folder, else they are skipped with a note, which this test
prints. It checks that the table parses (header, one W0 row: a number or '-' per peer, qkv's ms,
the ratio, the best peer) and agrees with the --json output. It never judges a speed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMNS = ["torch", "ort", "ggml", "qkv"]
TITLES = {"torch": "torch", "ort": "ORT", "ggml": "ggml", "qkv": "qkv"}


def fail(message, output=""):
    print(f"peers smoke test: FAILED: {message}")
    if output:
        print(output)
    sys.exit(1)


def parse_row(line):
    """A table row: (workload, {column: ms or None}, ratio or None, best peer); shapes hold spaces,
    so the cells are read from the right."""
    tokens = line.split()
    if len(tokens) < 7:
        raise ValueError(f"too few cells: {line!r}")
    best, ratio, cells = tokens[-1], tokens[-2], tokens[-6:-2]
    number = lambda t: None if t == "-" else float(t)  # noqa: E731
    return tokens[0], dict(zip(COLUMNS, map(number, cells))), number(ratio), best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qkv", required=True)
    parser.add_argument("--cache", default=None, help="run.py's cache folder (default: its own default)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        json_path = os.path.join(folder, "peers.json")
        command = [sys.executable, os.path.join(HERE, "run.py"), "--workloads", "W0", "--rounds", "1", "--offline",
                   "--qkv", args.qkv, "--qkv-runs", "3", "--json", json_path]
        if args.cache:
            command += ["--cache", args.cache]
        start = time.monotonic()
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
        seconds = time.monotonic() - start
        output = result.stdout + result.stderr
        if result.returncode != 0:
            fail(f"run.py exited with {result.returncode}", output)
        with open(json_path) as f:
            data = json.load(f)

    lines = result.stdout.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("workload ")), None)
    if header is None or not lines[0].startswith("qkv against its peers") or not lines[1].startswith("machine: "):
        fail("no title, machine line or table header", result.stdout)
    if not all(f"{TITLES[c]} ms" in lines[header] for c in COLUMNS) or "qkv/best" not in lines[header]:
        fail("the header lacks a column", lines[header])
    rows = [line for line in lines[header + 2:] if line.strip() and not line.startswith(" ")]
    rows = [line for line in rows if line.split()[0] == "W0"]
    if len(rows) != 1:
        fail("expected one W0 row", result.stdout)
    try:
        workload, cells, ratio, best = parse_row(rows[0])
    except ValueError as error:
        fail(f"the W0 row does not parse: {error}", result.stdout)

    peers = data["peers"]
    (row,) = [r for r in data["rows"] if r["workload"] == "W0"]
    for name in COLUMNS:
        present = peers[name]["present"]
        if present != (cells[name] is not None):
            fail(f"{name}: the table says {cells[name]}, the JSON present={present}", result.stdout)
        if present:
            if not cells[name] > 0 or abs(cells[name] - row["ms"][name]) > 0.0006:
                fail(f"{name}: table {cells[name]} vs JSON {row['ms'][name]}", result.stdout)
        elif not peers[name]["note"] or f"skipped: {peers[name]['note']}" not in result.stdout:
            fail(f"{name} absent without a note in the table", result.stdout)
    if not peers["torch"]["present"]:
        fail("PyTorch is absent (apt-get install python3-torch; make test installs it): "
             + peers["torch"]["note"], result.stdout)
    expected = row["ms"]["qkv"] / row["ms"][row["best_peer"]]
    if ratio is None or abs(ratio - expected) > 0.006 or TITLES[row["best_peer"]] != best:
        fail(f"ratio {ratio} / best peer {best} vs the JSON's {expected:.3f} / {row['best_peer']}", result.stdout)
    if not data["machine"]["model_name"] or data["threads"] != 2:
        fail("the JSON lacks the machine or the thread count", json.dumps(data))

    print(result.stdout)
    for name in ("ort", "ggml"):
        if not peers[name]["present"]:
            print(f"note: {TITLES[name]} skipped: {peers[name]['note']}")
    timed = [TITLES[n] for n in COLUMNS if peers[n]["present"]]
    print(f"peers smoke test: passed in {seconds:.0f} s ({', '.join(timed)} timed on W0)")


if __name__ == "__main__":
    main()
