#!/usr/bin/env python3
"""qkv against PyTorch on the standard workloads W0-W5 (defined in bench/workloads.hpp), one run.

    PYTHONPATH=build/release/python /usr/bin/python3 bench/compare_torch.py [--only W0,W5] [--repeats N]

PyTorch's side is its math path, what torch.nn.functional.scaled_dot_product_attention's
math backend does (PyTorch 1.13 has no fused CPU attention): matmul, masked_fill, softmax,
matmul, in float32, with key/value heads repeated for grouped-query attention; W5 is
torch.nn.MultiheadAttention in eval mode under no_grad (its inference fast path). qkv's side is
qkv.scaled_dot_product_attention (Backend Auto: the flash kernel) and qkv.MultiHeadAttention,
called from numpy, so the times include qkv's one copy of the inputs.

Forward FLOPs = 4 * B * Hq * Nq * Nk * d, half for causal, for both sides (so the GFLOP/s ratio
is the speed ratio); W5 adds the four projections, 8 * B * N * E^2. Each time is the best of
several runs after a warm-up. Also printed: the machine's sgemm rate (torch.mm), the yardstick.
"""
import argparse
import math
import os
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="W0,W1,W2,W3,W4,W5", help="comma-separated workload ids")
    parser.add_argument("--repeats", type=int, default=10, help="at most this many timed runs per side")
    parser.add_argument("--min-time", type=float, default=0.3, help="stop repeating after this many seconds")
    parser.add_argument("--blas-threads", type=int, default=0,
                        help="set OPENBLAS_NUM_THREADS (both sides' GEMMs) before loading; 0: leave as is")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.blas_threads > 0:
    os.environ["OPENBLAS_NUM_THREADS"] = str(ARGS.blas_threads)  # read once, when OpenBLAS loads

import numpy as np  # noqa: E402  (after the environment is set)
import torch  # noqa: E402

import qkv  # noqa: E402


class Workload:
    def __init__(self, name, batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, label):
        self.name, self.batch, self.q_heads, self.kv_heads = name, batch, q_heads, kv_heads
        self.q_len, self.kv_len, self.head_dim, self.causal, self.label = q_len, kv_len, head_dim, causal, label

    def flops(self):
        full = 4.0 * self.batch * self.q_heads * self.q_len * self.kv_len * self.head_dim
        return full / 2 if self.causal else full


WORKLOADS = [
    Workload("W0", 1, 8, 8, 256, 256, 64, True, "B=1 H=8 N=256 d=64 (course CPU benchmark)"),
    Workload("W1", 4, 12, 12, 512, 512, 64, False, "B=4 H=12 N=512 d=64 (BERT-base)"),
    Workload("W2", 1, 12, 12, 2048, 2048, 64, True, "B=1 H=12 N=2048 d=64 (GPT-2)"),
    Workload("W3", 1, 32, 8, 4096, 4096, 128, True, "B=1 Hq=32 Hkv=8 N=4096 d=128 (Llama GQA)"),
    Workload("W4", 1, 32, 32, 1, 8192, 128, False, "B=1 H=32 d=128, 1 query x 8192 keys (decode)"),
]
W5 = dict(batch=2, seq=10, embed=512, heads=8)


def best_time(fn, repeats, min_time):
    """Best wall time of fn() over up to `repeats` runs (at least one, after a warm-up run when
    the first is short), stopping early once min_time seconds have been spent."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first > min_time:  # a big workload: the first run is the measurement
        return first
    best, spent = first, first
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent > min_time:
            break
    return best


def torch_math(q, k, v, causal_masked, group):
    """PyTorch's math path: matmul, masked_fill, softmax, matmul (GQA: repeat K/V heads)."""
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal_masked is not None:
        scores.masked_fill_(causal_masked, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def sgemm_rate(n=1024):
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = best_time(lambda: torch.mm(a, b), 20, 0.5)
    return 2.0 * n ** 3 / seconds / 1e9


def run_attention(w, args):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((w.batch, w.q_heads, w.q_len, w.head_dim), dtype=np.float32)
    k = rng.standard_normal((w.batch, w.kv_heads, w.kv_len, w.head_dim), dtype=np.float32)
    v = rng.standard_normal((w.batch, w.kv_heads, w.kv_len, w.head_dim), dtype=np.float32)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    causal_masked = torch.ones(w.q_len, w.kv_len, dtype=torch.bool).triu(1) if w.causal else None
    group = w.q_heads // w.kv_heads
    with torch.no_grad():
        torch_seconds = best_time(lambda: torch_math(tq, tk, tv, causal_masked, group), args.repeats, args.min_time)
        expected = torch_math(tq, tk, tv, causal_masked, group).numpy()
    run_qkv = lambda: qkv.scaled_dot_product_attention(q, k, v, is_causal=w.causal, enable_gqa=group > 1)
    qkv_seconds = best_time(run_qkv, args.repeats, args.min_time)
    maxdiff = float(np.abs(run_qkv() - expected).max())
    return w.flops(), torch_seconds, qkv_seconds, maxdiff


def run_module(args):
    b, n, e, h = W5["batch"], W5["seq"], W5["embed"], W5["heads"]
    theirs = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    ours = qkv.MultiHeadAttention(e, h).eval()
    ours.load_state_dict(theirs.state_dict())
    x = np.random.default_rng(0).standard_normal((b, n, e), dtype=np.float32)
    tx = torch.from_numpy(x)
    with torch.no_grad():
        torch_call = lambda: theirs(tx, tx, tx, need_weights=False)[0]
        torch_seconds = best_time(torch_call, args.repeats * 20, args.min_time)
        expected = torch_call().numpy()
    qkv_call = lambda: ours(x, need_weights=False)[0]
    qkv_seconds = best_time(qkv_call, args.repeats * 20, args.min_time)
    flops = 8.0 * b * n * e * e + 4.0 * b * h * n * n * (e // h)
    return flops, torch_seconds, qkv_seconds, float(np.abs(qkv_call() - expected).max())


def main(args):
    # The same thread count on both sides (PyTorch defaults to the physical cores, qkv's OpenMP to
    # the logical ones).
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    only = set(args.only.upper().split(","))

    sgemm = sgemm_rate()
    print(f"qkv {qkv.__version__} vs PyTorch {torch.__version__}, float32, CPU; threads: torch "
          f"{torch.get_num_threads()}, qkv OpenMP {os.environ.get('OMP_NUM_THREADS', os.cpu_count())}, "
          f"OpenBLAS {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    print(f"machine sgemm (torch.mm 1024^3): {sgemm:.1f} GFLOP/s")
    print("torch = math path (matmul, masked_fill, softmax, matmul); W5 = nn.MultiheadAttention vs "
          "qkv.MultiHeadAttention\n")
    header = (f"{'id':<3} {'workload':<46} {'mask':<7} {'torch GFLOP/s':>13} {'qkv GFLOP/s':>11} "
              f"{'qkv/torch':>9} {'qkv/sgemm':>9} {'maxdiff':>8}")
    print(header)
    print("-" * len(header))
    for w in WORKLOADS + ["W5"]:
        name = w if w == "W5" else w.name
        if name not in only:
            continue
        if w == "W5":
            label = f"MHA module B={W5['batch']} N={W5['seq']} E={W5['embed']} H={W5['heads']}"
            mask = "none"
            flops, torch_seconds, qkv_seconds, maxdiff = run_module(args)
        else:
            label, mask = w.label, ("causal" if w.causal else "none")
            flops, torch_seconds, qkv_seconds, maxdiff = run_attention(w, args)
        torch_rate, qkv_rate = flops / torch_seconds / 1e9, flops / qkv_seconds / 1e9
        print(f"{name:<3} {label:<46} {mask:<7} {torch_rate:>13.1f} {qkv_rate:>11.1f} "
              f"{qkv_rate / torch_rate:>8.2f}x {qkv_rate / sgemm:>8.0%} {maxdiff:>8.1e}", flush=True)


if __name__ == "__main__":
    main(ARGS)
