"""Shared-prefix (cascade) attention, qkv.cascade_attention.

- Against a numpy float64 oracle written here that attends each sequence to its own
  concat(prefix, suffix[:length]) (causal bottom-right: the queries are the sequence's last
  positions), with suffix lengths 0, 1, ragged and full, prefixes of 0, 1 and many keys, GQA,
  several queries, softcap and sinks, float32 and 16-bit K/V, numpy and torch inputs.
- Against scaled_dot_product_attention over each sequence's concatenated keys.
- Bad shapes, lengths and options are a qkv.Error naming them.
"""
import math

import numpy as np
import pytest
import torch

import qkv


def oracle(q, pk, pv, sk, sv, lengths, causal, scale, softcap=0.0, sinks=None):
    """float64: (B, Hq, Nq, Dv) output and (B, Hq, Nq) lse, one sequence and head at a time."""
    q, pk, pv, sk, sv = (np.asarray(x, dtype=np.float64) for x in (q, pk, pv, sk, sv))
    batch, hq, nq, _ = q.shape
    group = hq // pk.shape[1]
    out = np.zeros((batch, hq, nq, pv.shape[-1]))
    lse = np.full((batch, hq, nq), -np.inf)
    for b in range(batch):
        k = np.concatenate([pk[0], sk[b, :, :lengths[b]]], axis=1)  # (Hkv, Np + L, Dk)
        v = np.concatenate([pv[0], sv[b, :, :lengths[b]]], axis=1)
        keys = k.shape[1]
        for h in range(hq):
            s = q[b, h] @ k[h // group].T * scale  # (Nq, keys)
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if causal:
                visible = np.arange(keys)[None, :] <= (keys - nq + np.arange(nq))[:, None]
                s = np.where(visible, s, -np.inf)
            if sinks is not None:
                s = np.concatenate([s, np.full((nq, 1), float(sinks[h]))], axis=1)
            m = s.max(axis=1, keepdims=True)
            seen = np.isfinite(m[:, 0])
            e = np.exp(s - np.where(np.isfinite(m), m, 0))
            total = e.sum(axis=1)
            w = e[:, :keys] / np.where(seen, total, 1)[:, None]
            out[b, h] = np.where(seen[:, None], w @ v[h // group], 0)
            lse[b, h] = np.where(seen, m[:, 0] + np.log(np.where(seen, total, 1)), -np.inf)
    return out, lse


def inputs(seed, batch, hq, hkv, nq, np_, ns, dk, dv):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return f(batch, hq, nq, dk), f(1, hkv, np_, dk), f(1, hkv, np_, dv), f(batch, hkv, ns, dk), f(batch, hkv, ns, dv)


CASES = [
    # batch, Hq, Hkv, Nq, Np, Ns, Dk, Dv, lengths, causal, modifiers
    (3, 6, 2, 1, 37, 21, 13, 11, [21, 0, 1], False, False),
    (3, 6, 2, 1, 37, 21, 13, 11, [0, 1, 20], False, True),
    (2, 4, 4, 1, 0, 9, 16, 16, [9, 4], False, False),
    (4, 2, 1, 1, 1, 5, 7, 9, [0, 1, 5, 3], False, True),
    (2, 3, 3, 1, 70, 0, 8, 8, None, False, True),
    (2, 4, 2, 1, 700, 33, 32, 24, None, False, False),
    (3, 4, 2, 3, 29, 8, 13, 11, [8, 2, 5], True, True),
    (2, 4, 2, 4, 29, 6, 12, 12, None, True, False),
    (2, 2, 2, 3, 17, 7, 9, 9, [0, 7], False, False),
    (5, 4, 1, 20, 130, 40, 16, 16, [19, 40, 25, 33, 20], True, False),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{n}" for n in range(len(CASES))])
def test_matches_the_float64_oracle(case):
    batch, hq, hkv, nq, np_, ns, dk, dv, lengths, causal, modifiers = case
    q, pk, pv, sk, sv = inputs(len(case) * 1000 + nq * 31 + np_, batch, hq, hkv, nq, np_, ns, dk, dv)
    scale = 0.3
    extra = dict(softcap=3.0, sinks=np.linspace(-1, 2, hq).astype(np.float32)) if modifiers else {}
    out, lse = qkv.cascade_attention(q, pk, pv, sk, sv, suffix_lengths=lengths, is_causal=causal, scale=scale,
                                     return_lse=True, **extra)
    want_out, want_lse = oracle(q, pk, pv, sk, sv, lengths or [ns] * batch, causal, scale,
                                extra.get("softcap", 0.0), extra.get("sinks"))
    assert out.shape == (batch, hq, nq, dv) and lse.shape == (batch, hq, nq)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


def test_equals_attention_over_each_sequences_concatenated_keys():
    batch, hq, hkv, np_, ns, d = 4, 8, 2, 300, 50, 64
    q, pk, pv, sk, sv = inputs(7, batch, hq, hkv, 1, np_, ns, d, d)
    lengths = [50, 0, 1, 31]
    out = qkv.cascade_attention(q, pk, pv, sk, sv, suffix_lengths=lengths)
    for b in range(batch):
        k = np.concatenate([pk, sk[b:b + 1, :, :lengths[b]]], axis=2)
        v = np.concatenate([pv, sv[b:b + 1, :, :lengths[b]]], axis=2)
        alone = qkv.scaled_dot_product_attention(q[b:b + 1], k, v, enable_gqa=True)
        np.testing.assert_allclose(out[b:b + 1], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_inputs_and_16_bit_kv(dtype):
    batch, hq, hkv, np_, ns, d = 3, 4, 2, 90, 20, 32
    q, pk, pv, sk, sv = inputs(11, batch, hq, hkv, 1, np_, ns, d, d)
    half = [torch.from_numpy(x).to(dtype) for x in (pk, pv, sk, sv)]
    lengths = torch.tensor([20, 3, 0])
    out = qkv.cascade_attention(torch.from_numpy(q), *half, suffix_lengths=lengths)
    rounded = [x.float().numpy() for x in half]  # the values qkv reads
    want, _ = oracle(q, *rounded, lengths.tolist(), False, 1 / math.sqrt(d))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # a float32 prefix with a 16-bit suffix: each level has its own dtype
    mixed = qkv.cascade_attention(q, pk, pv, *half[2:], suffix_lengths=lengths)
    want, _ = oracle(q, pk, pv, *rounded[2:], lengths.tolist(), False, 1 / math.sqrt(d))
    np.testing.assert_allclose(mixed, want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_errors_naming_them():
    q, pk, pv, sk, sv = inputs(3, 2, 4, 2, 1, 5, 3, 8, 8)
    with pytest.raises(qkv.Error, match=r"key_lengths\[1\] = 4 is outside \[0, Ns = 3\]"):
        qkv.cascade_attention(q, pk, pv, sk, sv, suffix_lengths=[3, 4])
    with pytest.raises(qkv.Error, match=r"the prefix must be one copy"):
        qkv.cascade_attention(q, np.concatenate([pk, pk]), np.concatenate([pv, pv]), sk, sv)
    with pytest.raises(qkv.Error, match=r"alibi_slopes"):
        qkv.cascade_attention(q, pk, pv, sk, sv, alibi_slopes=np.ones(4, np.float32))
    with pytest.raises(qkv.Error, match=r"dropout_p"):
        qkv.cascade_attention(q, pk, pv, sk, sv, dropout_p=0.1)
    with pytest.raises(qkv.Error, match=r"suffix_key is float16 but suffix_value is float32"):
        qkv.cascade_attention(q, pk, pv, sk.astype(np.float16), sv)
    with pytest.raises(qkv.Error, match=r"unexpected keyword"):
        qkv.cascade_attention(q, pk, pv, sk, sv, window=3)
    with pytest.raises(qkv.Error, match=r"query is float64"):
        qkv.cascade_attention(q.astype(np.float64), pk, pv, sk, sv)

