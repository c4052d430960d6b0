"""qkv.scaled_dot_product_attention_backward against PyTorch autograd on the math path in float64.

The same cases as the forward parity (test_attention.py: every mask kind, cross shapes Nq != Nk,
Dk != Dv, custom scale), plus grouped-query heads (PyTorch repeats K/V heads, and autograd sums
their gradients back), ranks 3 and 2, dropout with the same seed, and fully masked rows. The
tolerance is the forward's rule applied to the gradients: a few times what PyTorch's own float32
autograd misses the float64 gradients by, plus a floor.
"""
import math

import numpy as np
import pytest
import torch

import qkv
import torch_reference as ref
from test_attention import B, CASES, DK, DV, HKV, HQ, NK, NQ, randn


def reference_grads(q, k, v, grad, keep=None, additive=None, scale=None, dropped=None, dtype=torch.float64):
    """(dq, dk, dv) of sum(attention(q, k, v) * grad) by PyTorch autograd; dropped: the (..., Nq, Nk)
    dropout multiplier (keep / (1 - p)) applied to the weights."""
    q, k, v = (ref.f64(x).to(dtype).requires_grad_() for x in (q, k, v))
    kk, vv = k, v
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, kk.transpose(-2, -1)) * scale
    if additive is not None:
        scores = scores + torch.as_tensor(np.asarray(additive)).to(dtype)
    if keep is not None:
        scores = scores.masked_fill(~torch.as_tensor(np.asarray(keep)), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if dropped is not None:
        weights = weights * torch.as_tensor(dropped).to(dtype)
    out = torch.matmul(weights, vv)
    (out * ref.f64(grad).to(dtype)).sum().backward()
    return [t.grad.numpy() for t in (q, k, v)]


def grad_tolerances(q, k, v, grad, **kwargs):
    exact = reference_grads(q, k, v, grad, **kwargs)
    single = reference_grads(q, k, v, grad, dtype=torch.float32, **kwargs)
    return exact, [1e-5 + 8 * float(np.nanmax(np.abs(s - e))) for s, e in zip(single, exact)]


def check_grads(got, q, k, v, grad, what, **ref_kwargs):
    expected, tols = grad_tolerances(q, k, v, grad, **ref_kwargs)
    for name, g, e, tol, x in zip(("dq", "dk", "dv"), got, expected, tols, (q, k, v)):
        assert g.dtype == np.float32 and g.shape == x.shape, f"{what} {name}: {g.dtype} {g.shape}"
        diff = float(np.max(np.abs(g - e))) if g.size else 0.0
        assert diff <= tol, f"{what} {name}: maxdiff {diff:.3g} > tolerance {tol:.3g}"


def forward_backward(q, k, v, grad, backend="auto", **kwargs):
    out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    return qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, backend=backend, **kwargs)


@pytest.mark.parametrize("backend", ["flash", "reference"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_backward_matches_pytorch_autograd(rng, case, backend):
    # Nq=7 != Nk=11 (cross shapes) and Dk=16 != Dv=8 in every case.
    q, k, v = randn(rng, B, HQ, NQ, DK), randn(rng, B, HKV, NK, DK), randn(rng, B, HKV, NK, DV)
    grad = randn(rng, B, HQ, NQ, DV)
    kwargs, ref_kwargs = case(rng)
    got = forward_backward(q, k, v, grad, backend=backend, **kwargs)
    check_grads(got, q, k, v, grad, case.__name__, **ref_kwargs)


@pytest.mark.parametrize("mask", ["none", "causal", "padding", "bool"])
def test_backward_grouped_query_attention(rng, mask):
    # 6 query heads share 2 key/value heads: dk, dv sum over the 3 query heads of each group.
    q, k, v = randn(rng, 2, 6, 9, 16), randn(rng, 2, 2, 13, 16), randn(rng, 2, 2, 13, 12)
    grad = randn(rng, 2, 6, 9, 12)
    keep = rng.random((2, 6, 9, 13)) < 0.6
    keep[..., 0] = True
    kwargs, ref_kwargs = {
        "none": ({}, {}),
        "causal": ({"is_causal": True}, {"keep": ref.causal_keep(9, 13)}),
        "padding": ({"key_lengths": [3, 13]}, {"keep": ref.lengths_keep([3, 13], 13)}),
        "bool": ({"attn_mask": keep}, {"keep": keep}),
    }[mask]
    got = forward_backward(q, k, v, grad, enable_gqa=True, **kwargs)
    check_grads(got, q, k, v, grad, f"gqa {mask}", **ref_kwargs)


@pytest.mark.parametrize("shape", [(5, 16), (3, 5, 16)], ids=["rank2", "rank3"])
def test_backward_one_head_ranks(rng, shape):
    q, k = randn(rng, *shape), randn(rng, *shape[:-2], 8, 16)
    v = randn(rng, *shape[:-2], 8, 4)
    grad = randn(rng, *shape[:-1], 4)
    out, lse = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert lse.shape == shape[:-1]
    got = qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, is_causal=True)
    check_grads(got, q, k, v, grad, "rank", keep=ref.causal_keep(shape[-2], 8))


def test_backward_with_dropout_uses_the_forward_seed(rng):
    p, seed = 0.25, 77
    q, k, v = randn(rng, 2, 2, 5, 8), randn(rng, 2, 2, 6, 8), randn(rng, 2, 2, 6, 4)
    grad = randn(rng, 2, 2, 5, 4)
    keep = np.array([[[[qkv.dropout_keeps(seed, b, h, i, j, p) for j in range(6)] for i in range(5)]
                      for h in range(2)] for b in range(2)])
    for backend in ("flash", "reference"):
        got = forward_backward(q, k, v, grad, backend=backend, dropout_p=p, seed=seed)
        check_grads(got, q, k, v, grad, f"dropout {backend}", dropped=keep / (1 - p))


def test_return_lse_and_weights_order(rng):
    q, k, v = randn(rng, 1, 2, 4, 8), randn(rng, 1, 2, 5, 8), randn(rng, 1, 2, 5, 8)
    out, weights, lse = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, return_lse=True)
    assert weights.shape == (1, 2, 4, 5) and lse.shape == (1, 2, 4)
    scores = (q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)) / math.sqrt(8)
    np.testing.assert_allclose(lse, np.log(np.exp(scores).sum(-1)), rtol=1e-5, atol=1e-5)
    out2, lse2 = qkv.scaled_dot_product_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out2, out, atol=1e-6)
    np.testing.assert_allclose(lse2, lse, atol=1e-6)


def test_backward_fully_masked_rows_are_zero(rng):
    # Batch 1 sees no key: qkv's gradients there are zeros (PyTorch's would be NaN).
    q, k, v = randn(rng, 2, 2, 4, 8), randn(rng, 2, 2, 5, 8), randn(rng, 2, 2, 5, 8)
    grad = randn(rng, 2, 2, 4, 8)
    dq, dk, dv = forward_backward(q, k, v, grad, key_lengths=[5, 0])
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    check_grads([g[:1] for g in (dq, dk, dv)], q[:1], k[:1], v[:1], grad[:1], "visible batch")


def test_backward_rejects_mismatched_shapes(rng):
    q = randn(rng, 1, 2, 4, 8)
    out, lse = qkv.scaled_dot_product_attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError):
        qkv.scaled_dot_product_attention_backward(randn(rng, 1, 2, 4, 7), q, q, q, out, lse)
