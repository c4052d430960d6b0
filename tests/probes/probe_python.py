"""Random-call probe of qkv's Python API: every call either succeeds or raises qkv.Error.

    probe_python.py [--calls N] [--seed S] [--size ci|full] [--timeout SECONDS]

Draws N calls (seeded) over the public functions - scaled_dot_product_attention and its
backward, masks and options, MultiHeadAttention (forward, backward, cache), RotaryEmbedding,
KVCache, linear_attention, dropout_keeps, Mask parsing and factories, qkv.torch - with random
good and bad arguments: wrong ranks, dtypes and types, None, NaN, negative, huge, empty dims,
non-contiguous views, broadcasts. A call that raises anything but qkv.Error is a failure. The
calls run in a child interpreter, so a crash (a signal) or a hang (past --timeout) is reported
with the call that was running; the parent exits non-zero on any failure. ctest runs it at CI
size (tests/python registration in python/CMakeLists.txt); run it at full size by hand.

RotaryEmbedding with a huge head_dim (a table of 2^40 entries), dropout_keeps with p = NaN and
linear_attention with no keys are drawn too: each was a defect this probe's first runs skipped.
"""
import argparse
import os
import re
import subprocess
import sys
import time
import traceback

import numpy as np

SIZES = {"ci": 12, "full": 256}  # the longest sequence drawn (head dims: up to 64)


class Draw:
    """Random arguments, good most of the time, bad some of the time."""

    def __init__(self, rng, size):
        self.rng, self.size = rng, size
        self.gqa = False  # the last qkv_shapes drew grouped-query heads

    def chance(self, p):
        return self.rng.random() < p

    def pick(self, *options):
        return options[int(self.rng.integers(len(options)))]

    def dim(self):
        if self.chance(0.05):
            return 0
        return int(self.rng.integers(1, self.size + 1))

    def small(self):
        """A batch or head count."""
        return int(self.rng.integers(1, 5))

    def feature(self):
        """A head dim."""
        return int(self.rng.integers(1, min(self.size, 64) + 1))

    def integer(self, low=-3, high=40):
        if self.chance(0.06):
            return self.pick(-1, 2**31, 2**62, -2**63, 2**64, 2**70, 1.5, "3", None, True, np.int64(2))
        return int(self.rng.integers(low, high))

    def number(self, low=0.0, high=2.0):
        if self.chance(0.08):
            return self.pick(-1.0, float("nan"), float("inf"), -float("inf"), 0.0, 1.0, 1e30, None, "x",
                             [1.0], np.float64(0.5), np.array(0.25))
        return float(self.rng.uniform(low, high))

    def array(self, shape, dtype=np.float32):
        """An array of shape, sometimes spoilt: another dtype or type, NaN, a view, None."""
        if self.chance(0.04):
            return self.pick(None, "abc", [[1, 2], [3]], 3.0, object(), np.array([None, 1], dtype=object))
        values = self.rng.standard_normal(shape).astype(dtype) if dtype != bool else \
            self.rng.random(shape) < 0.7
        if self.chance(0.05) and values.size and values.dtype.kind == "f":
            values.flat[int(self.rng.integers(values.size))] = self.pick(np.nan, np.inf, -np.inf, 1e38)
        if self.chance(0.08):
            values = values.astype(self.pick(np.float64, np.float16, np.int32, np.int64, bool, np.uint8))
        if self.chance(0.1) and values.ndim >= 2:  # the same values through a transposed copy: strided
            values = np.swapaxes(np.swapaxes(values, -1, -2).copy(), -1, -2)
        if self.chance(0.05) and values.ndim >= 1 and values.size:
            values = np.broadcast_to(values[..., :1], values.shape)  # stride 0
        return values

    def shape(self, rank=None):
        """A shape of any rank (0 to 5), at most 2**20 elements: the probe's own arrays stay small."""
        rank = self.pick(2, 3, 4, 4, 4) if rank is None else rank
        if self.chance(0.04):
            rank = self.pick(0, 1, 5)
        dims = [self.dim() for _ in range(rank)]
        while np.prod(dims, dtype=np.int64) > 2**20:
            dims[int(np.argmax(dims))] //= 2
        return tuple(dims)


def qkv_shapes(d):
    d.gqa = False
    b, h = d.small(), d.small()
    nq, nk, dk, dv = d.dim() or 1, d.dim() or 1, d.feature(), d.feature()
    if d.chance(0.1):
        nq, nk = d.pick((0, nk), (nq, 0), (0, 0))
    hkv = h if not d.chance(0.2) else d.pick(1, max(h // 2, 1), h + 1)
    if hkv != h and h % hkv == 0 and d.chance(0.7):
        d.gqa = True
    rank = d.pick(2, 3, 4, 4)
    lead_q, lead_kv = {2: ((), ()), 3: ((b,), (b,)), 4: ((b, h), (b, hkv))}[rank]
    shapes = [lead_q + (nq, dk), lead_kv + (nk, dk), lead_kv + (nk, dv)]
    if d.chance(0.1):
        i = int(d.rng.integers(3))
        shapes[i] = d.shape()
    return shapes, h if rank == 4 else 1  # the query heads: what alibi_slopes and sinks must match


MASK_WORDS = ["causal", "causal(2)", "window(3)", "window(1, 2)", "strided(2)", "global(1)", "&", "|", "(", ")",
              "windw(2)", "window(-1)", "strided(0)", "causal(99999999999999999999)", "\x00", "é", " ", ",", "1"]


def mask_expression(d):
    return "".join(d.pick(*MASK_WORDS) for _ in range(int(d.rng.integers(1, 6))))


def attn_mask(d, q_shape, k_shape):
    import qkv

    kind = d.pick("none", "none", "bool", "float", "expr", "mask", "bad")
    nq = q_shape[-2] if len(q_shape) >= 2 else 1
    nk = k_shape[-2] if len(k_shape) >= 2 else 1
    if kind == "bool":
        return d.array((nq, nk) if d.chance(0.8) else d.shape(), bool)
    if kind == "float":
        return d.array((nq, nk) if d.chance(0.8) else d.shape())
    if kind == "expr":
        return mask_expression(d)
    if kind == "mask":
        return d.pick(qkv.Mask.causal(), qkv.Mask.window(2), qkv.Mask())
    if kind == "bad":
        return d.pick(np.ones((nq, nk), np.int32), 5, "", b"causal", [True, False])
    return None


def attention_options(d, heads):
    options = {}
    if d.chance(0.3):
        options["seed"] = d.integer(0, 1000)
    if d.chance(0.3):
        options["backend"] = d.pick("auto", "reference", "flash", "decode", "Flash", "fast", None, 3)
    if d.chance(0.2):
        options["softcap"] = d.number(0, 50)
    if d.chance(0.15):
        options["alibi_slopes"] = d.array((heads,) if d.chance(0.8) else d.shape(1))
    if d.chance(0.15):
        options["sinks"] = d.array((heads,) if d.chance(0.8) else d.shape(1))
    if d.chance(0.2):
        options["precision"] = d.pick("highest", "high", "medium", "HIGH", "low", None)
    if d.chance(0.02):
        options["softcapp"] = 1.0
    return options


def mask_arguments(d, shapes):
    kwargs = {"attn_mask": attn_mask(d, shapes[0], shapes[1])}
    if d.chance(0.3):
        kwargs["is_causal"] = True
    if d.chance(0.2):
        kwargs["key_lengths"] = d.pick([d.integer(0, 10) for _ in range(int(d.rng.integers(0, 4)))], "ab", 3, None,
                                       [[1]], [1.5])
    if d.chance(0.2):
        kwargs["window"] = d.pick(d.integer(0, 10), (d.integer(0, 5), d.integer(0, 5)), (1, 2, 3), "w", -1)
    if d.chance(0.15):
        kwargs["scale"] = d.number(0, 2)
    return kwargs


def call_sdpa(d, qkv):
    shapes, heads = qkv_shapes(d)
    q, k, v = (d.array(s) for s in shapes)
    kwargs = mask_arguments(d, shapes)
    kwargs.update(attention_options(d, heads))
    if d.chance(0.15):
        kwargs["dropout_p"] = d.number(0, 1)
    kwargs["enable_gqa"] = d.gqa or d.chance(0.1)
    kwargs["allow_cast"] = d.chance(0.2)
    backward = d.chance(0.4)
    if backward:
        kwargs.update(return_lse=True, return_row_stats=d.chance(0.5))
    elif d.chance(0.2):
        kwargs["need_weights"] = True
    result = qkv.scaled_dot_product_attention(q, k, v, **kwargs)
    if backward:
        out, lse = result[0], result[1]
        stats = {"row_max": result[2], "row_sum": result[3]} if len(result) == 4 else {}
        del kwargs["return_lse"], kwargs["return_row_stats"]
        grad = d.array(out.shape) if d.chance(0.9) else d.array(d.shape())
        qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, **stats, **kwargs)


def call_sdpa_half(d, qkv):
    shapes, heads = qkv_shapes(d)
    dtype = d.pick(np.float16, np.float16, np.float32)
    q, k, v = d.array(shapes[0]), d.array(shapes[1], dtype), d.array(shapes[2], dtype)
    qkv.scaled_dot_product_attention(q, k, v, **mask_arguments(d, shapes), **attention_options(d, heads),
                                     return_lse=d.chance(0.5))


def call_mha(d, qkv):
    e, h = d.pick((8, 2), (16, 4), (32, 4), (12, 3), (16, 1)) if d.chance(0.85) else (d.integer(0, 40), d.integer(0, 8))
    kwargs = {}
    if d.chance(0.2):
        kwargs["num_kv_heads"] = d.pick(1, 2, None, d.integer(0, 4))
    if d.chance(0.2):
        kwargs["dropout"] = d.number(0, 1)
    for flag in ("causal", "alibi", "sinks", "bias"):
        if d.chance(0.15):
            kwargs[flag] = d.chance(0.5)
    if d.chance(0.15):
        kwargs["softcap"] = d.number(0, 30)
    if d.chance(0.15):
        kwargs["attention"] = d.pick("linear", "softmax", "cubic", None)
    if d.chance(0.15):
        kwargs["rotary"] = d.pick(True, {"base": 500.0}, {"bas": 1}, "yes", None)
    if d.chance(0.1):
        kwargs["precision"] = d.pick("high", "low", 3)
    if d.chance(0.1):
        kwargs["seed"] = d.integer(0, 100)
    module = qkv.MultiHeadAttention(e, h, **kwargs)
    if d.chance(0.3):
        module.eval()
    batch, nq, nk = d.small(), d.dim(), d.dim()
    if d.chance(0.2) and not module.training:  # the KV cache
        cache = module.make_cache(d.pick(batch, d.integer(0, 4)), d.pick(32, d.integer(-1, 40)),
                                  d.pick("f32", "bf16", "f16", "f8"), d.pick(0, 0, d.integer(0, 40)))
        for _ in range(int(d.rng.integers(1, 4))):
            counts = None if d.chance(0.7) else [d.integer(0, 4) for _ in range(batch)]
            module(d.array((batch, d.pick(1, 2, nq), e)), cache=cache, counts=counts)
        return
    x = d.array((batch, nq, e) if d.chance(0.9) else d.shape())
    cross = d.chance(0.4)
    memory = d.array((batch, nk, e)) if cross else None
    call = {}
    if d.chance(0.2):
        call["key_padding_mask"] = d.array((batch, nk if cross else nq) if d.chance(0.7) else d.shape(), bool)
    if d.chance(0.2):
        call["attn_mask"] = d.array((nq, nk if cross else nq) if d.chance(0.7) else d.shape(), bool)
    call["need_weights"] = d.chance(0.2)
    call["is_causal"] = d.chance(0.2)
    if d.chance(0.05):
        module.load_state_dict(d.pick(module.state_dict(), None, {"in_proj_weight": d.array((3 * e, e))},
                                      {"sinks": d.array((h,))}, [("a", 1)]))
    out, _ = module(x, memory, memory, **call) if cross else module(x, **call)
    if module.training and d.chance(0.7):
        module.backward(d.array(out.shape) if d.chance(0.9) else d.array(d.shape()))


def call_rotary(d, qkv):
    head_dim = d.pick(2, 4, 8, 16, 32) if d.chance(0.85) else d.pick(7, 0, -2, "8", d.integer(0, 64), 1 << 40)
    base = 10000.0 if d.chance(0.8) else d.pick(0.0, -1.0, float("nan"), 500.0, "b")
    rotary = qkv.RotaryEmbedding(head_dim, base=base, interleaved=d.chance(0.5))
    x = d.array(d.shape() if d.chance(0.2) else (d.dim(), rotary.head_dim))
    rotary.apply(x, position_offset=d.pick(0, 5, 1000) if d.chance(0.85) else d.pick(-1, "a", None))


def call_kv_cache(d, qkv):
    capacity = d.integer(1, 64)
    qkv._core.KVCache(d.integer(1, 4), d.integer(1, 4), capacity, d.integer(1, 16),
                      d.pick("f32", "bf16", "f16") if d.chance(0.85) else d.pick("int8", None),
                      d.pick(0, 0, 0, capacity, d.integer(0, 8)))


def call_linear(d, qkv):
    shapes, _ = qkv_shapes(d)
    q, k, v = (d.array(s) for s in shapes)
    kwargs = {"feature_map": d.pick("elu+1", "relu", "tanh", None), "is_causal": d.chance(0.5),
              "eps": d.number(0, 1e-3), "causal_offset": d.integer(-3, 5), "enable_gqa": d.chance(0.3)}
    out = qkv.linear_attention(q, k, v, **kwargs)
    if d.chance(0.5):
        qkv.linear_attention_backward(d.array(out.shape), q, k, v, **kwargs)


def call_dropout_keeps(d, qkv):
    p = d.number(0, 1)
    qkv.dropout_keeps(d.integer(0, 2**40), d.integer(), d.integer(), d.integer(), d.integer(), p)


def call_mask(d, qkv):
    kind = d.pick("parse", "parse", "window", "causal", "strided", "global", "keys", "block", "keep", "combine")
    if kind == "parse":
        mask = qkv.Mask.parse(mask_expression(d) if d.chance(0.9) else d.pick(None, 3, b"causal"))
        str(mask)
    elif kind == "window":
        qkv.Mask.window(d.integer(), d.integer(), d.integer())
    elif kind == "causal":
        qkv.Mask.causal(d.integer())
    elif kind == "strided":
        qkv.Mask.strided(d.integer(), d.integer())
    elif kind == "global":
        qkv.Mask.global_tokens(d.integer())
    elif kind == "keys":
        qkv.Mask.key_lengths([d.integer() for _ in range(int(d.rng.integers(0, 4)))])
    elif kind == "block":
        qkv.Mask.block_sparse(d.array(d.shape(2), bool), d.integer(), d.integer())
    elif kind == "keep":
        qkv.Mask.keep(d.array(d.shape(), bool))
    else:
        qkv.Mask.causal() & qkv.Mask.additive(d.array(d.shape()))


def call_torch(d, qkv):
    import torch

    import qkv.torch as qt

    shapes, heads = qkv_shapes(d)
    tensors = [torch.from_numpy(np.ascontiguousarray(d.rng.standard_normal(s), dtype=np.float32))
               for s in shapes]
    if d.chance(0.1):
        tensors[int(d.rng.integers(3))] = tensors[0].double()
    grad = d.chance(0.5)
    for t in tensors:
        t.requires_grad_(grad)
    if d.chance(0.3):
        out = qt.linear_attention(*tensors, is_causal=d.chance(0.5)) if shapes[1][-2] else None
    else:
        kwargs = mask_arguments(d, shapes)
        kwargs.update({k: v for k, v in attention_options(d, heads).items() if k != "sinks"})
        if d.chance(0.2):
            kwargs["sinks"] = torch.zeros(heads, requires_grad=grad)
        out = qt.scaled_dot_product_attention(*tensors, enable_gqa=d.chance(0.3), **kwargs)
    if grad and out is not None:
        out.sum().backward()


CALLS = [call_sdpa, call_sdpa, call_sdpa, call_sdpa_half, call_mha, call_mha, call_rotary, call_kv_cache, call_linear,
         call_dropout_keeps, call_mask, call_mask, call_torch]


def child(args):
    """Runs the calls; prints the one about to run to `log` (so the parent can name a crash)."""
    import warnings

    import qkv

    warnings.simplefilter("ignore", RuntimeWarning)  # NaN cast to integers, on purpose
    rng = np.random.default_rng(args.seed)
    d = Draw(rng, SIZES[args.size])
    failures = 0
    outcomes = {call.__name__: [0, 0] for call in CALLS}  # [succeeded, raised qkv.Error]
    with open(args.log, "w") as log:
        for i in range(args.calls):
            call = CALLS[int(rng.integers(len(CALLS)))]
            log.write(f"call {i}: {call.__name__}\n")
            log.flush()
            try:
                call(d, qkv)
                outcomes[call.__name__][0] += 1
            except qkv.Error:
                outcomes[call.__name__][1] += 1
            except Exception:  # noqa: BLE001 - the probe's finding
                failures += 1
                print(f"FAIL call {i} ({call.__name__}, seed {args.seed}):\n{traceback.format_exc()}", flush=True)
    for name, (ok, refused) in outcomes.items():
        print(f"{name:20} {ok:6} succeeded {refused:6} qkv.Error")
    print(f"{args.calls - failures} passed, {failures} failed", flush=True)
    return 1 if failures else 0


def parent(args):
    log = f"{args.log or '/tmp'}/probe_python.{os.getpid()}.log"
    command = [sys.executable, os.path.abspath(__file__), "--child", "--calls", str(args.calls), "--seed",
               str(args.seed), "--size", args.size, "--log", log]
    start = time.monotonic()
    try:
        result = subprocess.run(command, timeout=args.timeout, text=True, capture_output=True)
    except subprocess.TimeoutExpired:
        print(f"probe_python: HANG: no end after {args.timeout} s; last: {last_line(log)}")
        return 1
    sys.stdout.write(result.stdout[-20000:])
    if result.returncode < 0 or result.returncode > 1:
        print(f"probe_python: CRASH (exit {result.returncode}) in {last_line(log)} (seed {args.seed})\n"
              f"{result.stderr[-4000:]}")
        return 1
    # The child's last line is its tally; without it the child stopped outside the calls (an
    # uncaught exception, e.g. qkv failing to import): its stderr says why, and no call counts.
    lines = result.stdout.rstrip().splitlines()
    if not lines or not re.fullmatch(r"\d+ passed, \d+ failed", lines[-1]):
        print(f"probe_python: FAIL: the child stopped before its tally (exit {result.returncode}), "
              f"last: {last_line(log)}\n{result.stderr[-4000:]}")
        return 1
    print(f"probe_python: {args.calls} calls, seed {args.seed}, size {args.size}, "
          f"{time.monotonic() - start:.1f} s")
    if os.path.exists(log):
        os.remove(log)
    return result.returncode


def last_line(path):
    try:
        with open(path) as f:
            lines = f.read().splitlines()
        return lines[-1] if lines else "(before the first call)"
    except OSError:
        return "(no log)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--size", choices=sorted(SIZES), default="ci")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--log", default=None, help="the child's log file (the parent: its folder)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.exit(child(args) if args.child else parent(args))


if __name__ == "__main__":
    main()
