"""qkv.apply_rotary / qkv.RotaryTable (rotary positions from FlashAttention's rotary_cos /
rotary_sin tables, partial rotary_dim, both layouts) against FlashAttention's reference formula
(flash_attn/layers/rotary.py: apply_rotary_emb_torch, written here in numpy float64), the table
form built from a base against qkv.RotaryEmbedding, and the errors."""
import numpy as np
import pytest

import qkv


def rotate_half(x, interleaved):
    """FlashAttention's rotate_half: (-x2, x1) on the halves, or on each adjacent pair."""
    if not interleaved:
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([-x2, x1], axis=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return np.stack([-x2, x1], axis=-1).reshape(x.shape)


def flash_reference(x, cos, sin, interleaved, seqlen_offsets):
    """apply_rotary_emb_torch on x (B, N, H, D), FlashAttention's layout, in float64: each batch
    element's rows of cos / sin from its offset, repeated "... d -> ... 1 (2 d)" (half-split) or
    "... d -> ... 1 (d 2)" (interleaved); out = x * cos + rotate_half(x) * sin on the first
    rotary_dim features, the rest as they are."""
    x = x.astype(np.float64)
    ro_dim = cos.shape[-1] * 2
    assert ro_dim <= x.shape[-1]
    out = x.copy()
    n = x.shape[1]
    for b, offset in enumerate(np.broadcast_to(seqlen_offsets, (x.shape[0],))):
        c = cos[offset:offset + n].astype(np.float64)
        s = sin[offset:offset + n].astype(np.float64)
        c = np.repeat(c, 2, axis=-1) if interleaved else np.concatenate([c, c], axis=-1)
        s = np.repeat(s, 2, axis=-1) if interleaved else np.concatenate([s, s], axis=-1)
        c, s = c[:, None, :], s[:, None, :]  # over the heads
        part = x[b, ..., :ro_dim]
        out[b, ..., :ro_dim] = part * c + rotate_half(part, interleaved) * s
    return out


CASES = [  # (B, N, H, D, rotary_dim, offsets)
    (2, 7, 3, 10, 6, [0, 3]),
    (1, 5, 1, 9, 4, [11]),
    (3, 1, 2, 12, 12, [5, 0, 9]),
    (2, 4, 1, 7, 2, 1),
    (1, 13, 4, 64, 32, 0),
]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_matches_flash_attention_reference(case, interleaved):
    B, N, H, D, R, offsets = case
    rng = np.random.default_rng(D * 100 + R)
    longest = int(np.max(np.asarray(offsets) + N))
    # Any values: FlashAttention does not ask the tables to lie on the unit circle.
    cos = rng.uniform(-1.5, 1.5, (longest + 3, R // 2)).astype(np.float32)
    sin = rng.uniform(-1.5, 1.5, (longest + 3, R // 2)).astype(np.float32)
    x_bnhd = rng.standard_normal((B, N, H, D)).astype(np.float32)
    expected = flash_reference(x_bnhd, cos, sin, interleaved, offsets).transpose(0, 2, 1, 3)

    x = x_bnhd.transpose(0, 2, 1, 3)  # qkv's (B, H, N, D): a strided view, read as given
    cache_seqlens = offsets if isinstance(offsets, int) else list(offsets)
    got = qkv.apply_rotary(x, cos, sin, rotary_interleaved=interleaved, cache_seqlens=cache_seqlens)
    assert got.dtype == np.float32 and got.shape == (B, H, N, D)
    # Computed in double and rounded once: within half an ulp of float32 of the float64 value.
    np.testing.assert_allclose(got, expected, rtol=2 ** -23, atol=1e-30)
    assert np.array_equal(got[..., R:], x[..., R:])  # the features past rotary_dim pass through

    table = qkv.RotaryTable(D, cos, sin, rotary_interleaved=interleaved)
    assert (table.head_dim, table.rotary_dim, table.length, table.interleaved) == (D, R, longest + 3, interleaved)
    assert np.array_equal(table.apply(x, cache_seqlens), got)
    assert np.array_equal(table.cos, cos) and np.array_equal(table.sin, sin)


def test_fewer_dims_torch_tensors_and_float64_tables():
    cos = np.cos(np.outer(np.arange(8), [1.0, 0.1]))
    sin = np.sin(np.outer(np.arange(8), [1.0, 0.1]))
    x = np.random.default_rng(1).standard_normal((5, 6)).astype(np.float32)  # (N, D)
    got = qkv.apply_rotary(x, cos, sin, cache_seqlens=2)  # float64 tables: rounded to float32
    expected = flash_reference(x[None, :, None, :], cos.astype(np.float32), sin.astype(np.float32), False, 2)
    np.testing.assert_allclose(got, expected[0, :, 0, :], rtol=2 ** -23, atol=1e-30)
    torch = pytest.importorskip("torch")
    from_torch = qkv.apply_rotary(torch.from_numpy(x), torch.from_numpy(cos).float(), torch.from_numpy(sin).float(),
                                  cache_seqlens=2)
    assert np.array_equal(from_torch, got)


@pytest.mark.parametrize("interleaved", [False, True])
def test_tables_of_the_base_reproduce_rotary_embedding(interleaved):
    x = np.random.default_rng(2).standard_normal((2, 3, 40, 16)).astype(np.float32)
    base = qkv.RotaryEmbedding(16, base=10000.0, interleaved=interleaved)
    exact = qkv.RotaryTable.from_base(16, 200, base=10000.0, interleaved=interleaved)
    for offset in (0, 37, 160):
        assert np.array_equal(exact.apply(x, offset), base.apply(x, offset))  # bit for bit
    # Handed over as float32 tables (as FlashAttention's callers do), each entry is rounded once:
    # |cos - cos32| <= 2^-25, so each output moves by at most 2^-25 (|x1| + |x2|) plus an ulp.
    f32 = qkv.RotaryTable(16, exact.cos, exact.sin, rotary_interleaved=interleaved)
    a, b = base.apply(x, 37), f32.apply(x, 37)
    partner = np.arange(16) ^ 1 if interleaved else (np.arange(16) + 8) % 16
    bound = (np.abs(x) + np.abs(x[..., partner])) * 2.0 ** -25 + np.spacing(np.maximum(np.abs(a), np.abs(b)))
    assert np.all(np.abs(a.astype(np.float64) - b) <= bound)
    # A partial rotary_dim: the base form of rotary_dim 6 on the first 6 of 11 features.
    y = np.random.default_rng(3).standard_normal((1, 2, 9, 11)).astype(np.float32)
    part = qkv.RotaryTable.from_base(11, 64, interleaved=interleaved, rotary_dim=6).apply(y, 5)
    small = qkv.RotaryEmbedding(6, interleaved=interleaved).apply(np.ascontiguousarray(y[..., :6]), 5)
    assert np.array_equal(part[..., :6], small) and np.array_equal(part[..., 6:], y[..., 6:])


def test_one_options_object():
    options = qkv._core.RotaryTableOptions()
    options.rotary_cos = np.ones((4, 2), np.float32)
    options.rotary_sin = np.zeros((4, 2), np.float32)
    options.rotary_interleaved = True
    assert options.rotary_cos.shape == (4, 2) and options.rotary_interleaved
    table = qkv._core.RotaryTableCore(4, options)
    assert table.rotary_dim == 4 and table.interleaved


def test_errors_name_shapes_and_values():
    c, s = np.zeros((6, 3), np.float32), np.zeros((6, 3), np.float32)
    x = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(qkv.Error, match=r"rotary_dim 5 must be even"):
        qkv.RotaryTable.from_base(8, 10, rotary_dim=5)
    with pytest.raises(qkv.Error, match=r"rotary_dim 10 is more than head_dim 8"):
        qkv.RotaryTable.from_base(8, 10, rotary_dim=10)
    with pytest.raises(qkv.Error, match=r"\(6, 3\) rotate rotary_dim 6 features, more than head_dim 4"):
        qkv.apply_rotary(np.zeros((2, 4), np.float32), c, s)
    with pytest.raises(qkv.Error, match=r"cos is \(6, 3\) but sin is \(6, 2\)"):
        qkv.apply_rotary(x, c, np.zeros((6, 2), np.float32))
    with pytest.raises(qkv.Error, match=r"4 tokens from position 3 reach position 6, but the tables hold positions "
                                        r"0 to 5 \(seqlen_ro 6\)"):
        qkv.apply_rotary(x, c, s, cache_seqlens=3)
    with pytest.raises(qkv.Error, match=r"2 position offsets for a batch of 1"):
        qkv.apply_rotary(x, c, s, cache_seqlens=[0, 1])
    with pytest.raises(qkv.Error, match=r"rotary_cos is int64"):
        qkv.apply_rotary(x, np.zeros((6, 3), np.int64), s)
    with pytest.raises(qkv.Error, match=r"rotary_interleaved must be True or False"):
        qkv.apply_rotary(x, c, s, rotary_interleaved="yes")
    with pytest.raises(qkv.Error, match=r"sin\[1, 2\] is inf"):
        qkv.apply_rotary(x, c, np.where(np.arange(18).reshape(6, 3) == 5, np.inf, 0).astype(np.float32))
    with pytest.raises(qkv.Error, match=r"float64"):
        qkv.apply_rotary(x.astype(np.float64), c, s)
    with pytest.raises(qkv.Error, match=r"x is \(8,\)"):
        qkv.apply_rotary(np.zeros(8, np.float32), c, s)
    with pytest.raises(qkv.Error, match=r"cache_seqlens"):
        qkv.apply_rotary(x, c, s, cache_seqlens="a")


def test_the_docs_example_runs():
    """docs/inference.md's "Rotary from tables" section: its python block runs."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "inference.md").read_text()
    section = doc.split("## Rotary from tables", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/inference.md: Rotary from tables", "exec"), {"__name__": "docs_inference_md"})
