"""Packed variable-length batches (cu_seqlens_q / cu_seqlens_k, FlashAttention's varlen API).

- qkv.torch forward and backward (dq, dk, dv, dsinks) against a float64 PyTorch oracle written
  here that attends each sequence on its own, causal aligned to the end of each sequence's keys
  (FlashAttention's bottom-right), with empty sequences, length 1, more queries than keys, GQA,
  and the modifiers (softcap, (B, Hq) ALiBi, sinks), on each backend.
- The numpy API: the output (total_q, Hq, Dv) and lse (Hq, total_q), and its backward.
- Bad offsets and arguments are a qkv.Error naming the value.
"""
import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch

# (queries, keys) per sequence: none of either, one, more queries than keys, decode-like.
LENGTHS = [(7, 7), (0, 4), (1, 1), (3, 0), (20, 45), (1, 70), (13, 9), (0, 0), (33, 33)]
HQ, HKV, DK, DV = 4, 2, 12, 10


def packed(seed):
    g = torch.Generator().manual_seed(seed)
    cu_q = np.cumsum([0] + [n for n, _ in LENGTHS]).astype(np.int32)
    cu_k = np.cumsum([0] + [n for _, n in LENGTHS]).astype(np.int32)
    q = torch.randn(int(cu_q[-1]), HQ, DK, generator=g)
    k = torch.randn(int(cu_k[-1]), HKV, DK, generator=g)
    v = torch.randn(int(cu_k[-1]), HKV, DV, generator=g)
    return cu_q, cu_k, q, k, v


def oracle(q, k, v, cu_q, cu_k, causal, softcap=0.0, alibi=None, sinks=None):
    """float64, one sequence at a time: (total_q, Hq, Dv) output and (Hq, total_q) lse."""
    outs, lses = [], []
    scale = 1.0 / math.sqrt(q.shape[-1])
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)  # (Hq, nq, D)
        kb = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        vb = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        nq, nk = qb.shape[1], kb.shape[1]
        s = qb @ kb.transpose(-1, -2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(nq, dtype=torch.float64)[:, None]
        j = torch.arange(nk, dtype=torch.float64)[None, :]
        if alibi is not None:
            s = s - alibi[b][:, None, None] * (i + nk - nq - j).abs()
        if causal:
            s = s.masked_fill(j > i + nk - nq, -math.inf)
        if sinks is not None:
            s = torch.cat([sinks[:, None, None].expand(HQ, nq, 1), s], dim=-1)
        m = s.amax(-1, keepdim=True) if s.shape[-1] else torch.full((HQ, nq, 1), -math.inf, dtype=s.dtype)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        w = e / torch.where(total > 0, total, torch.ones_like(total))
        if sinks is not None:
            w = w[..., 1:]
        outs.append((w @ vb).transpose(0, 1))
        lses.append((m + torch.log(total)).squeeze(-1))
    return torch.cat(outs, 0), torch.cat(lses, 1)


@pytest.mark.parametrize("backend", ["auto", "reference", "flash", "decode"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("modifiers", [False, True])
def test_torch_forward_backward_against_float64_per_sequence(backend, causal, modifiers):
    cu_q, cu_k, q, k, v = packed(1 + 2 * causal + 4 * modifiers)
    g = torch.Generator().manual_seed(7)
    softcap = 3.0 if modifiers else 0.0
    alibi = torch.rand(len(LENGTHS), HQ, generator=g) * 0.5 if modifiers else None
    sinks = (torch.rand(HQ, generator=g) * 4 - 2) if modifiers else None
    grad = torch.randn(q.shape[0], HQ, DV, generator=g)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_(True) if modifiers else None
    out = qkv.torch.scaled_dot_product_attention(
        *leaves, is_causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend, softcap=softcap,
        alibi_slopes=None if alibi is None else alibi.numpy(), sinks=sink_leaf)
    (out * grad).sum().backward()

    wide = [t.double().requires_grad_(True) for t in (q, k, v)]
    wide_sinks = sinks.double().requires_grad_(True) if modifiers else None
    want, _ = oracle(*wide, cu_q, cu_k, causal, softcap, None if alibi is None else alibi.double(), wide_sinks)
    (want * grad.double()).sum().backward()

    assert out.shape == (q.shape[0], HQ, DV)
    np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), atol=2e-5, rtol=1e-4)
    for leaf, w in zip(leaves, wide):
        np.testing.assert_allclose(leaf.grad.numpy(), w.grad.numpy(), atol=5e-5, rtol=1e-4)
    if modifiers:
        np.testing.assert_allclose(sink_leaf.grad.numpy(), wide_sinks.grad.numpy(), atol=5e-5, rtol=1e-4)


def test_numpy_api_returns_flash_attention_shapes():
    cu_q, cu_k, q, k, v = packed(3)
    out, lse = qkv.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True, return_lse=True,
                                                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    want, want_lse = oracle(q.double(), k.double(), v.double(), cu_q, cu_k, True)
    assert out.shape == (q.shape[0], HQ, DV) and lse.shape == (HQ, q.shape[0])
    np.testing.assert_allclose(out, want.numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, want_lse.numpy(), atol=2e-5, rtol=1e-4)
    grad = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = qkv.scaled_dot_product_attention_backward(grad, q.numpy(), k.numpy(), v.numpy(), out, lse,
                                                           is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    # torch int32 offsets are taken as numpy's
    again = qkv.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), is_causal=True,
                                             cu_seqlens_q=torch.from_numpy(cu_q), cu_seqlens_k=torch.from_numpy(cu_k))
    np.testing.assert_array_equal(again, out)


@pytest.mark.parametrize("change, message", [
    (dict(cu_seqlens_q=np.array([0, 4, 9], np.int64)), "int32"),
    (dict(cu_seqlens_q=np.array([1, 4, 9], np.int32)), "cu_seqlens_q[0] = 1"),
    (dict(cu_seqlens_q=np.array([0, 6, 5, 9], np.int32)), "cu_seqlens_q[2] = 5 is below"),
    (dict(cu_seqlens_k=np.array([0, 4, 8], np.int32)), "cu_seqlens_k[2] = 8"),
    (dict(cu_seqlens_k=np.array([0, 9], np.int32)), "cu_seqlens_q has 3 entries but cu_seqlens_k 2"),
    (dict(cu_seqlens_k=None), "needs both"),
    (dict(key_lengths=[4, 5]), "key_lengths"),
])
def test_bad_arguments_are_named(change, message):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((9, HQ, DK), dtype=np.float32)
    k = rng.standard_normal((9, HKV, DK), dtype=np.float32)
    v = rng.standard_normal((9, HKV, DV), dtype=np.float32)
    arguments = dict(cu_seqlens_q=np.array([0, 4, 9], np.int32), cu_seqlens_k=np.array([0, 4, 9], np.int32))
    arguments.update(change)
    with pytest.raises(qkv.Error, match=message.replace("[", r"\[").replace("]", r"\]")):
        qkv.scaled_dot_product_attention(q, k, v, **arguments)


def test_four_dim_query_is_refused():
    q = np.zeros((1, 9, HQ, DK), np.float32)
    k = np.zeros((9, HKV, DK), np.float32)
    cu = np.array([0, 9], np.int32)
    with pytest.raises(qkv.Error, match=r"\(total_q, Hq, Dk\)"):
        qkv.scaled_dot_product_attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu)
