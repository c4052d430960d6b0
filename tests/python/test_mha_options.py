"""qkv.MultiHeadAttention's options beyond torch's: attention="linear" with its feature map,
rotary position embedding and the T5 relative-position bias (each with a KV cache too), each
against a float64 numpy evaluation of the module from its own parameters; bad option values are
qkv.Error with a message naming them."""
import numpy as np
import pytest

import qkv


def rel_err(got, want):
    return float(np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))))


def rope64(x, offset, base, interleaved):
    """Rotary embedding in float64 from its formula: pair i of the vector at position p rotated by
    p * base^(-2i/D); pairs (x_i, x_{i+D/2}) half-split, (x_2i, x_2i+1) interleaved. x (B, H, N, D)."""
    d, n = x.shape[-1], x.shape[-2]
    angle = np.arange(offset, offset + n, dtype=np.float64)[:, None] * base ** (-2.0 * np.arange(d // 2) / d)
    cos, sin = np.cos(angle), np.sin(angle)
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2:])
    out = np.empty_like(x)
    rotated_first, rotated_second = first * cos - second * sin, second * cos + first * sin
    if interleaved:
        out[..., 0::2], out[..., 1::2] = rotated_first, rotated_second
    else:
        out[..., : d // 2], out[..., d // 2:] = rotated_first, rotated_second
    return out


def phi64(x, feature_map):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))) if feature_map == "elu+1" else np.maximum(x, 0)


def module64(mha, x, causal, rotary=None, feature_map=None, eps=1e-6):
    """The module in float64 from its parameters: project, split heads, rotate q and k, attend
    (softmax(q k^T / sqrt(d)), or linear attention's phi(q).phi(k) / (sum + eps) when feature_map
    is given), concatenate, project. x (B, N, E)."""
    p = {name: value.astype(np.float64) for name, value in mha.parameters().items()}
    x = x.astype(np.float64)
    b, n, _ = x.shape
    h, hkv, hd = mha.num_heads, mha.num_kv_heads, mha.head_dim

    def heads(name, count):
        y = x @ p[f"{name}_proj.weight"].T + p[f"{name}_proj.bias"]
        return y.reshape(b, n, count, hd).transpose(0, 2, 1, 3)

    q, k, v = heads("q", h), heads("k", hkv), heads("v", hkv)
    if rotary is not None:
        q, k = (rope64(t, 0, rotary["base"], rotary["interleaved"]) for t in (q, k))
    k, v = np.repeat(k, h // hkv, axis=1), np.repeat(v, h // hkv, axis=1)
    visible = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    if feature_map is None:
        s = np.where(visible, q @ np.swapaxes(k, -1, -2) / np.sqrt(hd), -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
    else:
        w = np.where(visible, phi64(q, feature_map) @ np.swapaxes(phi64(k, feature_map), -1, -2), 0.0)
        w /= w.sum(-1, keepdims=True) + eps
    attended = (w @ v).transpose(0, 2, 1, 3).reshape(b, n, h * hd)
    return attended @ p["out_proj.weight"].T + p["out_proj.bias"]


def randomise_biases(mha, rng):
    """torch's start has zero biases; random ones make the test see them."""
    for name, value in mha.parameters().items():
        if name.endswith("bias"):
            value[...] = rng.standard_normal(value.shape).astype(np.float32)


@pytest.mark.parametrize("feature_map", ["elu+1", "relu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary", [None, {"base": 500.0, "interleaved": True}])
def test_linear_mha_equals_float64_evaluation(rng, feature_map, causal, rotary):
    mha = qkv.MultiHeadAttention(24, 4, num_kv_heads=2, attention="linear", feature_map=feature_map, causal=causal,
                                 rotary=rotary, seed=int(rng.integers(1 << 31)))
    randomise_biases(mha, rng)
    assert (mha.attention, mha.feature_map, mha.causal, mha.rotary) == ("linear", feature_map, causal, rotary)
    x = rng.standard_normal((2, 19, 24)).astype(np.float32)
    out, weights = mha(x)
    assert weights is None
    assert rel_err(out, module64(mha, x, causal, rotary, feature_map)) <= 2e-4
    # is_causal=True on a module built causal is the same call; the softmax module differs.
    if causal:
        np.testing.assert_array_equal(mha(x, is_causal=True)[0], out)
    softmax = qkv.MultiHeadAttention(24, 4, num_kv_heads=2, causal=causal, rotary=rotary)
    softmax.load_state_dict(mha.state_dict())
    assert rel_err(softmax(x)[0], module64(mha, x, causal, rotary)) <= 2e-4
    assert rel_err(softmax(x)[0], out) > 1e-2


@pytest.mark.parametrize("rotary, want", [
    (True, {"base": 10000.0, "interleaved": False}),
    ({"interleaved": True}, {"base": 10000.0, "interleaved": True}),
    ({"base": 300}, {"base": 300.0, "interleaved": False}),
    (qkv.RotaryEmbedding(8, base=1000.0, interleaved=True), {"base": 1000.0, "interleaved": True}),
])
def test_rotary_mha_equals_float64_evaluation(rng, rotary, want):
    mha = qkv.MultiHeadAttention(32, 4, rotary=rotary, seed=int(rng.integers(1 << 31)))
    randomise_biases(mha, rng)
    assert mha.rotary == want
    x = rng.standard_normal((3, 11, 32)).astype(np.float32)
    out, _ = mha(x, is_causal=True)
    assert rel_err(out, module64(mha, x, True, want)) <= 2e-4
    plain = qkv.MultiHeadAttention(32, 4)
    plain.load_state_dict(mha.state_dict())
    assert rel_err(plain(x, is_causal=True)[0], out) > 1e-3  # the rotation really is applied


@pytest.mark.parametrize("rotary", [True, {"base": 500.0, "interleaved": True}])
@pytest.mark.parametrize("chunk", [1, 3, 17])
def test_rotary_cache_equals_full_causal_forward(rng, rotary, chunk):
    mha = qkv.MultiHeadAttention(32, 4, num_kv_heads=2, rotary=rotary, seed=int(rng.integers(1 << 31))).eval()
    randomise_biases(mha, rng)
    x = rng.standard_normal((2, 23, 32)).astype(np.float32)
    full, _ = mha(x, is_causal=True)
    cache = mha.make_cache(2, 40)
    parts = [mha(x[:, s:s + chunk], cache=cache)[0] for s in range(0, 23, chunk)]
    assert cache.length == 23
    assert rel_err(np.concatenate(parts, axis=1), full) <= 2e-5


def test_rotary_cache_with_ragged_prompts(rng):
    """Prompts of 9 and 4 tokens in one padded batch, then 5 tokens each, one at a time: each
    sequence's outputs are the full causal forward over that sequence alone (rotary positions
    follow each element's own length)."""
    mha = qkv.MultiHeadAttention(16, 2, rotary={"base": 100.0, "interleaved": False}).eval()
    randomise_biases(mha, rng)
    seqs = [rng.standard_normal((9 + 5, 16)).astype(np.float32), rng.standard_normal((4 + 5, 16)).astype(np.float32)]
    lengths = [9, 4]
    prompt = np.zeros((2, 9, 16), np.float32)
    for b, n in enumerate(lengths):
        prompt[b, :n] = seqs[b][:n]
    cache = mha.make_cache(2, 16)
    prompt_out, _ = mha(prompt, cache=cache, counts=lengths)
    steps = [mha(np.stack([seqs[b][lengths[b] + t][None] for b in range(2)]), cache=cache)[0] for t in range(5)]
    assert cache.lengths == [14, 9]
    for b, n in enumerate(lengths):
        want, _ = mha(seqs[b][None], is_causal=True)
        got = np.concatenate([prompt_out[b:b + 1, :n]] + [s[b:b + 1] for s in steps], axis=1)
        assert rel_err(got, want) <= 2e-5


@pytest.mark.parametrize("kwargs, match", [
    ({"attention": "sparse"}, 'attention must be "softmax" or "linear", got "sparse"'),
    ({"attention": None}, "attention and feature_map are strings"),
    ({"attention": "linear", "feature_map": "tanh"}, 'unknown feature map "tanh": choose elu\\+1 or relu'),
    ({"rotary": {"bse": 10}}, "unknown rotary option\\(s\\) bse: the options are base and interleaved"),
    ({"rotary": {"base": "big"}}, "rotary base must be a number, got 'big'"),
    ({"rotary": {"interleaved": 1}}, "rotary interleaved must be True or False, got 1"),
    ({"rotary": {"base": 0.5}}, "base must be finite and > 1, got 0.5"),
    ({"rotary": "rope"}, "rotary must be None, True, a dict \\(base, interleaved\\) or a qkv.RotaryEmbedding, got str"),
    ({"rotary": qkv.RotaryEmbedding(6)}, "RotaryEmbedding of head_dim 6, but the module's heads have 8 features"),
    ({"attention": "linear", "dropout": 0.1}, "linear attention takes no dropout"),
    ({"attention": "linear", "alibi": True}, "linear attention takes no dropout, softcap, alibi or sinks"),
])
def test_bad_options_are_errors(kwargs, match):
    with pytest.raises(qkv.Error, match=match):
        qkv.MultiHeadAttention(32, 4, **kwargs)


def test_odd_head_dim_refuses_rotary():
    with pytest.raises(qkv.Error, match="head_dim must be even and at least 2, got 5"):
        qkv.MultiHeadAttention(15, 3, rotary=True)


def test_linear_module_refuses_masks_weights_and_caches(rng):
    mha = qkv.MultiHeadAttention(16, 2, attention="linear")
    x = rng.standard_normal((1, 5, 16)).astype(np.float32)
    with pytest.raises(qkv.Error, match="causal only when built with causal=True"):
        mha(x, is_causal=True)
    with pytest.raises(qkv.Error, match="linear attention takes no mask"):
        mha(x, key_padding_mask=np.zeros((1, 5), bool))
    with pytest.raises(qkv.Error, match="has no weights"):
        mha(x, need_weights=True)
    cache = mha.make_cache(1, 8)
    with pytest.raises(qkv.Error, match="a KV cache serves softmax attention"):
        mha(x, cache=cache)
    assert "attention='linear', feature_map='elu+1'" in repr(mha)


def test_grouped_query_state_dict_round_trips(rng):
    mha = qkv.MultiHeadAttention(24, 4, num_kv_heads=2)
    randomise_biases(mha, rng)
    state = mha.state_dict()
    assert {"q_proj_weight", "k_proj.bias"} <= set(state) and "in_proj_bias" not in state
    copy = qkv.MultiHeadAttention(24, 4, num_kv_heads=2)
    copy.load_state_dict(state)
    for name, value in mha.parameters().items():
        np.testing.assert_array_equal(copy.parameters()[name], value)


def t5_bucket(relative, num_buckets, max_distance, bidirectional):
    """T5's bucket of relative position k - q (transformers' _relative_position_bucket), in float64
    but for torch's float32 truncation of the logarithmic part."""
    bucket, n = 0, relative
    if bidirectional:
        num_buckets //= 2
        bucket = num_buckets if n > 0 else 0
        n = abs(n)
    else:
        n = max(-n, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    large = exact + int(np.float32(np.log(n / exact) / np.log(max_distance / exact) * (num_buckets - exact)))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_bias_equals_float64_evaluation_and_learns(rng, bidirectional):
    """relative_position_bias: the module against the float64 module with T5's bias added to its
    scores (a random table), and the table gets a gradient from backward."""
    options = {"num_buckets": 8, "max_distance": 12, "bidirectional": bidirectional}
    mha = qkv.MultiHeadAttention(24, 3, relative_position_bias=options, seed=int(rng.integers(1 << 31)))
    assert mha.relative_position_bias == options
    assert "relative_position_bias={" in repr(mha)
    table = mha.parameters()["relative_position_bias.weight"]
    assert table.shape == (8, 3) and not table.any()  # zeros at first, as T5's
    table[...] = rng.standard_normal(table.shape).astype(np.float32)
    randomise_biases(mha, rng)
    mha.eval()
    x = rng.standard_normal((2, 19, 24)).astype(np.float32)
    got, _ = mha(x)
    # The float64 module with the bias: as module64, the bias added before the softmax.
    p = {name: value.astype(np.float64) for name, value in mha.parameters().items()}
    x64 = x.astype(np.float64)

    def heads(name):
        return (x64 @ p[f"{name}_proj.weight"].T + p[f"{name}_proj.bias"]).reshape(2, 19, 3, 8).transpose(0, 2, 1, 3)

    buckets = np.array([[t5_bucket(j - i, 8, 12, bidirectional) for j in range(19)] for i in range(19)])
    bias = p["relative_position_bias.weight"][buckets].transpose(2, 0, 1)  # (H, N, N)
    s = heads("q") @ np.swapaxes(heads("k"), -1, -2) / np.sqrt(8) + bias
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = (w @ heads("v")).transpose(0, 2, 1, 3).reshape(2, 19, 24) @ p["out_proj.weight"].T + p["out_proj.bias"]
    assert rel_err(got, want) <= 2e-5
    mha.train()
    mha.zero_grad()
    mha(x)
    mha.backward(rng.standard_normal(got.shape).astype(np.float32))
    assert np.abs(mha.grads()["relative_position_bias.weight"]).max() > 0
    copy = qkv.MultiHeadAttention(24, 3, relative_position_bias=options)
    copy.load_state_dict(mha.state_dict())
    np.testing.assert_array_equal(copy.parameters()["relative_position_bias.weight"], table)


@pytest.mark.parametrize("chunk", [1, 5, 23])
def test_t5_bias_cache_equals_full_causal_forward(rng, chunk):
    mha = qkv.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, seed=int(rng.integers(1 << 31)),
                                 relative_position_bias={"num_buckets": 8, "max_distance": 16, "bidirectional": False})
    table = mha.parameters()["relative_position_bias.weight"]
    table[...] = rng.standard_normal(table.shape).astype(np.float32)
    mha.eval()
    x = rng.standard_normal((2, 23, 32)).astype(np.float32)
    full, _ = mha(x)
    cache = mha.make_cache(2, 40)
    parts = [mha(x[:, s:s + chunk], cache=cache)[0] for s in range(0, 23, chunk)]
    assert rel_err(np.concatenate(parts, axis=1), full) <= 2e-5
    with pytest.raises(qkv.Error, match="not with a ring-buffer cache"):
        mha(x[:, :1], cache=mha.make_cache(2, 4, window=4))


@pytest.mark.parametrize("option, match", [
    ({"buckets": 8}, "unknown relative_position_bias option\\(s\\) buckets"),
    ({"bidirectional": 1}, "bidirectional must be True or False, got 1"),
    ({"num_buckets": 8.5}, "relative_position_bias num_buckets must be an integer"),
    ("t5", "relative_position_bias must be None, True or a dict"),
    ({"num_buckets": 2}, "num_buckets \\(2\\) >= 4"),
])
def test_bad_t5_options_are_errors(option, match):
    with pytest.raises(qkv.Error, match=match):
        qkv.MultiHeadAttention(16, 2, relative_position_bias=option)
