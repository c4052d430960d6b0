"""No silently wrong answers from the kernels' Python entry points: the backward from (out, lse)
alone under huge biases, dropout_keeps' p checked as attention's dropout_p, linear attention with
no keys and eps = 0, and a RotaryEmbedding table too large to build.
"""
import numpy as np
import pytest

import qkv


@pytest.mark.parametrize("bias", [-1e4, -1e9, float(np.finfo(np.float32).min)])
def test_backward_from_lse_alone_under_a_huge_bias_on_every_key(rng, bias):
    # PyTorch's and FlashAttention's signature: (out, lse), no row statistics. A row whose keys all
    # carry the bias: lse loses log(4), and weights recomputed from it alone would each be 1.
    # q and k in {-1, 0, 1} and D = 16 (scale 1/4): every product, sum and s = q.k / 4 is exact in
    # float32 however the kernel orders them, so fl(s + bias) is one rounding of an exact value,
    # the same here as in the kernel (with random floats, s itself could differ by an ulp and
    # round s + bias to the other neighbour at |bias| 1e4: default_rng(1855) did).
    q, k = (rng.integers(-1, 2, size=s).astype(np.float32) for s in ((1, 16), (4, 16)))
    v = rng.standard_normal((4, 16)).astype(np.float32)
    mask = np.full((1, 4), bias, dtype=np.float32)
    out, lse = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    grad = np.zeros((1, 16), dtype=np.float32)
    grad[0, 0] = 1
    _, _, dv, _ = qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, attn_mask=mask)
    # The weights float32 autograd differentiates: softmax of the float32 scores fl(s + bias), in float64.
    scores = ((q.astype(np.float64) @ k.T.astype(np.float64)) / 4 + bias).astype(np.float32)
    weights = np.exp(scores.astype(np.float64) - scores.max())
    weights /= weights.sum()
    np.testing.assert_allclose(dv[:, 0], weights[0], atol=1e-6)


@pytest.mark.parametrize("p", [float("nan"), 1.0, 2.0, -1.0])
def test_dropout_keeps_refuses_what_attention_refuses(p):
    x = np.zeros((2, 4), dtype=np.float32)
    with pytest.raises(qkv.Error, match=r"dropout_p must be in \[0, 1\)") as attention:
        qkv.scaled_dot_product_attention(x, x, x, dropout_p=p)
    with pytest.raises(qkv.Error) as keeps:
        qkv.dropout_keeps(1, 0, 0, 0, 0, p)
    message = str(attention.value)
    assert str(keeps.value) == "dropout_keeps: " + message[message.index("dropout_p"):]


def test_linear_attention_without_keys_or_eps_gives_zeros(rng):
    q = rng.standard_normal((1, 2, 5, 3)).astype(np.float32)
    k = np.zeros((1, 2, 0, 3), dtype=np.float32)
    v = np.zeros((1, 2, 0, 4), dtype=np.float32)
    out = qkv.linear_attention(q, k, v, eps=0.0)
    assert out.shape == (1, 2, 5, 4) and (out == 0).all()
    dq, dk, dv = qkv.linear_attention_backward(rng.standard_normal((1, 2, 5, 4)).astype(np.float32), q, k, v, eps=0.0)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


def test_rotary_table_over_the_memory_is_refused_by_size():
    with pytest.raises(qkv.Error, match="RotaryEmbedding: head_dim 1099511627776 need 4398046511104 bytes"):
        qkv.RotaryEmbedding(1 << 40)
