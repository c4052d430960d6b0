"""dtype rules, as PyTorch's: float32 inputs; float64 refused unless allow_cast=True; integer
and bool inputs always refused; masks bool or float of any precision. The same rules hold at
the C++ boundary (qkv._core), which names the dtype."""
import numpy as np
import pytest

import qkv
from qkv import _core


def arrays(dtype, shape=(1, 2, 3, 4)):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


def test_float32_is_accepted_as_is():
    q, k, v = arrays(np.float32)
    assert qkv.scaled_dot_product_attention(q, k, v).dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_other_floats_need_allow_cast(dtype):
    q, k, v = arrays(dtype)
    with pytest.raises(qkv.Error, match=rf"query is {np.dtype(dtype).name}, but qkv computes in float32.*allow_cast=True"):
        qkv.scaled_dot_product_attention(q, k, v)
    out = qkv.scaled_dot_product_attention(q, k, v, allow_cast=True)
    expected = qkv.scaled_dot_product_attention(*(a.astype(np.float32) for a in (q, k, v)))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_])
def test_integer_and_bool_inputs_are_always_refused(dtype):
    q, k, v = arrays(np.float32)
    bad = (q * 3).astype(dtype)
    for allow_cast in (False, True):
        with pytest.raises(qkv.Error, match=rf"key is {np.dtype(dtype).name}: attention needs float inputs"):
            qkv.scaled_dot_product_attention(q, bad, v, allow_cast=allow_cast)


def test_mixed_dtypes_name_the_argument():
    q, k, v = arrays(np.float32)
    with pytest.raises(qkv.Error, match="value is float64"):
        qkv.scaled_dot_product_attention(q, k, v.astype(np.float64))


def test_masks_may_be_bool_or_any_float():
    q, k, v = arrays(np.float32)
    keep = np.ones((3, 3), dtype=bool)
    bias = np.zeros((3, 3), dtype=np.float64)
    plain = qkv.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep), plain)
    np.testing.assert_array_equal(qkv.scaled_dot_product_attention(q, k, v, attn_mask=bias), plain)


def test_backward_and_module_follow_the_same_rules():
    q, k, v = arrays(np.float32)
    out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True)
    with pytest.raises(qkv.Error, match="grad_output is float64"):
        qkv.scaled_dot_product_attention_backward(np.ones(out.shape), q, k, v, out, lse)
    qkv.scaled_dot_product_attention_backward(np.ones(out.shape), q, k, v, out, lse, allow_cast=True)
    module = qkv.MultiHeadAttention(8, 2, batch_first=True)
    x = np.zeros((1, 3, 8))
    with pytest.raises(qkv.Error, match="query is float64"):
        module(x)
    assert module(x, allow_cast=True)[0].shape == (1, 3, 8)
    with pytest.raises(qkv.Error, match="query is int64"):
        module(np.zeros((1, 3, 8), dtype=np.int64))


def test_the_core_refuses_too():
    q, k, v = arrays(np.float32)
    args = (_core.AttentionOptions(),)
    with pytest.raises(qkv.Error, match="got a float64 array, but qkv computes in float32"):
        _core.attention(q.astype(np.float64), k, v, *args)
    with pytest.raises(qkv.Error, match="got a int64 array: attention needs float32 inputs"):
        _core.attention(q, k.astype(np.int64), v, *args)
    # A strided float32 view is fine (copied to C order first).
    _core.attention(np.swapaxes(np.swapaxes(q, 2, 3).copy(), 2, 3), k, v, *args)
