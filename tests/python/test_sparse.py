"""Sparse masks from Python: qkv.Mask.strided / global_tokens / block_sparse, unions with |,
and mask expressions (qkv.Mask.parse, or a string attn_mask), against a float64 numpy
evaluation of softmax(q k^T * scale + bias) v with the pattern written out element by element.
Fresh random data each run.
"""
import numpy as np
import pytest

import qkv

B, H, NQ, NK, D = 2, 3, 37, 53, 16


def reference(q, k, v, visible):
    """float64 attention with visible[b, h, i, j] (broadcast) deciding each score."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    return (p / np.where(total > 0, total, 1)) @ v


def grid():
    i = np.arange(NQ)[:, None]
    j = np.arange(NK)[None, :]
    return i, j


def patterns(rng):
    i, j = grid()
    layout = rng.random((H, -(-NQ // 8), -(-NK // 16))) < 0.4
    blocks = layout[:, i // 8, j // 16][None]
    return [
        (qkv.Mask.strided(5, 2), (2 + i - j) % 5 == 0),
        (qkv.Mask.causal() & (qkv.Mask.window(6) | qkv.Mask.strided(7)), (j <= i) & ((i - j <= 6) | ((i - j) % 7 == 0))),
        (qkv.Mask.global_tokens(3) | qkv.Mask.window(2, 1), (j < 3) | (i < 3) | ((i - j <= 2) & (j - i <= 1))),
        (qkv.Mask.block_sparse(layout.astype(np.float32), 8, 16), blocks),
        (qkv.Mask.parse("causal & (window(3) | strided(4)) | global(2)"),
         ((j <= i) & ((i - j <= 3) | ((i - j) % 4 == 0))) | (j < 2) | (i < 2)),
    ]


@pytest.mark.parametrize("backend", [qkv.Backend.Reference, qkv.Backend.Flash])
def test_patterns_match_numpy(backend):
    rng = np.random.default_rng()
    q = rng.standard_normal((B, H, NQ, D), dtype=np.float32)
    k = rng.standard_normal((B, H, NK, D), dtype=np.float32)
    v = rng.standard_normal((B, H, NK, D), dtype=np.float32)
    for mask, visible in patterns(rng):
        out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        np.testing.assert_allclose(out, reference(q, k, v, visible), rtol=1e-4, atol=1e-5, err_msg=str(mask))


def test_a_string_attn_mask_is_parsed():
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 2, 20, 8), dtype=np.float32)
    i = np.arange(20)[:, None]
    j = np.arange(20)[None, :]
    got = qkv.scaled_dot_product_attention(q, q, q, attn_mask="causal & (window(2) | strided(5))")
    want = reference(q, q, q, (j <= i) & ((i - j <= 2) | ((i - j) % 5 == 0)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_str_round_trips_and_errors_point_at_the_token():
    text = "causal & (window(127) | strided(128)) | global(16)"
    assert str(qkv.Mask.parse(text)) == text
    assert repr(qkv.Mask.causal() | qkv.Mask.strided(4)) == "Mask(causal | strided(4))"
    with pytest.raises(qkv.MaskParseError, match="column 10, found 'windw': unknown mask"):
        qkv.Mask.parse("causal & windw(3)")
    with pytest.raises(qkv.Error, match="stride 0 must be >= 1"):
        qkv.Mask.strided(0)
    with pytest.raises(qkv.Error, match="union"):
        qkv.Mask.strided(2) | qkv.Mask.additive(np.zeros((3, 3), np.float32))
    assert issubclass(qkv.MaskParseError, qkv.Error)
