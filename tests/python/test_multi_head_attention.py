"""qkv.MultiHeadAttention against torch.nn.MultiheadAttention with identical weights (forward).

PyTorch runs in float64 (the module converted with .double()), qkv in float32; PyTorch keeps
grad mode on so that it takes its general path, not the inference fast path.
"""
import numpy as np
import pytest
import torch

import qkv

E, H, B, NQ, NK = 16, 4, 2, 5, 7
TOL = dict(rtol=1e-4, atol=2e-5)


def pair(rng, embed_dim=E, num_heads=H, batch_first=True, **kwargs):
    """A torch module in float64 with random weights (biases too), and qkv's copy of it."""
    torch.manual_seed(int(rng.integers(2**31)))
    theirs = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first, **kwargs).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours = qkv.MultiHeadAttention(embed_dim, num_heads, batch_first=batch_first, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def run_torch(module, *inputs, **kwargs):
    out, weights = module(*(torch.from_numpy(np.asarray(x, np.float64)) for x in inputs),
                          **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()})
    return out.detach().numpy(), None if weights is None else weights.detach().numpy()


def randn(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
def test_self_attention_with_weights(rng, average):
    theirs, ours = pair(rng)
    x = randn(rng, B, NQ, E)
    expected, expected_weights = run_torch(theirs, x, x, x, need_weights=True, average_attn_weights=average)
    out, weights = ours(x, need_weights=True, average_attn_weights=average)
    np.testing.assert_allclose(out, expected, **TOL)
    assert weights.shape == ((B, NQ, NQ) if average else (B, H, NQ, NQ))
    np.testing.assert_allclose(weights, expected_weights, **TOL)
    out_fast, none = ours(x, x, x)  # need_weights=False: the flash kernel, no weights
    assert none is None
    np.testing.assert_allclose(out_fast, expected, **TOL)


def test_cross_attention_key_padding_mask(rng):
    theirs, ours = pair(rng)
    query, memory = randn(rng, B, NQ, E), randn(rng, B, NK, E)
    padding = np.zeros((B, NK), dtype=bool)  # True = padding, ignored (PyTorch's convention)
    padding[1, 4:] = True
    expected, expected_weights = run_torch(theirs, query, memory, memory, key_padding_mask=padding,
                                           need_weights=True)
    out, weights = ours(query, memory, memory, key_padding_mask=padding, need_weights=True)
    np.testing.assert_allclose(out, expected, **TOL)
    np.testing.assert_allclose(weights, expected_weights, **TOL)
    assert (weights[1, :, 4:] == 0).all()


@pytest.mark.parametrize("kind", ["bool_2d", "float_2d", "bool_3d", "float_3d"])
def test_attn_mask(rng, kind):
    theirs, ours = pair(rng)
    query, memory = randn(rng, B, NQ, E), randn(rng, B, NK, E)
    shape = (NQ, NK) if kind.endswith("2d") else (B * H, NQ, NK)
    masked = rng.random(shape) < 0.4  # True = masked (PyTorch's nn.MultiheadAttention convention)
    masked[..., 0] = False
    if kind.startswith("bool"):
        attn_mask = masked
    else:
        attn_mask = np.where(masked, -np.inf, rng.standard_normal(shape))
    expected, expected_weights = run_torch(theirs, query, memory, memory, attn_mask=attn_mask, need_weights=True,
                                           average_attn_weights=False)
    out, weights = ours(query, memory, memory, attn_mask=attn_mask, need_weights=True, average_attn_weights=False)
    np.testing.assert_allclose(out, expected, **TOL)
    np.testing.assert_allclose(weights, expected_weights, **TOL)


def test_padding_and_attn_mask_together(rng):
    theirs, ours = pair(rng)
    x = randn(rng, B, NK, E)
    causal_masked = np.triu(np.ones((NK, NK), dtype=bool), k=1)
    padding = np.zeros((B, NK), dtype=bool)
    padding[0, 5:] = True
    expected, _ = run_torch(theirs, x, x, x, key_padding_mask=padding, attn_mask=causal_masked)
    out, _ = ours(x, key_padding_mask=padding, attn_mask=causal_masked)
    np.testing.assert_allclose(out, expected, **TOL)
    # is_causal on its own gives the same as the explicit causal attn_mask
    expected_causal, _ = run_torch(theirs, x, x, x, attn_mask=causal_masked)
    np.testing.assert_allclose(ours(x, is_causal=True)[0], expected_causal, **TOL)


def test_kdim_vdim_without_bias(rng):
    theirs, ours = pair(rng, bias=False, kdim=6, vdim=10)
    assert "q_proj_weight" in theirs.state_dict()
    query, key, value = randn(rng, B, NQ, E), randn(rng, B, NK, 6), randn(rng, B, NK, 10)
    expected, expected_weights = run_torch(theirs, query, key, value, need_weights=True)
    out, weights = ours(query, key, value, need_weights=True)
    np.testing.assert_allclose(out, expected, **TOL)
    np.testing.assert_allclose(weights, expected_weights, **TOL)


def test_sequence_first_and_unbatched(rng):
    theirs, ours = pair(rng, batch_first=False)
    query, memory = randn(rng, NQ, B, E), randn(rng, NK, B, E)  # (N, B, E)
    expected, _ = run_torch(theirs, query, memory, memory)
    out, _ = ours(query, memory, memory)
    assert out.shape == (NQ, B, E)
    np.testing.assert_allclose(out, expected, **TOL)
    single = query[:, 0]  # unbatched (N, E)
    expected, expected_weights = run_torch(theirs, single, single, single, need_weights=True)
    out, weights = ours(single, need_weights=True)
    np.testing.assert_allclose(out, expected, **TOL)
    np.testing.assert_allclose(weights, expected_weights, **TOL)


def test_fully_masked_rows(rng):
    # Every key of batch 1 is padding. qkv: the attention output is zeros, so the module gives
    # out_proj.bias there and weights of zeros; PyTorch 1.13 gives NaN.
    theirs, ours = pair(rng)
    x = randn(rng, B, NQ, E)
    padding = np.zeros((B, NQ), dtype=bool)
    padding[1] = True
    expected, expected_weights = run_torch(theirs, x, x, x, key_padding_mask=padding, need_weights=True)
    out, weights = ours(x, key_padding_mask=padding, need_weights=True)
    assert np.isnan(expected[1]).all() and np.isnan(expected_weights[1]).all()
    np.testing.assert_allclose(out[1], np.broadcast_to(ours.parameters()["out_proj.bias"], (NQ, E)), **TOL)
    assert (weights[1] == 0).all()
    np.testing.assert_allclose(out[0], expected[0], **TOL)


def test_grouped_query_module_matches_repeated_heads(rng):
    # No PyTorch module has GQA: compare with qkv's own full-head module whose k/v projections
    # repeat each kv head's rows.
    gqa = qkv.MultiHeadAttention(E, H, num_kv_heads=2)
    full = qkv.MultiHeadAttention(E, H)
    p = {name: a.copy() for name, a in gqa.parameters().items()}
    hd = E // H
    for n in "kv":
        w, b = p[f"{n}_proj.weight"].reshape(2, hd, E), p[f"{n}_proj.bias"].reshape(2, hd)
        p[f"{n}_proj.weight"] = np.repeat(w, 2, axis=0).reshape(E, E)
        p[f"{n}_proj.bias"] = np.repeat(b, 2, axis=0).reshape(E)
    full.load_state_dict(p)
    x = randn(rng, B, NQ, E)
    np.testing.assert_allclose(gqa(x)[0], full(x)[0], rtol=1e-5, atol=1e-6)


def test_parameters_are_views_and_state_dict_round_trips(rng):
    theirs, ours = pair(rng)
    params = ours.parameters()
    assert list(params) == ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
                            "v_proj.bias", "out_proj.weight", "out_proj.bias"]
    for name, value in theirs.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[name], value.numpy(), rtol=1e-6)
    params["out_proj.bias"][:] = 0  # a view: writing changes the module
    assert (ours.parameters()["out_proj.bias"] == 0).all()
    back = torch.nn.MultiheadAttention(E, H, batch_first=True)
    back.load_state_dict({k: torch.from_numpy(v) for k, v in ours.state_dict().items()})


def test_dropout_only_while_training(rng):
    ours = qkv.MultiHeadAttention(E, H, dropout=0.5)
    x = randn(rng, B, NQ, E)
    assert ours.training
    first, second = ours(x)[0], ours(x)[0]
    assert not np.allclose(first, second)  # fresh dropout decisions each call
    ours.eval()
    np.testing.assert_array_equal(ours(x)[0], ours(x)[0])


def test_seeds_as_torch():
    x = np.ones((1, 3, E), np.float32)
    same = [qkv.MultiHeadAttention(E, H, seed=5).parameters()["q_proj.weight"] for _ in range(2)]
    np.testing.assert_array_equal(*same)
    qkv.manual_seed(1)
    first = [qkv.MultiHeadAttention(E, H)(x)[0] for _ in range(2)]
    assert not np.allclose(*first)  # two unseeded modules start different, as in torch
    qkv.manual_seed(1)
    again = [qkv.MultiHeadAttention(E, H)(x)[0] for _ in range(2)]
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])


@pytest.mark.parametrize("nq, nk, batch", [(0, 0, B), (0, NK, B), (NQ, 0, B), (NQ, NK, 0)],
                         ids=["no_queries_no_keys", "no_queries", "no_keys", "empty_batch"])
def test_empty_sequences_as_torch(rng, nq, nk, batch):
    # PyTorch returns empty outputs for no queries, and out_proj(0) = its bias for no keys; the
    # gradients then are empty or zeros. (It used to be "overlapping elements" in the kernel's check.)
    theirs, ours = pair(rng)
    q, kv = randn(rng, batch, nq, E), randn(rng, batch, nk, E)
    expected, expected_weights = run_torch(theirs, q, kv, kv, need_weights=True)
    out, weights = ours(q, kv, kv, need_weights=True)
    assert out.shape == expected.shape and weights.shape == expected_weights.shape
    np.testing.assert_allclose(out, expected, **TOL)
    tq, tkv = (torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, kv))
    theirs(tq, tkv, tkv)[0].sum().backward()
    dq, dk, dv = ours.backward(np.ones_like(out))
    np.testing.assert_allclose(dq, tq.grad.numpy(), **TOL)
    np.testing.assert_allclose(dk + dv, tkv.grad.numpy(), **TOL)
    if nq == nk:
        dx = ours.backward(np.ones_like(ours(q)[0]))  # self-attention: the fused projection
        assert dx.shape == q.shape
