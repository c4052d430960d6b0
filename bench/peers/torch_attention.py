#!/usr/bin/python3
"""PyTorch timed on qkv's standard workloads, for bench/peers/run.py (which passes the shapes).

    /usr/bin/python3 bench/peers/torch_attention.py --threads 2 SPEC...
    SPEC = id:kind:batch:q_heads:kv_heads:q_len:kv_len:head_dim:mask:kv_dtype (kv_dtype f32 only)

PyTorch 1.13 (Debian's python3-torch) has no torch.nn.functional.scaled_dot_product_attention
(it came in 2.0), so an attention workload is its math form, what SDPA's math backend does:
softmax(q k^T / sqrt(d), the causal mask filled with -inf) v, float32, K/V heads repeated for
grouped-query attention. The module workload (W5) is torch.nn.MultiheadAttention in eval mode
under no_grad, need_weights=False (its inference fast path). Inputs are (B, H, N, d), random.

One warm-up, then calls until at least 10 calls and 0.2 s (3 when one takes over 1 s); the median,
one JSON line per workload:
    {"peer": "torch", "version": "1.13.0", "workload": "W0", "variant": "math", "ms": 1.2, "runs": 10}
"""
import argparse
import json
import math
import time

import torch


def time_median(call):
    call()
    times, spent = [], 0.0
    while True:
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
        spent += times[-1]
        if (times[0] > 1000 and len(times) >= 3) or (len(times) >= 10 and spent >= 200) or len(times) >= 2000:
            break
    times.sort()
    n = len(times)
    return (times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])), n


def math_attention(q, k, v, masked, group):
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if masked is not None:
        scores.masked_fill_(masked, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def run(spec):
    wid, kind, b, hq, hkv, nq, nk, d, mask, dtype = spec.split(":")
    b, hq, hkv, nq, nk, d = (int(x) for x in (b, hq, hkv, nq, nk, d))
    if dtype != "f32":
        raise SystemExit(f"torch_attention: {wid}: float32 K/V only")
    torch.manual_seed(0)
    with torch.no_grad():
        if kind == "module":
            layer = torch.nn.MultiheadAttention(hq * d, hq, batch_first=True).eval()
            x = torch.randn(b, nq, hq * d)
            ms, runs = time_median(lambda: layer(x, x, x, need_weights=False))
            return {"workload": wid, "variant": "nn.MultiheadAttention", "ms": ms, "runs": runs}
        q, k, v = torch.randn(b, hq, nq, d), torch.randn(b, hkv, nk, d), torch.randn(b, hkv, nk, d)
        # Bottom-right aligned, as qkv's causal mask: query i sees keys j <= i + (Nk - Nq).
        masked = torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1) if mask == "causal" else None
        ms, runs = time_median(lambda: math_attention(q, k, v, masked, hq // hkv))
        return {"workload": wid, "variant": "math (matmul, softmax, matmul)", "ms": ms, "runs": runs}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("specs", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for spec in args.specs:
        line = {"peer": "torch", "version": torch.__version__}
        line.update(run(spec))
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
