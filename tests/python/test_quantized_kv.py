"""Quantized keys and values from Python: qkv.quantize_kv's round trip within its documented bound
(recomputed here in numpy float64), attention on QuantizedKV keys and values against a numpy
float64 evaluation on the dequantised values (every backend, GQA, a causal offset, int4 with a
partial last group), the cache's "int8" / "int4" dtype, and the errors."""
import numpy as np
import pytest

import qkv


def oracle(q, k, v, causal_offset=None):
    """softmax(q k^T / sqrt(D)) v in float64, keys and values repeated over grouped query heads."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal_offset is not None:
        i = np.arange(q.shape[2])[:, None]
        j = np.arange(k.shape[2])[None, :]
        s = np.where(j <= i + causal_offset, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("dtype,dim", [("int8", 37), ("int8", 128), ("int4", 72), ("int4", 128), ("int4", 6)])
def test_round_trip_within_the_documented_bound(rng, dtype, dim):
    x = (rng.standard_normal((3, 4, dim)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    quantized = qkv.quantize_kv(x, dtype)
    assert quantized.shape == x.shape
    back = quantized.dequantize()
    group, limit = (dim, 127) if dtype == "int8" else (32, 7)
    for first in range(0, dim, group):
        part = x[..., first:first + group].astype(np.float64)
        amax = np.abs(part).max(-1, keepdims=True)
        scale = quantized.scales[..., first // group:first // group + 1].astype(np.float64)
        np.testing.assert_allclose(scale, amax / limit, rtol=1e-6)
        error = np.abs(back[..., first:first + group] - part)
        assert np.all(error <= amax / (2 * limit) * (1 + 1e-5))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("backend", ["reference", "flash", "decode", "auto"])
def test_attention_on_quantized_kv_matches_float64_on_dequantised_values(rng, dtype, backend):
    b, hq, hkv, nq, nk, d = 2, 4, 2, 3, 75, 40  # int4: groups of 32 and 8
    q = rng.standard_normal((b, hq, nq, d)).astype(np.float32)
    k = qkv.quantize_kv(rng.standard_normal((b, hkv, nk, d)).astype(np.float32), dtype)
    v = qkv.quantize_kv(rng.standard_normal((b, hkv, nk, d)).astype(np.float32), dtype)
    out, lse = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, attn_mask=qkv.Mask.causal(nk - nq),
                                                backend=backend, return_lse=True)
    want = oracle(q, k.dequantize(), v.dequantize(), causal_offset=nk - nq)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    assert lse.shape == (b, hq, nq)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_cache_quantizes_on_append(rng, dtype):
    mha = qkv.MultiHeadAttention(64, 4, num_kv_heads=2, batch_first=True)
    mha.eval()
    x = rng.standard_normal((2, 9, 64)).astype(np.float32)
    full, _ = mha(x, is_causal=True)
    cache = mha.make_cache(2, 16, dtype)
    parts = [mha(x[:, :5], cache=cache)[0]] + [mha(x[:, t:t + 1], cache=cache)[0] for t in range(5, 9)]
    assert cache.length == 9 and cache.dtype == dtype
    # Quantized K/V move the output by about their error: int8 ~1e-2, int4 ~1e-1 of its scale.
    bound = 0.02 if dtype == "int8" else 0.2
    assert np.abs(np.concatenate(parts, axis=1) - full).max() <= bound * np.abs(full).max()
    keys = cache._core.keys()[:, :, :9]
    assert np.isfinite(keys).all() and keys.shape == (2, 2, 9, 16)


def test_errors(rng):
    x = rng.standard_normal((2, 3, 7)).astype(np.float32)
    with pytest.raises(qkv.Error, match="must be even"):
        qkv.quantize_kv(x, "int4")
    with pytest.raises(qkv.Error, match='"int8" or "int4"'):
        qkv.quantize_kv(x, "int2")
    bad = x.copy()
    bad[0, 1, 2] = np.nan
    with pytest.raises(qkv.Error, match="non-finite"):
        qkv.quantize_kv(bad, "int8")
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k = qkv.quantize_kv(rng.standard_normal((1, 2, 5, 8)).astype(np.float32), "int8")
    v4 = qkv.quantize_kv(rng.standard_normal((1, 2, 5, 8)).astype(np.float32), "int4")
    with pytest.raises(qkv.Error, match="one dtype"):
        qkv.scaled_dot_product_attention(q, k, v4)
    with pytest.raises(qkv.Error, match="for inference"):
        qkv.scaled_dot_product_attention(q, k, k, need_weights=True)
    k.scales[0, 1, 2, 0] = np.inf
    with pytest.raises(qkv.Error, match="scales must be finite"):
        qkv.scaled_dot_product_attention(q, k, k)
