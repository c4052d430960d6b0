"""Score and mask functions as text (score_mod, mask_mod, mod_inputs): forward and backward
against the same functions written in float64 PyTorch with autograd, through the numpy API and
qkv.torch; and the errors a bad function gets."""
import numpy as np
import pytest
import torch

import qkv
import qkv.torch

B, HQ, HKV, NQ, NK, D = 2, 4, 2, 7, 11, 8

# Each case: the function as qkv text, its float64 torch twin s' = f(s, q, k, b, h, inputs).
SCORE_FUNCTIONS = {
    "relative": ("s - 0.1 * abs(q - k)", lambda s, q, k, b, h, x: s - 0.1 * (q - k).abs()),
    "tanh_bias": ("s + 0.5 * tanh(s) - bias(k)", lambda s, q, k, b, h, x: s + 0.5 * torch.tanh(s) - x["bias"][b, k]),
    "where_max": ("where(k <= q + 3, s, s / 2) + max(s, -1)",
                  lambda s, q, k, b, h, x: torch.where(k <= q + 3, s, s / 2) + torch.clamp(s, min=-1)),
    "per_head": ("s * scale(h) + exp(-abs(s))", lambda s, q, k, b, h, x: s * x["scale"][h] + torch.exp(-s.abs())),
}


def inputs_for(rng):
    return {"bias": rng.standard_normal((B, NK)).astype(np.float32),
            "scale": rng.uniform(0.5, 1.5, HQ).astype(np.float32),
            "doc": np.repeat(np.arange(4), 3)[:NK].astype(np.float32)}


def twin_attention(q, k, v, function, inputs, keep=None):
    """float64 attention with the score function applied to the scaled scores, keys grouped."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    s = q @ k.transpose(-2, -1) / np.sqrt(D)
    shape = s.shape
    qi = torch.arange(shape[2], dtype=torch.float64).view(1, 1, -1, 1).expand(shape)
    kj = torch.arange(shape[3], dtype=torch.float64).view(1, 1, 1, -1).expand(shape)
    b = torch.arange(shape[0]).view(-1, 1, 1, 1).expand(shape)
    h = torch.arange(shape[1]).view(1, -1, 1, 1).expand(shape)
    x = {name: torch.from_numpy(value.astype(np.float64)) for name, value in inputs.items()}
    s = function(s, qi, kj.long(), b, h, x) if function is not None else s
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def close(got, want, name, tol=2e-4):
    want = want.detach().numpy() if hasattr(want, "detach") else want
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())), err_msg=name)


def twin_case(rng, text, function, keep=None):
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               ((B, HQ, NQ, D), (B, HKV, NK, D), (B, HKV, NK, D)))
    grad = rng.standard_normal((B, HQ, NQ, D)).astype(np.float32)
    inputs = inputs_for(rng)
    leaves = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (q, k, v)]
    want = twin_attention(*leaves, function, inputs, keep)
    (want * torch.from_numpy(grad.astype(np.float64))).sum().backward()
    return q, k, v, grad, inputs, want, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("backend", ["auto", "flash", "reference"])
@pytest.mark.parametrize("case", list(SCORE_FUNCTIONS), ids=list(SCORE_FUNCTIONS))
def test_score_functions_match_torch_autograd(rng, case, backend):
    text, function = SCORE_FUNCTIONS[case]
    q, k, v, grad, inputs, want, want_grads = twin_case(rng, text, function)
    kwargs = dict(enable_gqa=True, score_mod=text, mod_inputs=inputs, backend=backend)
    out, lse, row_max, row_sum = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, return_row_stats=True,
                                                                  **kwargs)
    close(out, want, "output")
    grads = qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, row_max=row_max, row_sum=row_sum,
                                                      **kwargs)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
        close(got, expected, name)


def test_score_and_mask_functions_through_qkv_torch(rng):
    text, function = SCORE_FUNCTIONS["tanh_bias"]
    inputs = inputs_for(rng)
    doc = torch.from_numpy(inputs["doc"])
    keep = (doc[:NQ].view(-1, 1) == doc.view(1, -1)) & (torch.arange(NK).view(1, -1) <= torch.arange(NQ).view(-1, 1) + 4)
    q, k, v, grad, inputs, want, want_grads = twin_case(rng, text, function, keep=keep)
    leaves = [torch.from_numpy(a).requires_grad_() for a in (q, k, v)]
    out = qkv.torch.scaled_dot_product_attention(*leaves, enable_gqa=True, score_mod=text,
                                                 mask_mod="doc(q) == doc(k) && k <= q + 4", mod_inputs=inputs)
    (out * torch.from_numpy(grad)).sum().backward()
    close(out.detach().numpy(), want, "output")
    for name, leaf, expected in zip(("dq", "dk", "dv"), leaves, want_grads):
        close(leaf.grad.numpy(), expected, name)


def test_score_and_mask_functions_on_the_fused_kernel_with_causal_and_long_rows(rng):
    """Flash's tiles (several key tiles, a partial last one, the causal diagonal) against the
    reference, forward and backward, a score function and a mask function together."""
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 4, 150, 32), (1, 2, 150, 32),
                                                                         (1, 2, 150, 32)))
    grad = rng.standard_normal((1, 4, 150, 32)).astype(np.float32)
    kwargs = dict(is_causal=True, enable_gqa=True, score_mod="s - 0.1 * abs(q - k) + bias(k)",
                  mask_mod="doc(q) == doc(k)", mod_inputs={"doc": (np.arange(150) // 40).astype(np.float32),
                                                           "bias": rng.standard_normal(150).astype(np.float32)})
    results = {}
    for backend in ("flash", "reference"):
        out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, backend=backend, **kwargs)
        grads = qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, backend=backend, **kwargs)
        results[backend] = (out, lse, *grads[:3])
    for name, got, want in zip(("output", "lse", "dq", "dk", "dv"), results["flash"], results["reference"]):
        close(got, want, name, tol=1e-4)


def test_mask_function_on_the_fused_kernel_equals_its_keep_tensor(rng):
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 2, 64, 16), (1, 2, 64, 16), (1, 2, 64, 16)))
    doc = (np.arange(64) // 16).astype(np.float32)
    keep = (doc[:, None] == doc[None, :]) & np.tril(np.ones((64, 64), dtype=bool))
    want = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, backend="reference")
    got = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, mask_mod="doc(q) == doc(k)",
                                           mod_inputs={"doc": doc}, backend="flash")
    close(got, want, "output", tol=1e-5)


@pytest.mark.parametrize("kwargs, words", [
    (dict(score_mod="s + nope(k)"), "column 5, found 'nope': unknown function"),
    (dict(score_mod="s / 0"), "division by zero"),
    (dict(score_mod="tanh(s, s)"), "tanh takes 1 argument, found 2"),
    (dict(mask_mod="s > 0"), "a mask function does not read the score s"),
    (dict(score_mod="s + bias(k)", mod_inputs={"bias": np.zeros(3)}), "indexed by k (Nk = 11) it needs L >= 11"),
    (dict(score_mod="s + bias(k)", mod_inputs={"bias": "text"}), "mod_inputs['bias'] must be a (L,) or (B, L)"),
    (dict(score_mod="s * 2", backend="decode"), "backend Decode does not take score_mod"),
])
def test_bad_functions_get_a_clear_error(rng, kwargs, words):
    q = rng.standard_normal((B, HQ, NQ, D)).astype(np.float32)
    k = rng.standard_normal((B, HQ, NK, D)).astype(np.float32)
    with pytest.raises(qkv.Error, match=None) as error:
        qkv.scaled_dot_product_attention(q, k, k, **kwargs)
    assert words in str(error.value)


def test_mask_expression_combines_with_other_masks(rng):
    q = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    doc = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2], dtype=np.float32)
    mask = qkv.Mask.causal() & qkv.Mask.expression("doc(q) == doc(k)", {"doc": doc})
    keep = (doc[:, None] == doc[None, :]) & np.tril(np.ones((9, 9), dtype=bool))
    got = qkv.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    close(got, qkv.scaled_dot_product_attention(q, q, q, attn_mask=keep), "output", tol=1e-6)
    assert str(qkv.Mask.parse("mask: k <= q")) == "mask: k <= q"
