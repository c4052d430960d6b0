"""qkv.torch: qkv's forward and backward as a torch.autograd.Function on CPU float32 tensors.

Gradients against PyTorch autograd in float64, and a tiny attention model trained two steps
(SGD and Adam) with qkv's kernels, matching the same model trained on PyTorch's math path.
"""
import numpy as np
import pytest
import torch

import qkv
import qkv.torch
import torch_reference as ref


def test_forward_matches_math_path(rng):
    q = torch.randn(2, 4, 6, 16)
    k, v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 8)
    keep = torch.from_numpy(rng.random((6, 9)) < 0.7)
    keep[:, 0] = True
    out = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True, enable_gqa=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (2, 4, 6, 8)
    expected, _ = ref.attention(q.numpy(), k.numpy(), v.numpy(), keep=keep & ref.causal_keep(6, 9))
    tol = ref.tolerance(q.numpy(), k.numpy(), v.numpy(), keep=keep & ref.causal_keep(6, 9))
    assert float(np.abs(out.numpy() - expected).max()) <= tol


def test_same_numbers_as_the_numpy_front_end():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    additive = torch.randn(5, 7)
    out = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=additive, key_lengths=[6], scale=0.5)
    np.testing.assert_array_equal(
        out.numpy(), qkv.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=additive.numpy(),
                                                      key_lengths=[6], scale=0.5))


def test_records_a_graph_and_only_needed_grads():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and k.grad is None and v.grad is None
    with torch.no_grad():
        assert not qkv.torch.scaled_dot_product_attention(q, k, v).requires_grad


def reference_sdpa(q, k, v, keep=None, additive=None):
    """PyTorch's math path (any dtype): matmul, masked_fill, softmax, matmul; GQA repeats heads."""
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if additive is not None:
        scores = scores + additive.to(scores.dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("mask", ["none", "causal_bool", "float", "padding"])
def test_gradients_match_pytorch_autograd(rng, mask):
    # Cross shapes (6 queries, 9 keys), Dk 16 != Dv 8, grouped-query heads (4 over 2).
    q = torch.randn(2, 4, 6, 16, requires_grad=True)
    k = torch.randn(2, 2, 9, 16, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, requires_grad=True)
    keep = torch.from_numpy(rng.random((6, 9)) < 0.7)
    keep[:, 0] = True
    additive = torch.randn(2, 4, 6, 9)
    kwargs, ref_kwargs = {
        "none": ({}, {}),
        "causal_bool": ({"attn_mask": keep, "is_causal": True}, {"keep": keep & ref.causal_keep(6, 9)}),
        "float": ({"attn_mask": additive}, {"additive": additive}),
        "padding": ({"key_lengths": [4, 9]}, {"keep": ref.lengths_keep([4, 9], 9)}),
    }[mask]
    grad = torch.randn(2, 4, 6, 8)
    out = qkv.torch.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    got = torch.autograd.grad(out, (q, k, v), grad)
    exact_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(reference_sdpa(*exact_inputs, **ref_kwargs), exact_inputs, grad.double())
    single = torch.autograd.grad(reference_sdpa(q, k, v, **ref_kwargs), (q, k, v), grad)
    for name, g, e, s in zip("qkv", got, expected, single):
        assert g.dtype == torch.float32 and g.shape == e.shape
        tol = 1e-5 + 8 * float((s.double() - e).abs().max())
        diff = float((g.double() - e).abs().max())
        assert diff <= tol, f"d{name}: maxdiff {diff:.3g} > tolerance {tol:.3g}"


class TinyAttentionModel(torch.nn.Module):
    """Embedding-free toy: project to q/k/v, causal attention over 2 heads, project out."""

    def __init__(self, attention, dim=16, heads=2):
        super().__init__()
        self.heads, self.attention = heads, attention
        # No bias on the q/k/v projection: a key bias shifts every score of a row equally, so its
        # exact gradient is zero, and Adam would scale either side's rounding noise (~1e-9) into
        # full-size, unrelated steps there.
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = self.attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_training_steps_match_pure_pytorch(optimizer):
    torch.manual_seed(0)
    theirs = TinyAttentionModel(lambda q, k, v: reference_sdpa(q, k, v, keep=ref.causal_keep(q.shape[2], q.shape[2])))
    ours = TinyAttentionModel(lambda q, k, v: qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True))
    ours.load_state_dict(theirs.state_dict())
    initial = {name: p.detach().clone() for name, p in theirs.named_parameters()}
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3)}[optimizer]
    opt_theirs, opt_ours = make(theirs.parameters()), make(ours.parameters())
    x, target = torch.randn(3, 7, 16), torch.randn(3, 7, 16)
    losses = []
    for _ in range(2):
        for model, opt in ((theirs, opt_theirs), (ours, opt_ours)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    np.testing.assert_allclose(losses[0::2], losses[1::2], rtol=1e-5)  # theirs, ours at each step
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert not torch.equal(b, initial[name]), f"{name} did not train"
        np.testing.assert_allclose(b.detach().numpy(), a.detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_rejects_other_dtypes_with_a_value_error():
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"query is torch.float64 on cpu; qkv runs on CPU float32 tensors"):
        qkv.torch.scaled_dot_product_attention(x, x, x)
    y = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: q is \(3, 4\) but k is \(3, 5\)"):
        qkv.torch.scaled_dot_product_attention(y, torch.randn(3, 5), torch.randn(3, 5))


def test_attribute_access_imports_the_submodule():
    assert qkv.torch.ScaledDotProductAttention.__mro__[1] is torch.autograd.Function
