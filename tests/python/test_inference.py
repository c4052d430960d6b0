"""Inference from Python: 16-bit keys and values (numpy float16, torch bfloat16 / float16 through
qkv and qkv.torch) against a float64 evaluation on the rounded values; RotaryEmbedding against
the rotate_half code of the Hugging Face LLaMA / GPT-NeoX models and the GPT-J interleaved form;
the KV cache through MultiHeadAttention.forward(x, cache=...) against the full causal forward."""
import numpy as np
import pytest
import torch

import qkv
import qkv.torch


def attention64(q, k, v, causal_offset=None):
    """softmax(q k^T / sqrt(d)) v in float64, GQA by repeating k and v."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal_offset is not None:
        nq, nk = s.shape[-2:]
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + causal_offset, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def rel_err(got, want):
    return float(np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))))


@pytest.mark.parametrize("backend", ["reference", "flash", "decode", "auto"])
def test_numpy_float16_keys_and_values(rng, backend):
    q = rng.standard_normal((2, 4, 3, 40)).astype(np.float32)
    k = rng.standard_normal((2, 2, 57, 40)).astype(np.float16)
    v = rng.standard_normal((2, 2, 57, 40)).astype(np.float16)
    out = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=False, backend=backend,
                                           attn_mask=qkv.Mask.causal(54))
    assert out.dtype == np.float32
    assert rel_err(out, attention64(q, k, v, causal_offset=54)) <= 2e-3


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_torch_16_bit_keys_and_values(rng, dtype, bound):
    q = torch.randn(1, 8, 1, 64)
    k, v = torch.randn(1, 8, 300, 64).to(dtype), torch.randn(1, 8, 300, 64).to(dtype)
    want = attention64(q.numpy(), k.double().numpy(), v.double().numpy())
    for out in (qkv.torch.scaled_dot_product_attention(q, k, v), torch.from_numpy(
            qkv.scaled_dot_product_attention(q.numpy(), k, v))):
        assert out.dtype == torch.float32
        assert rel_err(out.numpy(), want) <= bound
    with pytest.raises(qkv.Error, match="share a dtype"):
        qkv.scaled_dot_product_attention(q.numpy(), k, v.float())


def rotate_half(x):
    """transformers' LLaMA / GPT-NeoX helper, verbatim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    """transformers' GPT-J helper, verbatim."""
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offset", [0, 5, 3000])
def test_rotary_matches_the_torch_code(rng, interleaved, offset):
    d, n, base = 32, 13, 10000.0
    x = torch.from_numpy(rng.standard_normal((2, 3, n, d))).double()
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(offset, offset + n, dtype=torch.float64), inv_freq)
    if interleaved:
        cos, sin = freqs.cos().repeat_interleave(2, -1), freqs.sin().repeat_interleave(2, -1)
        want = x * cos + rotate_every_two(x) * sin
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
        want = x * emb.cos() + rotate_half(x) * emb.sin()
    rope = qkv.RotaryEmbedding(d, base=base, interleaved=interleaved)
    got = rope.apply(x.float().numpy(), offset)
    assert rel_err(got, want.numpy()) <= 1e-5


@pytest.mark.parametrize("dtype, bound", [("f32", 2e-5), ("bf16", 2e-2)])
def test_cache_equals_full_causal_forward(rng, dtype, bound):
    mha = qkv.MultiHeadAttention(32, 4, num_kv_heads=2, batch_first=True)
    mha.eval()
    x = rng.standard_normal((2, 20, 32)).astype(np.float32)
    full, _ = mha(x, is_causal=True)
    cache = mha.make_cache(2, 32, dtype)
    parts = [mha(x[:, s:s + 3], cache=cache)[0] for s in range(0, 20, 3)]
    assert cache.length == 20 and cache.dtype == dtype
    assert rel_err(np.concatenate(parts, axis=1), full) <= bound
    cache.reset()
    assert cache.length == 0
