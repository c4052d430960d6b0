"""temperature= on qkv's attention functions and qkv.entropy / qkv.head_entropy, against numpy
(and torch autograd) in float64.

temperature T: weights = softmax(q.k * scale / T), each row the T = 1 row raised to 1/T and
renormalised (the explorer's temperature law), forward on both kernels, backward, and
qkv.torch's autograd. entropy: -sum_j w ln w per row (0 ln 0 = 0), from
qkv::analysis::row_entropy, the function behind the explorer's numbers; `qkv heads`' broad
score is its mean over rows i >= 1 of entropy / ln(i + 1) on a causal model.
"""
import math

import numpy as np
import pytest
import torch

import qkv
from test_models import gpt2  # noqa: F401  (the tiny GPT-2 folder fixture)

B, H, N, D = 2, 3, 9, 16
TEMPERATURES = [0.05, 0.3, 1.0, 2.5, 5.0]


def data(rng, b=B, h=H, n=N, d=D):
    return [rng.standard_normal((b, h, n, d), dtype=np.float32) for _ in range(3)]


def softmax64(q, k, scale, temperature, causal=False):
    """softmax(q k^T * scale / T) in float64, rows (B, H, N, N)."""
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale / temperature
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
    s -= s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def entropy64(w):
    w = np.asarray(w, dtype=np.float64)
    return -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0), axis=-1)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("causal", [False, True])
def test_temperature_weights_and_output_against_float64(rng, temperature, causal):
    q, k, v = data(rng)
    expected = softmax64(q, k, 1 / math.sqrt(D), temperature, causal)
    out, weights = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal, temperature=temperature,
                                                    need_weights=True, backend="reference")
    # float32 scores grow as 1/T: the error of a weight with them.
    atol = 2e-6 / min(1.0, temperature)
    np.testing.assert_allclose(weights, expected, atol=atol, rtol=1e-4)
    expected_out = expected @ v.astype(np.float64)
    np.testing.assert_allclose(out, expected_out, atol=5 * atol, rtol=1e-4)
    flash = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal, temperature=temperature, backend="flash")
    np.testing.assert_allclose(flash, expected_out, atol=5 * atol, rtol=1e-4)


def test_temperature_law_rows_are_powers_of_the_t1_row(rng):
    """The explorer's lesson: the row at T is the row at T = 1 raised to 1/T, renormalised."""
    q, k, v = data(rng)
    _, at_one = qkv.scaled_dot_product_attention(q, k, v, need_weights=True)
    for t in TEMPERATURES:
        _, at_t = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, temperature=t)
        powered = at_one.astype(np.float64) ** (1 / t)
        np.testing.assert_allclose(at_t, powered / powered.sum(-1, keepdims=True), atol=3e-5 / min(1, t))
    # Colder rows are sharper: the mean entropy falls with T.
    means = [qkv.entropy(qkv.scaled_dot_product_attention(q, k, v, need_weights=True, temperature=t)[1]).mean()
             for t in TEMPERATURES]
    assert means == sorted(means) and means[-1] > 0.9 * math.log(N) and means[0] < 0.5


def test_temperature_with_a_scale_and_the_identity_cases(rng):
    q, k, v = data(rng)
    _, w = qkv.scaled_dot_product_attention(q, k, v, scale=0.7, temperature=2.0, need_weights=True)
    np.testing.assert_allclose(w, softmax64(q, k, 0.7, 2.0), atol=2e-6)
    plain = qkv.scaled_dot_product_attention(q, k, v)
    for t in (None, 1, 1.0):
        np.testing.assert_array_equal(qkv.scaled_dot_product_attention(q, k, v, temperature=t), plain)
    # The same as giving the scale: 1 / (sqrt(D) T).
    np.testing.assert_allclose(qkv.scaled_dot_product_attention(q, k, v, temperature=4.0),
                               qkv.scaled_dot_product_attention(q, k, v, scale=1 / (math.sqrt(D) * 4.0)), atol=1e-6)


@pytest.mark.parametrize("temperature", [0.25, 3.0])
def test_temperature_backward_against_torch_float64(rng, temperature):
    q, k, v = data(rng)
    grad = rng.standard_normal(q.shape, dtype=np.float32)
    out, lse = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, temperature=temperature, return_lse=True)
    dq, dk, dv = qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, is_causal=True,
                                                           temperature=temperature)
    tq, tk, tv = (torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / (math.sqrt(D) * temperature)
    s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), -math.inf)
    (torch.softmax(s, -1) @ tv).backward(torch.from_numpy(grad.astype(np.float64)))
    for got, want in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        np.testing.assert_allclose(got, want.numpy(), atol=2e-4 / min(1, temperature), rtol=1e-3)
    # qkv.torch's autograd takes the same keyword.
    xq, xk, xv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    y = qkv.torch.scaled_dot_product_attention(xq, xk, xv, is_causal=True, temperature=temperature)
    np.testing.assert_allclose(y.detach().numpy(), out, atol=1e-6)
    y.backward(torch.from_numpy(grad))
    np.testing.assert_allclose(xq.grad.numpy(), dq, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "hot", True, [1.0]])
def test_bad_temperature_is_a_qkv_error(rng, bad):
    q, k, v = data(rng)
    with pytest.raises(qkv.Error, match="temperature"):
        qkv.scaled_dot_product_attention(q, k, v, temperature=bad)
    with pytest.raises(qkv.Error, match="temperature"):
        qkv.torch.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), temperature=bad)


# ---- entropy


@pytest.mark.parametrize("shape", [(N, N), (H, N, 5), (B, H, N, N)])
def test_entropy_against_float64(rng, shape):
    logits = rng.standard_normal(shape) * 3
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = (w / w.sum(-1, keepdims=True)).astype(np.float32)
    w[..., 0, :2] = [0.5, 0.5]  # a row with exact zeros: 0 ln 0 = 0
    w[..., 0, 2:] = 0
    h = qkv.entropy(w)
    assert h.shape == shape[:-1] and h.dtype == np.float32
    np.testing.assert_allclose(h, entropy64(w), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(h[..., 0], math.log(2), rtol=1e-6)
    if len(shape) >= 3:
        np.testing.assert_allclose(qkv.head_entropy(w), entropy64(w).mean(-1), rtol=1e-6)


def test_entropy_edges_and_attention_weights(rng):
    one_hot = np.eye(4, dtype=np.float32)
    np.testing.assert_array_equal(qkv.entropy(one_hot), 0)
    np.testing.assert_allclose(qkv.entropy(np.full((3, 7), 1 / 7, dtype=np.float32)), math.log(7), rtol=1e-6)
    np.testing.assert_array_equal(qkv.entropy(np.zeros((2, 5), dtype=np.float32)), 0)  # a query that saw no key
    # The weights attention returns, causal: row i spreads over i + 1 keys at most.
    q, k, v = data(rng)
    _, w = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True, temperature=100.0)
    h = qkv.entropy(w)
    np.testing.assert_allclose(h, entropy64(w), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(h, np.log(np.arange(1, N + 1))[None, None, :] * np.ones((B, H, 1)), rtol=2e-3)
    # torch tensors too.
    np.testing.assert_allclose(qkv.entropy(torch.from_numpy(w)), h)


def test_entropy_matches_qkv_heads_broad_score(gpt2):  # noqa: F811
    """`qkv heads`' broad score: the mean over rows i >= 1 of the row's entropy / ln(i + 1)."""
    model = gpt2[0]
    text = "the cat sat on the mat"
    roles = model.head_roles(text, repeat_length=6, seed=1)
    attention = model(model.tokenize(text), need_attention=True).attention
    heads = model.config["num_heads"]
    for r in roles:
        rows = qkv.entropy(attention[r["layer"]][0, r["head"]]).astype(np.float64)
        broad = np.mean([rows[i] / math.log(i + 1) for i in range(1, len(rows))])
        assert r["scores"]["broad"] == pytest.approx(broad, rel=1e-5), (r["layer"], r["head"])
    assert len(roles) == len(attention) * heads


def test_entropy_bad_input():
    with pytest.raises(qkv.Error, match="float64"):
        qkv.entropy(np.full((2, 2), 0.5))
    np.testing.assert_allclose(qkv.entropy(np.full((2, 2), 0.5), allow_cast=True), math.log(2), rtol=1e-6)
    with pytest.raises(qkv.Error, match="int"):
        qkv.entropy(np.ones((2, 2), dtype=np.int32))
    with pytest.raises(qkv.Error, match="row_entropy"):
        qkv.entropy(np.ones(3, dtype=np.float32))  # a row needs (..., Nq, Nk)
    with pytest.raises(qkv.Error, match="head_entropy"):
        qkv.head_entropy(np.ones((3, 3), dtype=np.float32))
