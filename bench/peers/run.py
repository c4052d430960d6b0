#!/usr/bin/python3
"""qkv against its peers on the standard workloads W0-W5, in one sitting: one table.

    /usr/bin/python3 bench/peers/run.py [--workloads W0,W1,W2,W3,W4,W5] [--rounds 4] [--threads 2]
        [--ggml-src DIR] [--json [FILE]] [--offline]

Run it with Debian's /usr/bin/python3 (its python3-torch and python3-onnx), not a `python3` of
another install. It is a tool to run by hand, not a CI test (bench/peers/smoke_test.py is: it
runs this on W0 with whichever peers are already there).

The peers, each on the same shapes, float32, --threads threads (2 by default):
  torch  PyTorch 1.13 (python3-torch): it has no scaled_dot_product_attention (2.0 added it), so
         its math form softmax(q k^T / sqrt(d) + mask) v (torch_attention.py); W5 is
         torch.nn.MultiheadAttention (eval, no_grad)
  ORT    ONNX Runtime 1.30 through npm's onnxruntime-node (its prebuilt CPU library), installed
         into <cache>/node on first use; the com.microsoft MultiHeadAttention and
         GroupQueryAttention contrib ops, the fastest form per workload, and for W5 a plain
         MatMul-Softmax-MatMul subgraph; models written with Debian's python3-onnx
         (onnx_models.py) and timed by a Node script (ort_attention.js)
  ggml   ggml's CPU flash attention, ggml_flash_attn_ext, f32 K/V and, on the 16-bit decode
         rows, f16 K/V (its 16-bit cache type; the W4-bf16 row shows its f16 time), on the
         quantized decode rows its q8_0 (W4-int8) and q4_0 (W4-int4) caches, run by
         ggml_graph_compute on a threadpool of --threads threads (ggml_attention.cpp). Built
         from the ggml checkout given by --ggml-src or $GGML_SRC (CMake, CPU backend only, -j2)
         into <cache>/ggml, never into this repository; without one, the column is skipped
  qkv    `qkv bench --workload ... --json --no-reference --no-gemm --threads N`, the fast path's
         (Auto) steady-state median of --qkv-runs calls
The cache folder is <repo>/build/peers unless --cache says otherwise. Missing peers are skipped
with a note. To install what the peers need (Debian 12):
    scripts/install-deps.sh peers     # python3-onnx, nodejs and npm (then this script runs npm)

Rounds alternate: round r runs every present peer once on all the workloads, in an order
rotated by r (so no peer always runs first or last), each peer a fresh process. A peer's time
per round is the median of its calls (one warm-up, then at least 10 calls and 0.2 s, 3 calls when
one takes over 1 s); the table shows the best (lowest) of the rounds, per peer, and qkv's ratio
to the best peer: qkv's ms over the fastest peer's ms, below 1 when qkv is faster. The header
names the machine (lscpu: model, family and model number, the flags that matter) and the date.
The machine's load moves every figure: read a table from a shared machine as such.
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True  # importing onnx_models leaves no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ORT_VERSION = "1.30.0"

# The rows, as bench/workloads.hpp defines them (kind, B, Hq, Hkv, Nq, Nk, d, mask, K/V type).
ROWS = [
    ("W0", "attention", 1, 8, 8, 256, 256, 64, True, "f32"),
    ("W1", "attention", 4, 12, 12, 512, 512, 64, False, "f32"),
    ("W2", "attention", 1, 12, 12, 2048, 2048, 64, True, "f32"),
    ("W2-full", "attention", 1, 12, 12, 2048, 2048, 64, False, "f32"),
    ("W3", "attention", 1, 32, 8, 4096, 4096, 128, True, "f32"),
    ("W4", "attention", 1, 32, 32, 1, 8192, 128, False, "f32"),
    ("W4-bf16", "attention", 1, 32, 32, 1, 8192, 128, False, "bf16"),
    ("W4-f16", "attention", 1, 32, 32, 1, 8192, 128, False, "f16"),
    ("W4-int8", "attention", 1, 32, 32, 1, 8192, 128, False, "int8"),
    ("W4-int4", "attention", 1, 32, 32, 1, 8192, 128, False, "int4"),
    ("W5", "module", 2, 8, 8, 10, 10, 64, False, "f32"),
]
WORKLOADS = {r[0]: dict(zip(("id", "kind", "batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "causal",
                             "kv_dtype"), r)) for r in ROWS}
# As `qkv bench --workload`: W2 brings W2-full, W4 its 16-bit and quantized rows.
FOLLOWERS = {"W2": ["W2-full"], "W4": ["W4-bf16", "W4-f16", "W4-int8", "W4-int4"]}
PEERS = ["torch", "ort", "ggml"]
TITLES = {"torch": "torch", "ort": "ORT", "ggml": "ggml", "qkv": "qkv"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W0,W1,W2,W3,W4,W5",
                        help="comma list of " + ", ".join(WORKLOADS) + " (W2 brings W2-full, W4 its 16-bit and quantized rows)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds; each peer's best is kept")
    parser.add_argument("--threads", type=int, default=2, help="threads of every peer and of qkv")
    parser.add_argument("--qkv", default=os.path.join(REPO, "build", "release", "tools", "qkv", "qkv"),
                        help="the qkv binary (default: build/release/tools/qkv/qkv)")
    parser.add_argument("--qkv-runs", type=int, default=10, help="qkv bench --runs")
    parser.add_argument("--ggml-src", default=os.environ.get("GGML_SRC"),
                        help="a ggml checkout to build (default: $GGML_SRC); a build already in the cache is used")
    parser.add_argument("--cache", default=os.path.join(REPO, "build", "peers"),
                        help="where npm, ggml's build and the models go (default: build/peers)")
    parser.add_argument("--peers", default=",".join(PEERS), help="peers to try (default: torch,ort,ggml)")
    parser.add_argument("--offline", action="store_true",
                        help="download and build nothing: use only the peers already installed or built")
    parser.add_argument("--check", action="store_true",
                        help="also check a few output rows of ORT's and ggml's attention against float64")
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="machine-readable output: on stdout instead of the table, or into FILE beside it")
    args = parser.parse_args(argv)
    ids = []
    for name in args.workloads.split(","):
        name = name.strip()
        match = next((w for w in WORKLOADS if w.lower() == name.lower()), None)
        if match is None:
            parser.error(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
        for w in [match] + FOLLOWERS.get(match, []):
            if w not in ids:
                ids.append(w)
    args.ids = sorted(ids, key=list(WORKLOADS).index)
    args.peer_list = [p.strip() for p in args.peers.split(",") if p.strip()]
    return args


def log(message):
    print(f"peers: {message}", file=sys.stderr, flush=True)


def spec(w, kv_dtype=None):
    """id:kind:B:Hq:Hkv:Nq:Nk:d:mask:kv_dtype, the peers' command-line form of a workload."""
    return ":".join(str(x) for x in (w["id"], w["kind"], w["batch"], w["q_heads"], w["kv_heads"], w["q_len"],
                                     w["kv_len"], w["head_dim"], "causal" if w["causal"] else "none",
                                     kv_dtype or w["kv_dtype"]))


def shape(w):
    if w["kind"] == "module":
        return f"x ({w['batch']}, {w['q_len']}, {w['q_heads'] * w['head_dim']}), {w['q_heads']} heads"
    q = f"({w['batch']}, {w['q_heads']}, {w['q_len']}, {w['head_dim']})"
    kv = f"({w['batch']}, {w['kv_heads']}, {w['kv_len']}, {w['head_dim']})"
    extra = " causal" if w["causal"] else ""
    extra += f" {w['kv_dtype']} K/V" if w["kv_dtype"] != "f32" else ""
    return f"{q} x {kv}{extra}"


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def run_json(command, env, timeout):
    """Runs a peer; its JSON lines, or raises RuntimeError with its stderr's tail."""
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        tail = " ".join(result.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{os.path.basename(command[0])} exited with {result.returncode}: {tail}")
    return json_lines(result.stdout)


# ------------------------------------------------------------------------------------------------
# The machine


def machine():
    info = {}
    try:
        text = subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True, check=True).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = set(info.get("Flags", "").split())
    family, model = info.get("CPU family", "?"), info.get("Model", "?")
    name = info.get("Model name", "unknown CPU")
    core = ""
    if info.get("Vendor ID") == "AuthenticAMD" and family.isdigit():  # AMD's families name the Zen cores
        core = {23: "Zen/Zen 2", 25: "Zen 4" if "avx512f" in flags else "Zen 3", 26: "Zen 5"}.get(int(family), "")
    wanted = {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
              "amx": any(f.startswith("amx") for f in flags)}
    return {"model_name": name, "core": core, "family": family, "model": model, "cpus": os.cpu_count(),
            "flags": wanted}


def machine_line(m):
    core = f" ({m['core']}, family {m['family']} model {m['model']})" if m["core"] else \
        f" (family {m['family']} model {m['model']})"
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["flags"].items())
    return f"{m['model_name']}{core}, {m['cpus']} CPUs; {flags}"


# ------------------------------------------------------------------------------------------------
# The peers: each finds or sets up what it needs, then runs all its workloads once per round.


class Peer:
    name = ""

    def __init__(self, args, env):
        self.args, self.env = args, env
        self.present, self.note, self.version = False, "", ""

    def workloads(self):
        """The rows this peer measures; {row id: spec it runs}."""
        return {w: spec(WORKLOADS[w]) for w in self.args.ids if WORKLOADS[w]["kv_dtype"] == "f32"}

    def run_round(self):
        """{row id: (ms, variant)} for one round."""
        raise NotImplementedError


class Qkv(Peer):
    name = "qkv"

    def setup(self):
        if not os.access(self.args.qkv, os.X_OK):
            self.note = f"no qkv binary at {self.args.qkv} (build the qkv_cli target)"
            return
        self.present = True

    def run_round(self):
        command = [self.args.qkv, "bench", "--workload", ",".join(self.args.ids), "--json", "--no-reference",
                   "--no-gemm", "--threads", str(self.args.threads), "--runs", str(self.args.qkv_runs)]
        out = {}
        for row in run_json(command, self.env, timeout=1800):
            if row.get("kind") == "environment":
                self.version = row.get("qkv_version", "")
            if row.get("kind") != "workload" or row.get("pass", "forward") != "forward":
                continue
            if row.get("backend") == "Reference" or row.get("workload") not in self.args.ids:
                continue
            out[row["workload"]] = (float(row["median_ms"]), row.get("kernel") or row.get("backend", ""))
        return out


class Torch(Peer):
    name = "torch"

    def setup(self):
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        if probe.returncode != 0:
            self.note = "PyTorch not importable (apt-get install python3-torch)"
            return
        self.version, self.present = probe.stdout.strip(), True

    def run_round(self):
        command = [sys.executable, os.path.join(HERE, "torch_attention.py"), "--threads", str(self.args.threads)]
        command += list(self.workloads().values())
        return {r["workload"]: (r["ms"], r["variant"]) for r in run_json(command, self.env, timeout=1800)}


class Ort(Peer):
    name = "ort"

    def setup(self):
        node = shutil.which("node") or shutil.which("nodejs")
        if node is None:
            self.note = "no Node.js (scripts/install-deps.sh peers)"
            return
        try:
            import onnx_models  # needs python3-onnx
        except ImportError:
            self.note = "no python3-onnx to write the models (scripts/install-deps.sh peers)"
            return
        self.node = node
        self.modules = os.path.join(self.args.cache, "node", "node_modules")
        package = os.path.join(self.modules, "onnxruntime-node", "package.json")
        installed = json.load(open(package)).get("version") if os.path.exists(package) else None
        if installed != ORT_VERSION:
            if self.args.offline:
                self.note = (f"onnxruntime-node {ORT_VERSION} not installed in {os.path.dirname(self.modules)} "
                             "(run.py without --offline installs it)")
                return
            if not self.npm_install():
                return
        self.manifest = os.path.join(self.args.cache, "onnx", "manifest.json")
        manifest = onnx_models.write_models([WORKLOADS[w] for w in self.args.ids], os.path.dirname(self.manifest))
        with open(self.manifest, "w") as f:
            json.dump(manifest, f, indent=1)
        self.version, self.present = ORT_VERSION, True

    def npm_install(self):
        npm = shutil.which("npm")
        if npm is None:
            self.note = "no npm to install onnxruntime-node (scripts/install-deps.sh peers)"
            return False
        folder = os.path.dirname(self.modules)
        os.makedirs(folder, exist_ok=True)
        if not os.path.exists(os.path.join(folder, "package.json")):
            with open(os.path.join(folder, "package.json"), "w") as f:
                f.write('{"private": true, "description": "qkv bench/peers: onnxruntime-node"}\n')
        log(f"npm install onnxruntime-node@{ORT_VERSION} into {folder} (about 300 MB)")
        # --ignore-scripts: its postinstall only fetches GPU providers; the CPU library is in the package.
        result = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--ignore-scripts",
                                 f"onnxruntime-node@{ORT_VERSION}"], cwd=folder, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            self.note = "npm install onnxruntime-node failed: " + " ".join(result.stdout.strip().splitlines()[-2:])
            return False
        return True

    def run_round(self):
        env = dict(self.env, NODE_PATH=self.modules)
        command = [self.node, os.path.join(HERE, "ort_attention.js"), "--threads", str(self.args.threads)]
        command += ["--check"] if self.args.check else []
        command += [self.manifest] + list(self.workloads())
        out = {}
        for r in run_json(command, env, timeout=1800):
            if "error" in r:
                log(f"ORT {r['workload']} {r['variant']}: {r['error']}")
                continue
            if "max_err" in r:
                log(f"ORT {r['workload']} {r['variant']}: max_err {r['max_err']:.2g}")
            if r["workload"] not in out or r["ms"] < out[r["workload"]][0]:  # the fastest form of this round
                out[r["workload"]] = (r["ms"], r["variant"])
        return out


class Ggml(Peer):
    name = "ggml"

    def setup(self):
        self.folder = os.path.join(self.args.cache, "ggml")
        self.install = os.path.join(self.folder, "install")
        self.binary = os.path.join(self.folder, "ggml_attention")
        source = os.path.join(HERE, "ggml_attention.cpp")
        if not os.path.exists(os.path.join(self.install, "include", "ggml.h")):
            if not self.args.ggml_src:
                self.note = "no ggml checkout given (--ggml-src DIR or GGML_SRC) and none built in " + self.folder
                return
            if self.args.offline:
                self.note = f"ggml not built in {self.folder} (run.py --ggml-src DIR without --offline builds it)"
                return
            if not self.build_ggml():
                return
        stale = not os.path.exists(self.binary) or os.path.getmtime(self.binary) < os.path.getmtime(source)
        if stale and not self.args.offline and not self.build_program(source):
            return
        if not os.path.exists(self.binary):
            self.note = f"{self.binary} not built (run.py without --offline builds it)"
            return
        self.present = True

    def build_ggml(self):
        src = os.path.abspath(self.args.ggml_src)
        if not os.path.exists(os.path.join(src, "include", "ggml.h")):
            self.note = f"{src} is not a ggml checkout (no include/ggml.h)"
            return False
        build = os.path.join(self.folder, "build")
        log(f"building ggml from {src} into {self.folder} (CPU backend only, -j2)")
        configure = ["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_INSTALL_PREFIX={self.install}",
                     "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DGGML_BACKEND_DL=OFF", "-DGGML_BUILD_TESTS=OFF",
                     "-DGGML_BUILD_EXAMPLES=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF",
                     "-DGGML_OPENCL=OFF", "-DGGML_BLAS=OFF", "-DGGML_RPC=OFF"]
        for step in (configure, ["cmake", "--build", build, "-j2"], ["cmake", "--install", build]):
            result = subprocess.run(step, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if result.returncode != 0:
                self.note = f"ggml's build failed ({' '.join(step[:2])}): " + " ".join(
                    result.stdout.strip().splitlines()[-3:])
                return False
        return True

    def build_program(self, source):
        libdir = next((os.path.join(self.install, d) for d in ("lib", "lib64")
                       if os.path.isdir(os.path.join(self.install, d))), os.path.join(self.install, "lib"))
        command = [os.environ.get("CXX", "g++"), "-O2", "-std=c++17", source, "-o", self.binary,
                   f"-I{os.path.join(self.install, 'include')}", f"-L{libdir}", f"-Wl,-rpath,{libdir}",
                   "-lggml", "-lggml-cpu", "-lggml-base"]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            self.note = "ggml_attention.cpp did not build: " + " ".join(result.stdout.strip().splitlines()[-3:])
            return False
        return True

    def workloads(self):
        # The 16-bit rows (W4's, the only ones) both run as one: ggml's f16 K/V, under W4-f16.
        out = {}
        for w in self.args.ids:
            workload = WORKLOADS[w]
            if workload["kv_dtype"] in ("f32", "int8", "int4"):  # int8, int4: ggml's q8_0, q4_0
                out[w] = spec(workload)
            else:
                out["W4-f16"] = spec(WORKLOADS["W4-f16"])
        return out

    def run_round(self):
        command = [self.binary, "--threads", str(self.args.threads)] + (["--check"] if self.args.check else [])
        command += list(self.workloads().values())
        out = {}
        for r in run_json(command, self.env, timeout=1800):
            self.version = r.get("version", self.version)
            if "max_err" in r:
                log(f"ggml {r['workload']}: max_err {r['max_err']:.2g}")
            out[r["workload"]] = (r["ms"], r["variant"])
        if "W4-f16" in out:
            for w in ("W4-bf16", "W4-f16"):
                if w in self.args.ids:
                    out[w] = out["W4-f16"]
        return out


# ------------------------------------------------------------------------------------------------
# Rounds and the table


def measure(args):
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(args.threads)
    sys.path.insert(0, HERE)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    qkv = Qkv(args, env)
    qkv.setup()
    if not qkv.present:
        raise SystemExit(f"peers: {qkv.note}")
    peers = []
    for cls in (Torch, Ort, Ggml):
        peer = cls(args, env)
        if peer.name not in args.peer_list:
            peer.note = "not asked for (--peers)"
        else:
            log(f"setting up {TITLES[peer.name]}")
            peer.setup()
        if not peer.present:
            log(f"{TITLES[peer.name]} skipped: {peer.note}")
        peers.append(peer)
    present = [qkv] + [p for p in peers if p.present]
    best = {p.name: {} for p in present}  # name -> row -> (ms, variant)
    failures = {}
    for r in range(args.rounds):
        order = present[r % len(present):] + present[:r % len(present)]
        for peer in order:
            if peer.name in failures:
                continue
            log(f"round {r + 1}/{args.rounds}: {TITLES[peer.name]}")
            try:
                result = peer.run_round()
            except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as error:
                failures[peer.name] = str(error)
                log(f"{TITLES[peer.name]} failed: {error}")
                continue
            for row, (ms, variant) in result.items():
                if row not in best[peer.name] or ms < best[peer.name][row][0]:
                    best[peer.name][row] = (ms, variant)
    for peer in [qkv] + peers:
        if peer.name in failures:
            peer.note = "failed: " + failures[peer.name]
            if peer is qkv:
                raise SystemExit(f"peers: qkv {peer.note}")
    rows = []
    for w in args.ids:
        ms = {p.name: (best[p.name][w][0] if p.present and w in best.get(p.name, {}) else None) for p in [qkv] + peers}
        variants = {p.name: best[p.name][w][1] for p in [qkv] + peers if p.present and w in best.get(p.name, {})}
        timed = {name: t for name, t in ms.items() if name != "qkv" and t is not None}
        best_peer = min(timed, key=timed.get) if timed else None
        ratio = ms["qkv"] / timed[best_peer] if best_peer and ms["qkv"] else None
        rows.append({"workload": w, "shape": shape(WORKLOADS[w]), "ms": ms, "variant": variants,
                     "best_peer": best_peer, "qkv_vs_best": ratio})
    return {
        "machine": machine(),
        "date": started,
        "threads": args.threads,
        "rounds": args.rounds,
        "peers": {p.name: {"present": p.present and p.name not in failures, "version": p.version, "note": p.note}
                  for p in [qkv] + peers},
        "rows": rows,
    }


def table(result):
    columns = ["torch", "ort", "ggml", "qkv"]
    lines = [f"qkv against its peers, started {result['date']}",
             f"machine: {machine_line(result['machine'])}",
             f"float32 (16-bit K/V where the row says), {result['threads']} threads; ms per call: per peer the best of "
             f"{result['rounds']} alternating rounds, each round's figure the median of its calls"]
    for name in columns:
        peer = result["peers"][name]
        state = peer["version"] if peer["present"] else "skipped: " + peer["note"]
        lines.append(f"  {TITLES[name]:<6} {state}")
    header = f"{'workload':<9} {'shape':<46}" + "".join(f"{TITLES[c] + ' ms':>11}" for c in columns) + \
        f"{'qkv/best':>10}  best peer"
    lines += ["", header, "-" * len(header)]
    for row in result["rows"]:
        cells = "".join(f"{row['ms'][c]:>11.3f}" if row["ms"][c] is not None else f"{'-':>11}" for c in columns)
        ratio = f"{row['qkv_vs_best']:>10.2f}" if row["qkv_vs_best"] is not None else f"{'-':>10}"
        lines.append(f"{row['workload']:<9} {row['shape']:<46}{cells}{ratio}  {TITLES.get(row['best_peer'], '-')}")
    lines.append("")
    lines.append("qkv/best: qkv's ms over the fastest peer's (below 1: qkv is faster). Forms timed:")
    forms = {}
    for name in ["qkv"] + columns[:-1]:
        for row in result["rows"]:
            if name in row["variant"]:
                forms.setdefault((name, row["variant"][name]), []).append(row["workload"])
    for (name, variant), ids in forms.items():
        lines.append(f"  {TITLES[name]:<6} {variant}: {', '.join(ids)}")
    if any(r["workload"] == "W4-bf16" and r["ms"]["ggml"] is not None for r in result["rows"]):
        lines.append("  W4-bf16's ggml figure is its f16 K/V (the same bytes per element)")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    result = measure(args)
    if args.json == "-":
        print(json.dumps(result, indent=1))
        return
    print(table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
