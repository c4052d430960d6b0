"""scaled_dot_product_attention's precision keyword (torch.set_float32_matmul_precision's levels).

"highest" is the default, bit for bit. "high" and "medium" permit bfloat16 parts on AMX tiles
(the flash forward, on CPUs with AMX; elsewhere float32 still): against PyTorch in float64, the
error stays within what each operand's precision allows (2^-16 relative for "high", 2^-8 for
"medium", times the largest sum_d |q_d k_d| scale), on Auto and Flash. Names are case-blind; a
bad one is an error, with 16-bit keys and values too.
"""
import math

import numpy as np
import pytest
import torch

import qkv


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
