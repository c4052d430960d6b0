"""Score modifiers (softcap, ALiBi, sinks) and exact gradients under huge additive biases.

- Parity with PyTorch in float32 for additive biases -1e4, -1e9 and float32's lowest, on rows
  where the bias covers some keys and rows where it covers all of them: the forward against
  PyTorch's math path, the backward against float32 autograd through torch.softmax (which
  differentiates the weights the forward computed). The reproducer of issue 9 is among them.
- Each modifier, alone and combined, against a float64 PyTorch implementation written here
  (sinks as an extra logit column concatenated to the scores and dropped after the softmax),
  forward and backward (dsinks included), through the numpy API on each backend and qkv.torch.
- qkv.MultiHeadAttention with softcap / alibi / sinks against a float64 PyTorch re-implementation.
"""
import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch

LOWEST = float(torch.finfo(torch.float32).min)


# ---------------------------------------------------------------------------------------------
# Huge additive biases: float32 parity with PyTorch

def torch_math_f32(q, k, v, additive):
    """PyTorch's float32 math path with autograd: softmax(q k^T / sqrt(d) + additive) v."""
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1])) + additive
    return torch.softmax(scores, dim=-1) @ v


def test_issue_reproducer_bias_on_every_key_of_a_row():
    """Issue 9: row 3 carries -1e9 on all 4 keys. Its weights are 0.25 each, so with
    grad_output = 1 at (3, 0) alone, dv[:, 0] is 0.25 for every key (the old backward gave 1.0)."""
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    additive = torch.zeros(4, 4)
    additive[3] = -1e9
    grad = torch.zeros(1, 1, 4, 8)
    grad[0, 0, 3, 0] = 1.0
    out, lse, row_max, row_sum = qkv.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), attn_mask=additive.numpy(), return_lse=True, return_row_stats=True)
    dq, dk, dv, _ = qkv.scaled_dot_product_attention_backward(grad.numpy(), q.numpy(), k.numpy(), v.numpy(), out,
                                                              lse, attn_mask=additive.numpy(), row_max=row_max,
                                                              row_sum=row_sum)
    np.testing.assert_allclose(dv[0, 0, :, 0], [0.25] * 4, rtol=1e-6)
    np.testing.assert_array_equal(dv[0, 0, :, 1:], 0.0)
    # The same through the autograd Function, which keeps the row statistics itself.
    vt = v.clone().requires_grad_()
    (qkv.torch.scaled_dot_product_attention(q, k, vt, attn_mask=additive) * grad).sum().backward()
    np.testing.assert_allclose(vt.grad[0, 0, :, 0].numpy(), [0.25] * 4, rtol=1e-6)


@pytest.mark.parametrize("bias", [-1e4, -1e9, LOWEST], ids=["-1e4", "-1e9", "lowest"])
@pytest.mark.parametrize("backend", ["auto", "reference", "flash"])
def test_huge_biases_match_float32_autograd(rng, bias, backend):
    """Rows 1 and 4 carry the bias on some keys, rows 2 and 5 on all of them (and row 5 of head 1
    on all but one), over two heads and a batch of two; Nq != Nk."""
    b, h, nq, nk, d = 2, 2, 6, 7, 16
    q = torch.from_numpy(rng.standard_normal((b, h, nq, d), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((b, h, nk, d), dtype=np.float32))
    v = torch.from_numpy(rng.standard_normal((b, h, nk, d), dtype=np.float32))
    additive = np.zeros((1, h, nq, nk), np.float32)
    additive[:, :, 1, [0, 3, 4]] = bias
    additive[:, :, 4, 1:] = bias
    additive[:, :, 2, :] = bias
    additive[:, :, 5, :] = bias
    additive[:, 1, 5, 6] = 0.0
    grad = torch.from_numpy(rng.standard_normal((b, h, nq, d), dtype=np.float32))

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = torch_math_f32(*leaves, torch.from_numpy(additive))
    (expected * grad).sum().backward()
    expected_grads = [x.grad.numpy() for x in leaves]

    out, lse, row_max, row_sum = qkv.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), attn_mask=additive, backend=backend, return_lse=True,
        return_row_stats=True)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-4, atol=1e-4)
    grads = qkv.scaled_dot_product_attention_backward(grad.numpy(), q.numpy(), k.numpy(), v.numpy(), out, lse,
                                                      attn_mask=additive, backend=backend, row_max=row_max,
                                                      row_sum=row_sum)
    for name, got, want in zip("qkv", grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"d{name}")
    # Every row's weights sum to 1, so the keys' dv add up to the queries' grad_output (the old
    # backward's rows under the bias on every key summed to Nk).
    np.testing.assert_allclose(grads[2].sum(axis=2), grad.numpy().sum(axis=2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias", [-1e4, -1e9, LOWEST], ids=["-1e4", "-1e9", "lowest"])
def test_huge_biases_through_qkv_torch(rng, bias):
    """The autograd Function against float32 autograd through torch.softmax, GQA included."""
    q = torch.from_numpy(rng.standard_normal((1, 4, 5, 8), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((1, 2, 5, 8), dtype=np.float32))
    v = torch.from_numpy(rng.standard_normal((1, 2, 5, 8), dtype=np.float32))
    additive = torch.zeros(5, 5)
    additive[0, :] = bias
    additive[3, [1, 2]] = bias
    grad = torch.from_numpy(rng.standard_normal((1, 4, 5, 8), dtype=np.float32))

    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    out = qkv.torch.scaled_dot_product_attention(*ours, attn_mask=additive, enable_gqa=True)
    (out * grad).sum().backward()
    theirs = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = torch_math_f32(theirs[0], theirs[1].repeat_interleave(2, 1), theirs[2].repeat_interleave(2, 1),
                              additive)
    (expected * grad).sum().backward()
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), rtol=1e-4, atol=1e-4)
    for name, a, b in zip("qkv", ours, theirs):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-3, atol=1e-4, err_msg=f"d{name}")


# ---------------------------------------------------------------------------------------------
# Score modifiers against a float64 implementation

def modified_attention(q, k, v, scale=None, softcap=0.0, alibi_slopes=None, sinks=None, keep=None, additive=None):
    """float64 attention with the score modifiers, as the issue defines them, in this order:
    scale, softcap (c tanh(s / c)), ALiBi (- slope[h] |i + Nk - Nq - j|), the mask (additive terms
    add, keep=False hides), then the softmax with the sink as an extra logit column that is
    dropped afterwards. q (B, Hq, Nq, Dk), k (B, Hkv, Nk, Dk), v (B, Hkv, Nk, Dv) torch tensors."""
    hq, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != hq:
        k, v = k.repeat_interleave(hq // k.shape[1], 1), v.repeat_interleave(hq // k.shape[1], 1)
    s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        distance = (torch.arange(nq)[:, None] + nk - nq - torch.arange(nk)[None, :]).abs().to(s.dtype)
        rows = alibi_slopes.shape[0] if alibi_slopes.dim() == 2 else 1  # (B, Hq) or (Hq)
        s = s - alibi_slopes.view(rows, hq, 1, 1) * distance
    if additive is not None:
        s = s + additive
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1) @ v
    column = sinks.view(1, hq, 1, 1).expand(s.shape[0], hq, nq, 1)
    weights = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    return weights @ v


MODIFIERS = {
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all": dict(softcap=3.0, alibi=True, sinks=True),
    "alibi (B, Hq)": dict(alibi="per batch"),
    "all, alibi (B, Hq)": dict(softcap=3.0, alibi="per batch", sinks=True),
}


def make_case(rng, b, hq, hkv, nq, nk, dk, dv, modifiers):
    """Random float32 inputs, (Hq) or (B, Hq) slopes and (Hq) sinks, float64 leaves for the oracle."""
    def randn(*shape, s=1.0):
        return (s * rng.standard_normal(shape)).astype(np.float32)
    # Scores scaled up so that softcap 2 bites (|s| reaches several times the cap).
    case = dict(q=randn(b, hq, nq, dk, s=2.0), k=randn(b, hkv, nk, dk, s=2.0), v=randn(b, hkv, nk, dv),
                grad=randn(b, hq, nq, dv))
    case["softcap"] = modifiers.get("softcap", 0.0)
    case["alibi_slopes"] = (np.exp2(-8.0 * np.arange(1, hq + 1) / hq).astype(np.float32)
                            if modifiers.get("alibi") else None)
    if modifiers.get("alibi") == "per batch":  # a row per batch element: FlashAttention's (B, H)
        case["alibi_slopes"] = rng.uniform(0.0, 0.5, (b, hq)).astype(np.float32)
    case["sinks"] = randn(hq, s=1.5) if modifiers.get("sinks") else None
    return case


def oracle(case, keep=None, additive=None):
    """Output and gradients (dq, dk, dv, dsinks or None) in float64 by autograd."""
    leaves = {name: torch.from_numpy(case[name].astype(np.float64)).requires_grad_() for name in ("q", "k", "v")}
    sinks = (None if case["sinks"] is None
             else torch.from_numpy(case["sinks"].astype(np.float64)).requires_grad_())
    slopes = None if case["alibi_slopes"] is None else torch.from_numpy(case["alibi_slopes"].astype(np.float64))
    out = modified_attention(leaves["q"], leaves["k"], leaves["v"], softcap=case["softcap"], alibi_slopes=slopes,
                             sinks=sinks, keep=keep, additive=additive)
    (out * torch.from_numpy(case["grad"].astype(np.float64))).sum().backward()
    grads = [leaves[n].grad.numpy() for n in ("q", "k", "v")] + [None if sinks is None else sinks.grad.numpy()]
    return out.detach().numpy(), grads


def assert_close(got, want, name, tol=2e-4):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=name)


@pytest.mark.parametrize("modifiers", list(MODIFIERS), ids=list(MODIFIERS))
@pytest.mark.parametrize("backend", ["reference", "flash"])
@pytest.mark.parametrize("mask", ["none", "causal", "additive"])
def test_modifiers_numpy_api(rng, modifiers, backend, mask):
    """GQA, Nq != Nk, Dk != Dv, every modifier; forward and backward (dsinks included)."""
    case = make_case(rng, 2, 4, 2, 5, 9, 16, 8, MODIFIERS[modifiers])
    kwargs = dict(softcap=case["softcap"], alibi_slopes=case["alibi_slopes"], sinks=case["sinks"])
    keep = additive = None
    if mask == "causal":
        keep = torch.ones(5, 9, dtype=torch.bool).tril()
        kwargs["is_causal"] = True
    elif mask == "additive":
        additive_np = rng.standard_normal((5, 9)).astype(np.float32)
        additive_np[2, :4] = -np.inf  # some keys hidden (huge finite biases: the float32 parity tests)
        additive = torch.from_numpy(additive_np.astype(np.float64))
        kwargs["attn_mask"] = additive_np
    want_out, want_grads = oracle(case, keep=keep, additive=additive)

    out, lse, row_max, row_sum = qkv.scaled_dot_product_attention(
        case["q"], case["k"], case["v"], enable_gqa=True, backend=backend, return_lse=True, return_row_stats=True,
        **kwargs)
    assert_close(out, want_out, "output")
    grads = qkv.scaled_dot_product_attention_backward(case["grad"], case["q"], case["k"], case["v"], out, lse,
                                                      enable_gqa=True, backend=backend, row_max=row_max,
                                                      row_sum=row_sum, **kwargs)
    # dsinks with sinks, then dbias with a float attn_mask (tests/python/test_dbias.py checks it).
    assert len(grads) == 3 + (case["sinks"] is not None) + (mask == "additive")
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads[:len(grads) - (mask == "additive")], want_grads):
        assert got.shape == want.shape, name
        assert_close(got, want, name)


@pytest.mark.parametrize("modifiers", list(MODIFIERS), ids=list(MODIFIERS))
def test_modifiers_decode(rng, modifiers):
    """Few queries over many keys (Backend Auto picks Decode), queries aligned to the end of the keys."""
    case = make_case(rng, 1, 4, 4, 2, 300, 32, 32, MODIFIERS[modifiers])
    want_out, _ = oracle(case)
    for backend in ("auto", "decode"):
        out = qkv.scaled_dot_product_attention(case["q"], case["k"], case["v"], backend=backend,
                                               softcap=case["softcap"], alibi_slopes=case["alibi_slopes"],
                                               sinks=case["sinks"])
        assert_close(out, want_out, f"output ({backend})")


def test_sink_on_a_row_that_sees_no_key(rng):
    """A row that sees no key gives zeros, lse = the sink, and no gradient."""
    case = make_case(rng, 1, 2, 2, 3, 4, 8, 8, dict(sinks=True))
    keep = np.ones((3, 4), bool)
    keep[1] = False
    out, lse = qkv.scaled_dot_product_attention(case["q"], case["k"], case["v"], attn_mask=keep, sinks=case["sinks"],
                                                return_lse=True)
    np.testing.assert_array_equal(out[:, :, 1], 0.0)
    np.testing.assert_allclose(lse[0, :, 1], case["sinks"], rtol=1e-6)
    want_out, want_grads = oracle(case, keep=torch.from_numpy(keep))
    assert_close(out, want_out, "output")
    grads = qkv.scaled_dot_product_attention_backward(case["grad"], case["q"], case["k"], case["v"], out, lse,
                                                      attn_mask=keep, sinks=case["sinks"])
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert_close(got, want, name)


@pytest.mark.parametrize("modifiers", list(MODIFIERS), ids=list(MODIFIERS))
def test_modifiers_through_qkv_torch(rng, modifiers):
    """The autograd Function: sinks is a leaf that gets its gradient; alibi_slopes does not."""
    case = make_case(rng, 2, 4, 2, 6, 6, 8, 8, MODIFIERS[modifiers])
    want_out, want_grads = oracle(case, keep=torch.ones(6, 6, dtype=torch.bool).tril())
    leaves = [torch.from_numpy(case[n]).requires_grad_() for n in ("q", "k", "v")]
    sinks = None if case["sinks"] is None else torch.from_numpy(case["sinks"]).requires_grad_()
    out = qkv.torch.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True, softcap=case["softcap"],
                                                 alibi_slopes=case["alibi_slopes"], sinks=sinks)
    (out * torch.from_numpy(case["grad"])).sum().backward()
    assert_close(out.detach().numpy(), want_out, "output")
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, want_grads):
        assert_close(leaf.grad.numpy(), want, name)
    if sinks is not None:
        assert_close(sinks.grad.numpy(), want_grads[3], "dsinks")


# ---------------------------------------------------------------------------------------------
# MultiHeadAttention with the modifiers

def torch_mha(params, x, heads, kv_heads, causal, softcap, alibi, sinks):
    """float64 re-implementation of qkv.MultiHeadAttention's self-attention forward."""
    b, n, e = x.shape
    hd = e // heads

    def project(name, t, h):
        y = t @ params[f"{name}.weight"].T + params[f"{name}.bias"]
        return y.view(b, n, h, hd).transpose(1, 2)

    q, k, v = project("q_proj", x, heads), project("k_proj", x, kv_heads), project("v_proj", x, kv_heads)
    slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads) if alibi else None
    keep = torch.ones(n, n, dtype=torch.bool).tril() if causal else None
    attended = modified_attention(q, k, v, softcap=softcap, alibi_slopes=slopes,
                                  sinks=params["sinks"] if sinks else None, keep=keep)
    concatenated = attended.transpose(1, 2).reshape(b, n, e)
    return concatenated @ params["out_proj.weight"].T + params["out_proj.bias"]


@pytest.mark.parametrize("modifiers", list(MODIFIERS), ids=list(MODIFIERS))
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_multi_head_attention_modifiers(rng, modifiers, kv_heads):
    options = MODIFIERS[modifiers]
    e, heads, b, n = 32, 4, 2, 7
    ours = qkv.MultiHeadAttention(e, heads, num_kv_heads=kv_heads, softcap=options.get("softcap", 0.0),
                                  alibi=bool(options.get("alibi")), sinks=options.get("sinks", False),
                                  seed=int(rng.integers(1 << 31)))
    params = ours.parameters()
    assert ("sinks" in params) == bool(options.get("sinks"))
    for name, p in params.items():  # random biases and sinks too, so zeros hide nothing
        p[...] = 0.3 * rng.standard_normal(p.shape)
    x = (2.0 * rng.standard_normal((b, n, e))).astype(np.float32)
    grad = rng.standard_normal((b, n, e)).astype(np.float32)

    leaves = {name: torch.from_numpy(p.astype(np.float64)).requires_grad_() for name, p in params.items()}
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    expected = torch_mha(leaves, tx, heads, kv_heads, True, options.get("softcap", 0.0), bool(options.get("alibi")),
                         options.get("sinks", False))
    (expected * torch.from_numpy(grad.astype(np.float64))).sum().backward()

    ours.zero_grad()
    out, _ = ours(x, is_causal=True)
    assert_close(out, expected.detach().numpy(), "output")
    dx = ours.backward(grad)
    assert_close(dx, tx.grad.numpy(), "dx")
    for name, g in ours.grads().items():
        assert_close(g, leaves[name].grad.numpy(), name)
    # The sinks travel with the state dict.
    if options.get("sinks"):
        state = ours.state_dict()
        np.testing.assert_array_equal(state["sinks"], params["sinks"])
        fresh = qkv.MultiHeadAttention(e, heads, num_kv_heads=kv_heads, sinks=True,
                                       softcap=options.get("softcap", 0.0), alibi=options.get("alibi", False))
        if kv_heads == heads:
            fresh.load_state_dict(state)
            np.testing.assert_array_equal(fresh(x, is_causal=True)[0], out)


def test_multi_head_attention_sinks_start_at_zero():
    mha = qkv.MultiHeadAttention(16, 4, sinks=True, seed=3)
    np.testing.assert_array_equal(mha.parameters()["sinks"], np.zeros(4, np.float32))
