"""qkv.scaled_dot_product_attention against PyTorch's math path in float64.

Every mask kind (none, causal, window, key lengths, bool and float attn_mask at every rank,
combinations), cross shapes (Nq != Nk), Dk != Dv, grouped-query heads, ranks 4/3/2, custom
scale, dropout; on both kernels. Fresh random data each run (the seed is printed on failure).
"""
import threading
import time

import numpy as np
import pytest

import qkv
import torch_reference as ref


def randn(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def random_keep(rng, shape, nq, nk):
    """A random bool keep mask where every query still sees key 0 (no empty rows)."""
    keep = rng.random(shape) < 0.6
    keep[..., 0] = True
    return keep


# Each case: shapes (q, k, v), then a function of (rng, B, Hq, Nq, Nk) returning
# (qkv keyword arguments, reference keyword arguments).
B, HQ, HKV, NQ, NK, DK, DV = 2, 3, 3, 7, 11, 16, 8


def no_mask(rng):
    return {}, {}


def causal(rng):
    return {"is_causal": True}, {"keep": ref.causal_keep(NQ, NK)}


def window(rng):
    return {"window": (3, 1)}, {"keep": ref.window_keep(NQ, NK, 3, 1)}


def window_left_only(rng):
    return {"window": 2}, {"keep": ref.window_keep(NQ, NK, 2, 0)}


def key_lengths(rng):
    return {"key_lengths": [4, NK]}, {"keep": ref.lengths_keep([4, NK], NK)}


def bool_mask_2d(rng):
    keep = random_keep(rng, (NQ, NK), NQ, NK)
    return {"attn_mask": keep}, {"keep": keep}


def bool_mask_3d(rng):
    # Rank 3 against rank-4 scores aligns numpy-style: (Hq, Nq, Nk), as in PyTorch.
    keep = random_keep(rng, (HQ, NQ, NK), NQ, NK)
    return {"attn_mask": keep}, {"keep": keep}


def bool_mask_4d(rng):
    keep = random_keep(rng, (B, 1, NQ, NK), NQ, NK)
    return {"attn_mask": keep}, {"keep": keep}


def float_mask_4d(rng):
    additive = rng.standard_normal((B, HQ, NQ, NK)).astype(np.float32)
    additive[rng.random(additive.shape) < 0.3] = -np.inf
    additive[..., 0] = 0.5
    return {"attn_mask": additive}, {"additive": additive}


def float_mask_1d(rng):
    additive = rng.standard_normal(NK).astype(np.float32)  # (Nk,): one bias per key, broadcast
    return {"attn_mask": additive}, {"additive": additive}


def float64_mask(rng):
    additive = rng.standard_normal((NQ, NK))  # float64: converted to float32 by qkv
    return {"attn_mask": additive}, {"additive": additive.astype(np.float32)}


def combined(rng):
    additive = rng.standard_normal((1, HQ, NQ, NK)).astype(np.float32)
    keep = ref.causal_keep(NQ, NK) & ref.lengths_keep([5, 9], NK)
    return ({"attn_mask": additive, "is_causal": True, "key_lengths": [5, 9]},
            {"keep": keep, "additive": additive})


def qkv_mask_object(rng):
    mask = qkv.Mask.causal() & qkv.Mask.window(2)
    return {"attn_mask": mask}, {"keep": ref.causal_keep(NQ, NK) & ref.window_keep(NQ, NK, 2, 0)}


def custom_scale(rng):
    return {"scale": 0.3}, {"scale": 0.3}


CASES = [no_mask, causal, window, window_left_only, key_lengths, bool_mask_2d, bool_mask_3d, bool_mask_4d,
         float_mask_4d, float_mask_1d, float64_mask, combined, qkv_mask_object, custom_scale]


def check(out, expected, tol, what):
    assert out.dtype == np.float32
    assert out.shape == expected.shape, what
    diff = float(np.max(np.abs(out - expected))) if out.size else 0.0
    assert diff <= tol, f"{what}: maxdiff {diff:.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("backend", ["flash", "reference"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_matches_pytorch_math_path(rng, case, backend):
    q, k, v = randn(rng, B, HQ, NQ, DK), randn(rng, B, HKV, NK, DK), randn(rng, B, HKV, NK, DV)
    kwargs, ref_kwargs = case(rng)
    expected, expected_weights = ref.attention(q, k, v, **ref_kwargs)
    tol = ref.tolerance(q, k, v, **ref_kwargs)
    out = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
    check(out, expected, tol, "output")
    if backend == "reference":
        out, weights = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, backend=backend, **kwargs)
        check(out, expected, tol, "output with weights")
        check(weights, expected_weights, tol, "weights")


@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_grouped_query_attention(rng, mask):
    # 6 query heads share 2 key/value heads; PyTorch's side repeats K/V heads.
    q, k, v = randn(rng, 2, 6, 9, 16), randn(rng, 2, 2, 9, 16), randn(rng, 2, 2, 9, 12)
    kwargs, ref_kwargs = {
        "none": ({}, {}),
        "causal": ({"is_causal": True}, {"keep": ref.causal_keep(9, 9)}),
        "padding": ({"key_lengths": [3, 9]}, {"keep": ref.lengths_keep([3, 9], 9)}),
    }[mask]
    expected, expected_weights = ref.attention(q, k, v, **ref_kwargs)
    tol = ref.tolerance(q, k, v, **ref_kwargs)
    check(qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs), expected, tol, "output")
    out, weights = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, need_weights=True, **kwargs)
    check(weights, expected_weights, tol, "weights")


@pytest.mark.parametrize("shape", [(5, 16), (3, 5, 16)], ids=["rank2", "rank3"])
def test_one_head_ranks(rng, shape):
    q, k = randn(rng, *shape), randn(rng, *shape[:-2], 8, 16)
    v = randn(rng, *shape[:-2], 8, 4)
    expected, _ = ref.attention(q, k, v, keep=ref.causal_keep(shape[-2], 8))
    out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    check(out, expected, ref.tolerance(q, k, v, keep=ref.causal_keep(shape[-2], 8)), "output")


def test_converts_float64_with_allow_cast_and_strided_inputs(rng):
    q, k, v = randn(rng, 2, 3, 5, 8), randn(rng, 2, 3, 6, 8), randn(rng, 2, 3, 6, 8)
    expected = qkv.scaled_dot_product_attention(q, k, v)
    # float64 (allowed by allow_cast; tests/python/test_dtypes.py: refused without), and a
    # transposed (non-contiguous) view of the same numbers
    k_strided = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not k_strided.flags["C_CONTIGUOUS"]
    out = qkv.scaled_dot_product_attention(q.astype(np.float64), k_strided, v.tolist(), allow_cast=True)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected)


def test_output_owns_its_memory_through_the_library(rng):
    q = randn(rng, 1, 2, 4, 8)
    out = qkv.scaled_dot_product_attention(q, q, q)
    del q
    assert out.base is not None  # a view of qkv's buffer, kept alive by the array
    out[...] += 1  # writable
    assert np.isfinite(out).all()


def test_dropout_matches_reference_with_the_same_seed(rng):
    p, seed = 0.25, 1234
    q, k, v = randn(rng, 2, 2, 5, 8), randn(rng, 2, 2, 6, 8), randn(rng, 2, 2, 6, 4)
    _, weights = ref.attention(q, k, v)
    keep = np.array([[[[qkv.dropout_keeps(seed, b, h, i, j, p) for j in range(6)] for i in range(5)]
                      for h in range(2)] for b in range(2)])
    assert 0 < keep.mean() < 1
    dropped = weights * keep / (1 - p)
    expected = dropped @ v.astype(np.float64)
    tol = ref.tolerance(q, k, v)
    for backend in ("flash", "reference"):
        out = qkv.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=seed, backend=backend)
        check(out, expected, tol, f"dropout output ({backend})")
    _, got_weights = qkv.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=seed, need_weights=True)
    check(got_weights, dropped, tol, "dropout weights")
    other = qkv.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=seed + 1)
    assert not np.allclose(other, expected)


def test_fully_masked_rows_are_zero_where_pytorch_gives_nan(rng):
    # Batch 1 has no key at all (length 0); in batch 0, query 2 is hidden from every key by the
    # bool mask. qkv: output and weights of zeros. PyTorch 1.13's math path: NaN (softmax of a
    # row of -inf). This is a documented difference (docs/python.md).
    q, k, v = randn(rng, 2, 2, 4, 8), randn(rng, 2, 2, 5, 8), randn(rng, 2, 2, 5, 8)
    keep = np.ones((2, 1, 4, 5), dtype=bool)
    keep[0, :, 2, :] = False
    out, weights = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, key_lengths=[5, 0], need_weights=True)
    expected, expected_weights = ref.attention(q, k, v, keep=keep & ref.lengths_keep([5, 0], 5).numpy())
    empty = np.zeros((2, 2, 4), dtype=bool)
    empty[1] = True
    empty[0, :, 2] = True
    assert np.isnan(expected[empty]).all() and np.isnan(expected_weights[empty]).all()
    assert (out[empty] == 0).all() and (weights[empty] == 0).all()
    assert np.isfinite(out).all()
    check(out[~empty], expected[~empty], ref.tolerance(q, k, v), "visible rows")
    flash = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, key_lengths=[5, 0], backend="flash")
    assert (flash[empty] == 0).all()


def test_mask_helpers_are_sdpa_bool_masks(rng):
    np.testing.assert_array_equal(qkv.create_causal_mask(4), np.tril(np.ones((4, 4), dtype=bool)))
    padding = qkv.create_padding_mask([2, 4], 5)
    assert padding.dtype == np.bool_ and padding.shape == (2, 1, 1, 5)
    np.testing.assert_array_equal(padding[:, 0, 0], [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    q = randn(rng, 2, 2, 4, 8)
    k = randn(rng, 2, 2, 5, 8)
    by_matrix = qkv.scaled_dot_product_attention(q, k, k, attn_mask=padding)
    by_lengths = qkv.scaled_dot_product_attention(q, k, k, key_lengths=[2, 4])
    np.testing.assert_allclose(by_matrix, by_lengths, atol=1e-6)


def test_mask_repr():
    assert repr(qkv.Mask.causal() & qkv.Mask.key_lengths([2, 5])) == "Mask(causal & key_lengths(2, 5))"


def test_releases_the_gil_while_computing(rng):
    # A Python thread keeps counting while qkv computes; with the GIL held it could not.
    q = randn(rng, 1, 4, 384, 64)
    ticks, stop = [], threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.01)
    inside = 0
    try:
        for _ in range(20):
            start = time.perf_counter()
            qkv.scaled_dot_product_attention(q, q, q, backend="reference")
            end = time.perf_counter()
            inside += sum(start < t < end for t in ticks[-200000:])
            if inside > 100:
                break
    finally:
        stop.set()
        counter.join()
    assert inside > 100



def test_float32_inputs_are_read_in_place(rng):
    # A float32 C-contiguous array is wrapped, not copied: a mask built from one sees later
    # writes to it (as a tensor from torch.from_numpy would), and the array lives on in the mask
    # after its name is gone.
    q = randn(rng, 1, 1, 3, 4)
    scores = np.zeros((3, 3), dtype=np.float32)
    mask = qkv.Mask.additive(scores)
    scores[:, 1:] = -np.inf
    del scores
    out, weights = qkv.scaled_dot_product_attention(q, q, q, attn_mask=mask, need_weights=True)
    np.testing.assert_array_equal(weights[..., 1:], 0)
    np.testing.assert_allclose(out, np.broadcast_to(q[:, :, :1], out.shape), rtol=1e-6)
