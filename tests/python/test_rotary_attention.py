"""Rotary tables as attention keywords (rotary_cos, rotary_sin, rotary_interleaved, rotary_keys).

- qkv.torch forward and backward (dq, dk, dv) against PyTorch in float64: FlashAttention's
  apply_rotary_emb_torch written here in torch (differentiable), then attention, autograd for the
  gradients; queries at the end of their sequence's keys, plain and packed (cu_seqlens) batches,
  both pairings, a partial rotary_dim, GQA, with and without the causal band.
- The numpy API and its backward give qkv.torch's numbers; rotary_keys=False reads k as given.
- Bad tables and positions are a qkv.Error naming them.
"""
import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch

HQ, HKV, DK, DV, HALF = 4, 2, 12, 6, 4  # rotary_dim 8 of 12


def rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotated(x, cos, sin, first, interleaved):
    """apply_rotary_emb_torch on x (H, N, D), float64: token n at position first + n."""
    n = x.shape[-2]
    c, s = cos[first:first + n], sin[first:first + n]
    c = c.repeat_interleave(2, -1) if interleaved else torch.cat((c, c), -1)
    s = s.repeat_interleave(2, -1) if interleaved else torch.cat((s, s), -1)
    ro = 2 * cos.shape[-1]
    part = x[..., :ro]
    return torch.cat((part * c + rotate_half(part, interleaved) * s, x[..., ro:]), dim=-1)


def attend(q, k, v, causal):
    """(H, Nq, D) float64 attention, queries at the end of the keys; GQA by repeating k and v."""
    k = k.repeat_interleave(HQ // HKV, 0)
    v = v.repeat_interleave(HQ // HKV, 0)
    nq, nk = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        hidden = torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + (nk - nq)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1) @ v


def tables(rng, length):
    # Any values: FlashAttention does not ask the tables to lie on the unit circle.
    return (rng.uniform(-1.5, 1.5, (length, HALF)).astype(np.float32),
            rng.uniform(-1.5, 1.5, (length, HALF)).astype(np.float32))


def leaf(array):
    return torch.tensor(array, dtype=torch.float32, requires_grad=True)


def wide(t):
    return t.detach().double().requires_grad_(True)


def close(got, want, tol=2e-5):
    got, want = got.detach().double(), want.detach()
    assert torch.allclose(got, want, rtol=tol, atol=tol), float((got - want).abs().max())


def through_qkv(rng, q, k, v, **keywords):
    """qkv.torch's output and a random output gradient, after its backward."""
    out = qkv.torch.scaled_dot_product_attention(q, k, v, **keywords)
    grad = torch.tensor(rng.standard_normal(out.shape), dtype=torch.float32)
    out.backward(grad)
    return out, grad


def matches_float64(out, grad, want, pairs):
    """qkv's output and gradients (q.grad, ...) against the float64 graph's (pairs of leaves)."""
    want.backward(grad.double())
    close(out, want)
    for got, expected in pairs:
        close(got.grad, expected.grad, 5e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("nq, nk, causal", [(5, 11, False), (9, 9, True), (1, 17, False)])
def test_plain_forward_and_backward_against_torch_float64(nq, nk, causal, interleaved):
    rng = np.random.default_rng(nq * 100 + nk)
    cos, sin = tables(rng, nk + 2)
    q, k, v = (leaf(rng.standard_normal((2, HQ, nq, DK))), leaf(rng.standard_normal((2, HKV, nk, DK))),
               leaf(rng.standard_normal((2, HKV, nk, DV))))
    out, grad = through_qkv(rng, q, k, v, is_causal=causal, enable_gqa=True, rotary_cos=cos, rotary_sin=sin,
                            rotary_interleaved=interleaved)
    c64, s64 = torch.tensor(cos, dtype=torch.float64), torch.tensor(sin, dtype=torch.float64)
    q64, k64, v64 = wide(q), wide(k), wide(v)
    want = torch.stack([attend(rotated(q64[b], c64, s64, nk - nq, interleaved), rotated(k64[b], c64, s64, 0, interleaved),
                               v64[b], causal) for b in range(2)])
    matches_float64(out, grad, want, ((q, q64), (k, k64), (v, v64)))

    # The numpy API: the same numbers, and its backward qkv.torch's gradients.
    keywords = dict(is_causal=causal, enable_gqa=True, rotary_cos=cos, rotary_sin=sin,
                    rotary_interleaved=interleaved)
    qn, kn, vn = q.detach().numpy(), k.detach().numpy(), v.detach().numpy()
    output, lse, row_max, row_sum = qkv.scaled_dot_product_attention(qn, kn, vn, return_lse=True,
                                                                     return_row_stats=True, **keywords)
    np.testing.assert_array_equal(output, out.detach().numpy())
    dq, dk, dv = qkv.scaled_dot_product_attention_backward(grad.numpy(), qn, kn, vn, output, lse, row_max=row_max,
                                                           row_sum=row_sum, **keywords)
    np.testing.assert_array_equal(dq, q.grad.numpy())
    np.testing.assert_array_equal(dk, k.grad.numpy())


def test_packed_batch_against_torch_float64():
    rng = np.random.default_rng(7)
    lengths = [(3, 7), (0, 4), (1, 1), (0, 0), (5, 5), (2, 0)]  # a sequence without keys is left alone
    cu_q = np.cumsum([0] + [a for a, _ in lengths]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lengths]).astype(np.int32)
    cos, sin = tables(rng, 8)
    q, k, v = (leaf(rng.standard_normal((cu_q[-1], HQ, DK))), leaf(rng.standard_normal((cu_k[-1], HKV, DK))),
               leaf(rng.standard_normal((cu_k[-1], HKV, DV))))
    out, grad = through_qkv(rng, q, k, v, is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, rotary_cos=cos,
                            rotary_sin=sin)
    c64, s64 = torch.tensor(cos, dtype=torch.float64), torch.tensor(sin, dtype=torch.float64)
    q64, k64, v64 = wide(q), wide(k), wide(v)
    parts = []
    for b, (nq, nk) in enumerate(lengths):
        qb = q64[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        if nk == 0:
            parts.append(torch.zeros(nq, HQ, DV, dtype=torch.float64) + 0 * qb.sum())
            continue
        kb, vb = k64[cu_k[b]:cu_k[b + 1]].transpose(0, 1), v64[cu_k[b]:cu_k[b + 1]].transpose(0, 1)
        parts.append(attend(rotated(qb, c64, s64, nk - nq, False), rotated(kb, c64, s64, 0, False), vb,
                            True).transpose(0, 1))
    matches_float64(out, grad, torch.cat(parts), ((q, q64), (k, k64), (v, v64)))


def test_rotary_keys_false_reads_the_keys_as_given():
    rng = np.random.default_rng(3)
    cos, sin = tables(rng, 10)
    q = rng.standard_normal((1, HQ, 1, DK)).astype(np.float32)
    k = rng.standard_normal((1, HQ, 10, DK)).astype(np.float32)
    v = rng.standard_normal((1, HQ, 10, DV)).astype(np.float32)
    got = qkv.scaled_dot_product_attention(q, k, v, rotary_cos=cos, rotary_sin=sin, rotary_keys=False)
    q_rot = qkv.apply_rotary(q, cos, sin, cache_seqlens=9)
    np.testing.assert_array_equal(got, qkv.scaled_dot_product_attention(q_rot, k, v))


def test_bad_tables_and_positions_are_errors():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 4, DK)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, DK)).astype(np.float32)
    cos, sin = tables(rng, 6)
    with pytest.raises(qkv.Error, match=r"tables hold positions 0 to 4 \(seqlen_ro 5\)"):
        qkv.scaled_dot_product_attention(q, k, k, rotary_cos=cos[:5], rotary_sin=sin[:5])
    with pytest.raises(qkv.Error, match=r"rotary_cos must be None or a \(seqlen_ro, rotary_dim / 2\) float array"):
        qkv.scaled_dot_product_attention(q, k, k, rotary_cos=np.ones(4, np.float32), rotary_sin=sin)
    with pytest.raises(qkv.Error, match=r"sin is undefined"):
        qkv.scaled_dot_product_attention(q, k, k, rotary_cos=cos)
    with pytest.raises(qkv.Error, match=r"4 queries but 3 keys"):
        qkv.scaled_dot_product_attention(q, k[:, :, :3], k[:, :, :3], rotary_cos=cos, rotary_sin=sin)
    bad = cos.copy()
    bad[2, 1] = np.nan
    with pytest.raises(qkv.Error, match=r"cos\[2, 1\] is nan"):
        qkv.scaled_dot_product_attention(q, k, k, rotary_cos=bad, rotary_sin=sin)
