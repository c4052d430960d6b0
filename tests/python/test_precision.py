"""scaled_dot_product_attention's precision keyword (torch.set_float32_matmul_precision's levels).

"highest" is the default, bit for bit. "high" and "medium" permit bfloat16 parts on AMX tiles
(the flash forward and backward, on CPUs with AMX; elsewhere float32 still): against PyTorch in
float64, the error stays within what each operand's precision allows (2^-16 relative for "high",
2^-8 for "medium", times the largest sum_d |q_d k_d| scale, and for the gradients also the
largest sum_c |dO_c v_c|), on Auto and Flash, through qkv.scaled_dot_product_attention_backward,
qkv.torch's autograd and qkv.MultiHeadAttention. Names are case-blind; a bad one is an error,
with 16-bit keys and values too.
"""
import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch


def float64_attention(q, k, v, causal):
    q, k, v = (torch.from_numpy(x).double() for x in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).numpy()


@pytest.mark.parametrize("precision, operand_error", [("high", 2.0 ** -16), ("medium", 2.0 ** -8)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_lower_precision_within_its_bound(precision, operand_error, causal, backend):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 4, 130, 64), dtype=np.float32) for _ in range(3))
    want = float64_attention(q, k, v, causal)
    got = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal, backend=backend, precision=precision)
    product_sum = np.einsum("bhid,bhjd->bhij", np.abs(q), np.abs(k)).max() / math.sqrt(64)
    assert np.abs(got - want).max() <= 4 * operand_error * (1 + product_sum)


def float64_gradients(q, k, v, g, causal):
    q, k, v = (torch.from_numpy(x).double().requires_grad_() for x in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(scores, dim=-1) @ v).backward(torch.from_numpy(g).double())
    return [x.grad.numpy() for x in (q, k, v)]


@pytest.mark.parametrize("precision, operand_error", [("high", 2.0 ** -16), ("medium", 2.0 ** -8)])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_within_their_bound(precision, operand_error, causal):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((1, 2, 300, 64), dtype=np.float32) for _ in range(4))
    want = float64_gradients(q, k, v, g, causal)
    product_sum = np.einsum("bhid,bhjd->bhij", np.abs(q), np.abs(k)).max() / math.sqrt(64)
    grad_sum = np.einsum("bhid,bhjd->bhij", np.abs(g), np.abs(v)).max()
    bound = 2 * operand_error * (1 + product_sum + grad_sum)
    # the functional backward, the forward at the same precision
    out, lse, row_max, row_sum = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True,
                                                                  return_row_stats=True, precision=precision)
    core = qkv.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=causal, row_max=row_max,
                                                     row_sum=row_sum, precision=precision)
    # qkv.torch's autograd
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    qkv.torch.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, precision=precision).backward(
        torch.from_numpy(g))
    # Highest's, to see the precision reach each backward where the tiles run (the forward tells)
    exact = qkv.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=causal, row_max=row_max,
                                                      row_sum=row_sum)
    tiles = not np.array_equal(out, qkv.scaled_dot_product_attention(q, k, v, is_causal=causal))
    for got in (core, [t.grad.numpy() for t in (tq, tk, tv)]):
        for name, a, b, c in zip(("dq", "dk", "dv"), got, want, exact):
            assert (np.abs(a - b) / np.maximum(1, np.abs(b))).max() <= bound, name
            assert tiles != np.array_equal(a, c), name


def test_module_precision():
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 100, 64), dtype=np.float32)
    modules = {p: qkv.MultiHeadAttention(64, 4, seed=3, causal=True, precision=p) for p in ("highest", "High")}
    assert modules["High"].precision == "high" and modules["highest"].precision == "highest"
    out = {p: m(x, x, x)[0] for p, m in modules.items()}
    assert np.abs(out["High"] - out["highest"]).max() <= 1e-3
    # with a KV cache: a prompt of 100 tokens, then one more
    cached = {}
    for p, m in modules.items():
        m.eval()
        cache = m.make_cache(2, 128)
        cached[p] = np.concatenate([m(x, cache=cache)[0], m(x[:, :1], cache=cache)[0]], axis=1)
    assert np.abs(cached["High"] - cached["highest"]).max() <= 1e-3
    with pytest.raises(qkv.Error, match="unknown matmul precision 'fast'"):
        qkv.MultiHeadAttention(64, 4, precision="fast")


def test_highest_is_the_default_bit_for_bit():
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, 100, 32), dtype=np.float32) for _ in range(3))
    default = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    highest = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, precision="highest")
    assert np.array_equal(default, highest)


def test_names_in_any_case_and_16_bit_keys():
    q = np.ones((1, 4, 8), dtype=np.float32)
    out = qkv.scaled_dot_product_attention(q, q, q, precision="HIGH")
    assert np.allclose(out, 1.0)
    half = q.astype(np.float16)
    assert np.allclose(qkv.scaled_dot_product_attention(q, half, half, precision="medium"), 1.0)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_a_bad_precision_names_the_choices(kv_dtype):
    q = np.zeros((1, 4, 8), dtype=np.float32)
    kv = q.astype(kv_dtype)
    with pytest.raises(qkv.Error, match="unknown matmul precision 'low': expected highest, high or medium"):
        qkv.scaled_dot_product_attention(q, kv, kv, precision="low")
