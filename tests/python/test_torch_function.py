"""qkv.torch: qkv's forward as a torch.autograd.Function on CPU float32 tensors.

Backward is not there yet (it needs the C++ backward of issue 4): asserted to raise a clear
NotImplementedError, so this test changes when it lands.
"""
import numpy as np
import pytest
import torch

import qkv
import qkv.torch
import torch_reference as ref


def test_forward_matches_math_path(rng):
    q = torch.randn(2, 4, 6, 16)
    k, v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 8)
    keep = torch.from_numpy(rng.random((6, 9)) < 0.7)
    keep[:, 0] = True
    out = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True, enable_gqa=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (2, 4, 6, 8)
    expected, _ = ref.attention(q.numpy(), k.numpy(), v.numpy(), keep=keep & ref.causal_keep(6, 9))
    tol = ref.tolerance(q.numpy(), k.numpy(), v.numpy(), keep=keep & ref.causal_keep(6, 9))
    assert float(np.abs(out.numpy() - expected).max()) <= tol


def test_same_numbers_as_the_numpy_front_end():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    additive = torch.randn(5, 7)
    out = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=additive, key_lengths=[6], scale=0.5)
    np.testing.assert_array_equal(
        out.numpy(), qkv.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=additive.numpy(),
                                                      key_lengths=[6], scale=0.5))


def test_records_a_graph_and_backward_says_not_yet():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.requires_grad and out.grad_fn is not None
    with pytest.raises(NotImplementedError, match="backward is not implemented yet.*issue 4"):
        out.sum().backward()
    with torch.no_grad():
        assert not qkv.torch.scaled_dot_product_attention(q, k, v).requires_grad


def test_rejects_other_dtypes_with_a_value_error():
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"query is torch.float64 on cpu; qkv runs on CPU float32 tensors"):
        qkv.torch.scaled_dot_product_attention(x, x, x)
    y = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: q is \(3, 4\) but k is \(3, 5\)"):
        qkv.torch.scaled_dot_product_attention(y, torch.randn(3, 5), torch.randn(3, 5))


def test_attribute_access_imports_the_submodule():
    assert qkv.torch.ScaledDotProductAttention.__mro__[1] is torch.autograd.Function
