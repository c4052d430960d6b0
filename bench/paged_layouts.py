"""Paged decode against contiguous decode, alternating in one process (docs/inference.md, Paged KV cache).

    PYTHONPATH=build/release/python OMP_NUM_THREADS=2 /usr/bin/python3 bench/paged_layouts.py [ROUNDS]

W4's K and V (1 query, 32 heads of 128, 8192 keys, f32) in three layouts: contiguous (1, H, N, D)
(the W4 row), one page of all N keys ((N, H, D), FlashAttention's layout), and 64-key pages in a
shuffled order. Each round calls each once; the table gives medians and the median of the
per-round ratios, which a loaded machine disturbs less than separate runs.
"""
import os, sys, time
import numpy as np
import qkv
rng = np.random.default_rng(0)
H, N, D, P = 32, 8192, 128, 64
k = rng.standard_normal((1, H, N, D), dtype=np.float32)
v = rng.standard_normal((1, H, N, D), dtype=np.float32)
q = rng.standard_normal((1, H, 1, D), dtype=np.float32)
qf = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
lens = np.array([N], np.int32)
def pool(x, page, perm):
    out = np.empty((N // page, page, H, D), np.float32)
    out[perm] = x[0].transpose(1, 0, 2).reshape(N // page, page, H, D)
    return out
perm = rng.permutation(N // P).astype(np.int32)
one = (pool(k, N, [0]), pool(v, N, [0]), np.zeros((1, 1), np.int32))
shuffled = (pool(k, P, perm), pool(v, P, perm), perm[None, :])
calls = {
    "contiguous (H,N,D)": lambda: qkv.scaled_dot_product_attention(q, k, v),
    "one page (N,H,D)": lambda: qkv.scaled_dot_product_attention(qf, one[0], one[1], block_table=one[2], cache_seqlens=lens),
    "64-key pages shuffled": lambda: qkv.scaled_dot_product_attention(qf, shuffled[0], shuffled[1], block_table=shuffled[2], cache_seqlens=lens),
}
ref = calls["contiguous (H,N,D)"]()[0, :, 0]
for name, call in calls.items():
    out = call()
    out = out[0, :, 0] if out.shape[1] == H else out[0, 0]
    print(name, "max diff vs contiguous", np.abs(out - ref).max())
times = {name: [] for name in calls}
for it in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    for name, call in calls.items():
        t0 = time.perf_counter(); call(); times[name].append(time.perf_counter() - t0)
base = np.array(times["contiguous (H,N,D)"]); flash = np.array(times["one page (N,H,D)"])
print(f"load {os.getloadavg()}")
for name, t in times.items():
    t = np.array(t)
    print(f"{name}: median {1e3*np.median(t):.1f} ms, min {1e3*t.min():.1f} ms, median ratio to (H,N,D) "
          f"{np.median(t/base):.3f}, to (N,H,D) {np.median(t/flash):.3f}")
