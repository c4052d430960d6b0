"""qkv.attention_summary against the weights of need_weights=True (reference backend), recomputed
in float64 here: entropy, the top-k keys (near ties in either order, exact ties to the lower index)
and their weights, and the mass each key receives; with masks, GQA, odd shapes and rank 2/3
inputs; and its errors."""
import numpy as np
import pytest

import qkv


def expected(weights, k):
    """Entropy, top keys, top weights and received mass from weights (..., Nq, Nk)."""
    w = np.asarray(weights, dtype=np.float64)
    entropy = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0), axis=-1)
    order = np.argsort(-w, axis=-1, kind="stable")[..., :k]  # stable: ties to the lower index
    top = np.take_along_axis(w, order, axis=-1)
    keys = np.where(top > 0, order, -1)
    top = np.where(top > 0, top, 0)
    if k > w.shape[-1]:
        pad = [(0, 0)] * (w.ndim - 1) + [(0, k - w.shape[-1])]
        keys, top = np.pad(keys, pad, constant_values=-1), np.pad(top, pad)
    return entropy, keys, top, w.sum(axis=-2)


NEAR_TIE = 1e-6


def lower_twins(k, heads):
    """For each key, the lowest index of a key with an equal row (itself if none), (..., Hq, 1, Nk)
    or (1, Nk) for rank 2, the heads of a GQA k repeated as the query heads see them."""
    k = np.asarray(k)
    if k.ndim >= 3 and k.shape[-3] != heads:
        k = np.repeat(k, heads // k.shape[-3], axis=-3)
    equal = (k[..., :, None, :] == k[..., None, :, :]).all(axis=-1)
    return np.argmax(equal, axis=-1)[..., None, :]


def check_top_keys(got, keys, top, weights, twins):
    """The kernel's top keys against the reference's (keys, top from expected(weights)). Its
    scores differ from the reference's in their last bits (other summation orders), so a key
    other than the expected one is accepted when its reference weight is within NEAR_TIE of the
    expected weight. An exact tie must go to the lower index within the kernel's own list: a
    listed key's lower twin (equal key rows, no per-key term: equal logits in every kernel), when
    visible (the same reference weight), comes before it. Not slot by slot: twins an ulp above a
    third key in one kernel and an ulp below it in the other take different slots (the C++ test,
    seed 14490465335938470176)."""
    w = np.asarray(weights, dtype=np.float64)
    n_keys = w.shape[-1]
    got, keys, top = (a.reshape(-1, a.shape[-1]) for a in (got, keys, top))
    w = w.reshape(-1, n_keys)
    twins = np.broadcast_to(twins, np.asarray(weights).shape).reshape(-1, n_keys)
    np.testing.assert_array_equal(got < 0, keys < 0)  # as many keys listed as have weight
    for row in range(got.shape[0]):
        for slot, key in enumerate(got[row]):
            if key < 0:
                continue
            where = f"row {row} slot {slot}: key {key} (reference weight {w[row, key]!r})"
            assert key not in got[row, :slot], f"{where} listed twice: {got[row]}"
            first = twins[row, key]
            assert first == key or w[row, first] != w[row, key] or first in got[row, :slot], \
                f"{where} without its exact twin {first} before it: {got[row]}"
            assert abs(w[row, key] - top[row, slot]) <= NEAR_TIE, \
                f"{where} where key {keys[row, slot]} ({top[row, slot]!r}) was expected"


def check(q, k, v, top_k, **kwargs):
    mask = kwargs.get("attn_mask")
    assert not (isinstance(mask, np.ndarray) and mask.dtype.kind == "f"), "twins need no per-key term"
    _, weights = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, backend="reference", **kwargs)
    got = qkv.attention_summary(q, k, v, top_k=top_k, **kwargs)
    entropy, keys, top, received = expected(weights, top_k)
    assert got["top_keys"].dtype == np.int64
    heads = np.asarray(weights).shape[-3] if np.asarray(weights).ndim >= 3 else 1
    check_top_keys(got["top_keys"], keys, top, weights, lower_twins(k, heads))
    np.testing.assert_allclose(got["top_weights"], top, atol=1e-5)
    np.testing.assert_allclose(got["entropy"], entropy, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got["received"], received, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got["output"], qkv.scaled_dot_product_attention(q, k, v, **kwargs), atol=1e-4)
    return got


@pytest.mark.parametrize("n,m,d,top_k", [(1, 1, 4, 3), (17, 113, 33, 5), (130, 70, 64, 16), (200, 200, 8, 1)])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "lengths", "bool", "expression"])
def test_matches_the_weights(n, m, d, top_k, mask):
    rng = np.random.default_rng(n * 1000 + m + d)
    q = rng.standard_normal((2, 4, n, d), dtype=np.float32)
    k = rng.standard_normal((2, 2, m, d), dtype=np.float32)
    v = rng.standard_normal((2, 2, m, 5), dtype=np.float32)
    k[:, :, m // 2:m // 2 + 3] = k[:, :, :1]  # equal keys: ties
    kwargs = {"enable_gqa": True}
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "window":
        kwargs["window"] = 7
    elif mask == "lengths":
        kwargs["key_lengths"] = [m, max(0, m - 5)]
    elif mask == "bool":
        kwargs["attn_mask"] = rng.random((n, m)) < 0.6
    elif mask == "expression":
        kwargs["attn_mask"] = "causal & (window(5) | strided(3))"
    check(q, k, v, top_k, **kwargs)


def test_rank_two_and_three():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((9, 8), dtype=np.float32) for _ in range(3))
    got = check(q, k, v, 4)
    assert got["entropy"].shape == (9,) and got["top_keys"].shape == (9, 4) and got["received"].shape == (9,)
    got = check(q[None], k[None], v[None], 20, is_causal=True)  # k > Nk: -1 past the keys
    assert got["top_keys"].shape == (1, 9, 20) and (got["top_keys"][0, 0, 1:] == -1).all()


def test_uniform_and_peaked_rows():
    q = np.zeros((1, 1, 3, 4), dtype=np.float32)
    k = np.zeros((1, 1, 8, 4), dtype=np.float32)
    v = np.ones((1, 1, 8, 2), dtype=np.float32)
    got = qkv.attention_summary(q, k, v, top_k=3)
    np.testing.assert_allclose(got["entropy"], np.log(8), rtol=1e-6)  # uniform over 8 keys
    np.testing.assert_array_equal(got["top_keys"][0, 0, 0], [0, 1, 2])  # all tied: lowest first
    np.testing.assert_allclose(got["received"], 3 / 8, rtol=1e-6)


@pytest.mark.parametrize("kwargs,needle", [
    ({"top_k": 0}, "top_k must be an integer in [1, 256]"),
    ({"top_k": 300}, "top_k must be an integer in [1, 256]"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_k": 2, "backend": "decode"}, "backend Decode does not compute summaries"),
    ({"top_k": 2, "dropout_p": 0.1}, "unexpected keyword argument"),
])
def test_errors(kwargs, needle):
    q = np.zeros((1, 1, 3, 4), dtype=np.float32)
    with pytest.raises(qkv.Error, match=needle.replace("[", r"\[").replace("]", r"\]")):
        qkv.attention_summary(q, q, q, **kwargs)
