"""qkv.linear_attention, its backward and qkv.torch.linear_attention against PyTorch in float64.

The formula is evaluated in torch float64 pair by pair (an (Nq, Nk) matrix of phi(q).phi(k),
masked when causal); its autograd gradients are the backward's reference. Both feature maps,
causal or not (with offsets), lengths that are not multiples of qkv's chunk (64), GQA, Nq != Nk.
"""
import numpy as np
import pytest
import torch

import qkv
import qkv.torch


def phi(x, feature_map):
    return torch.nn.functional.elu(x) + 1 if feature_map == "elu+1" else torch.relu(x)


def formula(q, k, v, feature_map="elu+1", is_causal=False, eps=1e-6, causal_offset=0):
    """out_i = sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + eps), in torch (any dtype)."""
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    a = phi(q, feature_map) @ phi(k, feature_map).transpose(-1, -2)
    if is_causal:
        nq, nk = q.shape[-2], k.shape[-2]
        keep = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + causal_offset
        a = a * keep.to(a.dtype)
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


SHAPES = [  # (B, Hq, Hkv, Nq, Nk, Dk, Dv)
    (1, 2, 2, 5, 5, 4, 3),
    (2, 4, 2, 63, 63, 16, 8),
    (1, 2, 1, 130, 130, 33, 17),
    (1, 2, 2, 70, 150, 8, 8),
    (1, 1, 1, 150, 90, 5, 11),
]


def inputs(rng, shape, dtype=np.float32):
    b, hq, hkv, nq, nk, dk, dv = shape
    return (rng.standard_normal((b, hq, nq, dk)).astype(dtype), rng.standard_normal((b, hkv, nk, dk)).astype(dtype),
            rng.standard_normal((b, hkv, nk, dv)).astype(dtype))


def tolerance(q, k, v, **options):
    """float32's error scale: 2e-5 times (1 + the largest sum_j a_ij |v_j| / den_i)."""
    magnitude = formula(torch.from_numpy(q).double(), torch.from_numpy(k).double(),
                        torch.from_numpy(np.abs(v)).double(), **options)
    return 2e-5 * (1 + float(magnitude.abs().max()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("feature_map", ["elu+1", "relu"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_matches_the_formula(rng, shape, feature_map, is_causal):
    q, k, v = inputs(rng, shape)
    offsets = [0, shape[4] - shape[3], int(rng.integers(-20, 20))] if is_causal else [0]
    for offset in offsets:
        options = dict(feature_map=feature_map, is_causal=is_causal, causal_offset=offset)
        got = qkv.linear_attention(q, k, v, enable_gqa=True, **options)
        assert got.dtype == np.float32 and got.shape == shape[:2] + (shape[3], shape[6])
        want = formula(*(torch.from_numpy(x).double() for x in (q, k, v)), **options).numpy()
        assert np.abs(got - want).max() <= tolerance(q, k, v, **options), options


def test_ranks_and_errors(rng):
    q, k, v = inputs(rng, (1, 1, 1, 9, 9, 4, 4))
    np.testing.assert_array_equal(qkv.linear_attention(q[0, 0], k[0, 0], v[0, 0], is_causal=True),
                                  qkv.linear_attention(q, k, v, is_causal=True)[0, 0])
    with pytest.raises(qkv.Error, match="head dims differ"):
        qkv.linear_attention(q, k[..., :3], v)
    with pytest.raises(qkv.Error, match="choose elu\\+1 or relu"):
        qkv.linear_attention(q, k, v, feature_map="softmax")
    with pytest.raises(qkv.Error, match="pass enable_gqa=True"):
        qkv.linear_attention(np.concatenate([q, q], axis=1), k, v)
    with pytest.raises(qkv.Error, match="float32"):
        qkv.linear_attention(q.astype(np.float64), k, v)
    with pytest.raises(qkv.Error, match="eps must be finite"):
        qkv.linear_attention(q, k, v, eps=-1.0)


@pytest.mark.parametrize("feature_map", ["elu+1", "relu"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_matches_torch_autograd(rng, feature_map, is_causal):
    shape = (2, 4, 2, 70, 67, 12, 9)
    q, k, v = inputs(rng, shape)
    grad = rng.standard_normal(shape[:2] + (shape[3], shape[6])).astype(np.float32)
    options = dict(feature_map=feature_map, is_causal=is_causal, causal_offset=-3 if is_causal else 0)
    dq, dk, dv = qkv.linear_attention_backward(grad, q, k, v, enable_gqa=True, **options)
    tq, tk, tv = (torch.from_numpy(x).double().requires_grad_() for x in (q, k, v))
    formula(tq, tk, tv, **options).backward(torch.from_numpy(grad).double())
    for got, want, name in ((dq, tq.grad, "dq"), (dk, tk.grad, "dk"), (dv, tv.grad, "dv")):
        want = want.numpy()
        assert got.shape == want.shape, name
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), name


def test_torch_function_gradients(rng):
    shape = (1, 2, 1, 66, 66, 8, 8)
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in inputs(rng, shape))
    out = qkv.torch.linear_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert isinstance(out, torch.Tensor) and out.grad_fn is not None and out.shape == (1, 2, 66, 8)
    grad = torch.randn_like(out)
    out.backward(grad)
    tq, tk, tv = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = formula(tq, tk, tv, is_causal=True)
    assert float((out.detach().double() - want).abs().max()) <= 1e-4
    want.backward(grad.double())
    for got, ref in ((q.grad, tq.grad), (k.grad, tk.grad), (v.grad, tv.grad)):
        assert float((got.double() - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))
    # Only the gradients asked for.
    q2 = q.detach().requires_grad_()
    qkv.torch.linear_attention(q2, k.detach(), v.detach(), enable_gqa=True).sum().backward()
    assert q2.grad.shape == q2.shape
    assert q2.grad is not None


def test_torch_refuses_float64():
    with pytest.raises(qkv.Error, match="float32"):
        qkv.torch.linear_attention(torch.randn(4, 3).double(), torch.randn(4, 3), torch.randn(4, 3))
