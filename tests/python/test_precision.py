"""scaled_dot_product_attention's precision keyword (torch.set_float32_matmul_precision's levels).

"highest" is the default, bit for bit. "high" and "medium" permit bfloat16 parts on AMX tiles
(the flash forward, on CPUs with AMX; elsewhere float32 still): against PyTorch in float64, the
error stays within what each operand's precision allows (2^-16 relative for "high", 2^-8 for
"medium", times the largest sum_d |q_d k_d| scale), on every backend. A bad name is an error.
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
@pytest.mark.parametrize("backend", ["auto", "flash", "reference"])
def test_lower_precision_within_its_bound(precision, operand_error, causal, backend):
    rng = np.random.default_rng()
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


def test_a_bad_precision_names_the_choices():
    q = np.zeros((1, 4, 8), dtype=np.float32)
    with pytest.raises(qkv.Error, match='precision must be "highest", "high" or "medium", got "low"'):
        qkv.scaled_dot_product_attention(q, q, q, precision="low")
