"""The gradient of a float attn_mask (a learned bias), dbias: from
qkv.scaled_dot_product_attention_backward (after dq, dk, dv and dsinks) and through qkv.torch's
autograd, against PyTorch 1.13's own autograd of softmax(q k^T * scale + bias) v in float64, on
every broadcast shape of the bias, with is_causal, key_lengths, sinks and grouped-query heads, on
the flash and reference kernels."""

import numpy as np
import pytest
import torch

import qkv
import qkv.torch

B, HQ, HKV, NQ, NK, DK, DV = 2, 4, 2, 7, 11, 16, 8

SHAPES = [(NQ, NK), (1, NK), (NQ, 1), (HQ, NQ, NK), (1, NQ, NK), (B, HQ, NQ, NK), (1, HQ, NQ, NK), (B, 1, NQ, NK),
          (1, 1, NQ, NK), (1, HQ, 1, NK), (B, 1, 1, NK)]


@pytest.fixture
def rng():
    return np.random.default_rng()


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def random_bias(rng, shape):
    bias = randn(rng, *shape)
    bias[rng.random(shape) < 0.15] = -np.inf  # some scores hidden by the bias itself,
    bias[..., 0] = rng.standard_normal(bias.shape[:-1])  # never key 0 (torch's empty rows give NaN)
    return bias


def torch_grads(q, k, v, grad, bias, causal=False, key_lengths=None, sinks=None):
    """(dq, dk, dv, dbias[, dsinks]) in float64 by PyTorch's autograd of the math attention."""
    leaves = [torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, k, v, bias)]
    tq, tk, tv, tbias = leaves
    group = tq.shape[1] // tk.shape[1]
    tk, tv = tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1)
    scores = tq @ tk.transpose(-2, -1) / np.sqrt(q.shape[-1]) + tbias
    hidden = torch.zeros(scores.shape[-2:], dtype=torch.bool)
    if causal:
        hidden = hidden | torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    hidden = hidden.expand(scores.shape).clone()
    if key_lengths is not None:
        for b, n in enumerate(key_lengths):
            hidden[b, ..., n:] = True
    scores = scores.masked_fill(hidden, float("-inf"))
    tsinks = None
    if sinks is not None:
        tsinks = torch.from_numpy(sinks.astype(np.float64)).requires_grad_()
        column = tsinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights)  # a row that sees nothing: 0, as qkv
    (weights @ tv * torch.from_numpy(grad.astype(np.float64))).sum().backward()
    grads = [x.grad.numpy() for x in leaves]
    return grads + ([tsinks.grad.numpy()] if sinks is not None else [])


def assert_close(got, want, name, tol=2e-4):
    assert got.shape == want.shape, f"{name}: {got.shape} vs {want.shape}"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())), err_msg=name)


@pytest.mark.parametrize("backend", ["flash", "reference"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_returns_dbias_shaped_as_the_bias(rng, shape, backend):
    q, k, v, grad = randn(rng, B, HQ, NQ, DK), randn(rng, B, HKV, NK, DK), randn(rng, B, HKV, NK, DV), \
        randn(rng, B, HQ, NQ, DV)
    bias = random_bias(rng, shape)
    kwargs = dict(attn_mask=bias, is_causal=True, enable_gqa=True, backend=backend)
    out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, **kwargs)
    grads = qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, **kwargs)
    assert len(grads) == 4
    want = torch_grads(q, k, v, grad, bias, causal=True)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, want):
        assert_close(g, w, f"{shape} {name}")
    assert np.all(grads[3][np.isneginf(np.broadcast_to(bias, grads[3].shape))] == 0)


def test_dbias_with_sinks_and_key_lengths_comes_last(rng):
    q, k, v, grad = randn(rng, B, HQ, NQ, DK), randn(rng, B, HKV, NK, DK), randn(rng, B, HKV, NK, DV), \
        randn(rng, B, HQ, NQ, DV)
    bias, sinks = random_bias(rng, (1, HQ, NQ, NK)), randn(rng, HQ)
    kwargs = dict(attn_mask=bias, key_lengths=[4, 11], sinks=sinks, enable_gqa=True)
    out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, **kwargs)
    dq, dk, dv, dsinks, dbias = qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, **kwargs)
    want_dq, want_dk, want_dv, want_dbias, want_dsinks = torch_grads(q, k, v, grad, bias, key_lengths=[4, 11],
                                                                     sinks=sinks)
    for name, g, w in (("dq", dq, want_dq), ("dk", dk, want_dk), ("dv", dv, want_dv), ("dsinks", dsinks, want_dsinks),
                       ("dbias", dbias, want_dbias)):
        assert_close(g, w, name)


def test_bool_and_no_mask_give_no_dbias(rng):
    q, k, v = randn(rng, 1, 2, 5, 8), randn(rng, 1, 2, 6, 8), randn(rng, 1, 2, 6, 8)
    grad = randn(rng, 1, 2, 5, 8)
    for kwargs in ({}, {"attn_mask": rng.random((5, 6)) < 0.7}, {"is_causal": True}):
        out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, **kwargs)
        assert len(qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, **kwargs)) == 3


@pytest.mark.parametrize("shape", [(NQ, NK), (1, HQ, NQ, NK), (B, HQ, NQ, NK), (HQ, 1, NK)], ids=str)
def test_torch_autograd_gives_the_bias_its_gradient(rng, shape):
    q, k, v, grad = randn(rng, B, HQ, NQ, DK), randn(rng, B, HKV, NK, DK), randn(rng, B, HKV, NK, DV), \
        randn(rng, B, HQ, NQ, DV)
    bias = random_bias(rng, shape)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v, bias)]
    out = qkv.torch.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], is_causal=True, enable_gqa=True)
    (out * torch.from_numpy(grad)).sum().backward()
    want = torch_grads(q, k, v, grad, bias, causal=True)
    for name, leaf, w in zip(("dq", "dk", "dv", "dbias"), leaves, want):
        assert leaf.grad is not None, name
        assert leaf.grad.dtype == torch.float32
        assert_close(leaf.grad.numpy(), w, f"{shape} {name}")


def test_torch_bias_without_requires_grad_gets_none_and_training_a_bias_learns(rng):
    q, k, v = (torch.from_numpy(randn(rng, 1, 2, 6, 8)) for _ in range(3))
    fixed = torch.zeros(6, 6)
    q.requires_grad_()
    qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=fixed).sum().backward()
    assert fixed.grad is None and q.grad is not None
    # A learned (1, H, N, N) bias pulled toward attending to key 0 only: the loss falls.
    bias = torch.zeros(1, 2, 6, 6, requires_grad=True)
    target = v[:, :, :1, :].expand(1, 2, 6, 8)
    optimizer = torch.optim.SGD([bias], lr=50.0)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = ((qkv.torch.scaled_dot_product_attention(q.detach(), k, v, attn_mask=bias) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.25 * losses[0], losses
